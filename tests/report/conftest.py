import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "explorer"))

from ffkv_runs import add_analyses, index_run  # noqa: E402


@pytest.fixture(scope="session")
def index_only(tmp_path_factory):
    """A run with only the index: no analyses, no explorer tables."""
    run, _ = index_run(tmp_path_factory.mktemp("index_only"))
    return run


@pytest.fixture(scope="session")
def analysed(tmp_path_factory):
    run, _ = index_run(tmp_path_factory.mktemp("analysed"))
    add_analyses(run)
    return run
