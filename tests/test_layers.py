"""The import layering of pyproject.toml ([tool.importlinter]) holds, and the check catches a forbidden import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "ffkv"


def lint_imports(source_root: Path) -> subprocess.CompletedProcess:
    """Run import-linter with the project's contract on the `ffkv` package found under `source_root`."""
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    return subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=source_root,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_layers_are_kept():
    result = lint_imports(REPO / "src")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, forbidden", [
    ("report/html.py", "from ffkv.explorer import pages"),           # siblings never import each other
    ("experiments/values.py", "from ffkv.indexing import merge"),       # index and experiments are siblings
    ("memories/view.py", "from ffkv.corpus import CorpusSpec"),      # the model side never reads corpora
    ("store/run.py", "import ffkv.experiments.common"),              # the run contract sits below everything
    ("experiments/census.py", "import ffkv.tools"),                  # the tools sit above the analysis core
])
def test_a_forbidden_import_breaks_the_contract(tmp_path, module, forbidden):
    copy = tmp_path / "src" / "ffkv"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{forbidden}  # added by the test\n")
    result = lint_imports(tmp_path / "src")
    assert result.returncode != 0 and "BROKEN" in result.stdout.upper(), result.stdout[-3000:]
