import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from ffkv_runs import add_analyses, copy_run, index_run  # noqa: E402


@pytest.fixture(scope="session")
def indexed(tmp_path_factory):
    """(run, loaded): a tiny GPT-2 run with fake analyses and the explorer's lookup tables prepared."""
    run, loaded = index_run(tmp_path_factory.mktemp("indexed"))
    add_analyses(run)
    from ffkv.explorer.data import ExplorerData

    ExplorerData(run, loaded).close()
    return run, loaded


@pytest.fixture
def fresh_run(indexed, tmp_path):
    """A private copy of the indexed run (for tests that write annotations)."""
    run, loaded = indexed
    return copy_run(run, tmp_path / "run"), loaded
