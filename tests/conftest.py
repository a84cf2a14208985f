"""Runs built once per test session by the real pipeline, shared by the surface tests."""

import os

import pytest

# eai-sparsify decodes through a Triton kernel whenever Triton is installed, whatever the device, so on a machine
# without a GPU its parity tests would fail inside Triton ("0 active drivers"). The test extra installs Triton for
# the index's kernel (run in Triton's interpreter, tests/indexing/test_extremes.py): sparsify decodes eagerly.
os.environ.setdefault("SPARSIFY_DISABLE_TRITON", "1")

from support.runs import analyzed_run, copy_run, index_run


@pytest.fixture(scope="session")
def analyzed(tmp_path_factory):
    """(run, loaded): a tiny GPT-2 run, indexed and analysed with every experiment."""
    return analyzed_run(tmp_path_factory.mktemp("analyzed"))


@pytest.fixture(scope="session")
def index_only(tmp_path_factory):
    """A run with only the index: no analyses, no explorer tables."""
    run, _ = index_run(tmp_path_factory.mktemp("index_only"))
    return run


@pytest.fixture
def fresh_run(analyzed, tmp_path):
    """A private copy of the analysed run (for tests that write into it)."""
    run, loaded = analyzed
    return copy_run(run, tmp_path / "run"), loaded
