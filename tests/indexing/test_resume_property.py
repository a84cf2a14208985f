"""Property: stop an index at any batch (an error, or Ctrl-C), resume it with changed options, and the
result is the uninterrupted run's, byte for byte, or the resume is refused with one line naming the option.

Refused exactly when a checkpoint exists that another batching cut (or the options define another
run); options that do not cut batches (checkpoint interval, part size) may always change.
"""

from __future__ import annotations

import itertools
import os
import signal
from contextlib import contextmanager
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ffkv.indexing.indexer as indexer
from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.store.run import RunDir
from support.helpers import loaded_tiny
from support.scratch import memory_dir

RUNS = itertools.count()
OPTIONS = IndexOptions(top_k=5)
BATCHING = BatchOptions(batch_size=4, window_batches=2, part_rows=5)
#: change -> (new IndexOptions, new BatchOptions, the words a refusal must contain, or None: never refused)
CHANGES = {
    "nothing": (OPTIONS, BATCHING, None),
    "batch size": (OPTIONS, replace(BATCHING, batch_size=3), "--batch-size 3"),
    "window": (OPTIONS, replace(BATCHING, window_batches=3), "window_batches 3"),
    "batch tokens": (OPTIONS, replace(BATCHING, max_batch_tokens=30), "--max-batch-tokens 30"),
    "interval": (OPTIONS, replace(BATCHING, checkpoint_seconds=0), None),
    "part rows": (OPTIONS, replace(BATCHING, part_rows=2), None),
    "top-k": (IndexOptions(top_k=6), BATCHING, "different run"),
    "mode": (IndexOptions(top_k=5, mode="prefix"), BATCHING, "different run"),
}


class Stop(Exception):
    """An error that stops the run (the run is marked failed, its last checkpoint kept)."""


@contextmanager
def stopped_at(batch: int, how: str):
    """Stop the index at its `batch`-th batch: by an error, or by Ctrl-C (saved at the next batch)."""
    real, seen = indexer.index_batch, [0]

    def wrapper(*args):
        seen[0] += 1
        if seen[0] == batch:
            if how == "error":
                raise Stop
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    indexer.index_batch = wrapper
    try:
        yield
    finally:
        indexer.index_batch = real


@pytest.fixture(scope="module")
def world():
    with memory_dir("ffkv-resume-") as root:
        corpus = root / "corpus.txt"
        corpus.write_text("".join(f"line {i} " + "xy" * (i % 5) + "\n" for i in range(32)))
        yield root, loaded_tiny("gpt2"), CorpusSpec(source=str(corpus), unit="line"), {}


def reference(world, options, batching):
    root, loaded, spec, done = world
    key = (options, replace(batching, checkpoint_seconds=300, part_rows=5))
    if key not in done:
        done[key] = build_index(loaded, spec, root / f"reference-{len(done)}", options, batching, progress=False)
    return done[key]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.integers(1, 8), how=st.sampled_from(["error", "ctrl-c"]),
       interval=st.sampled_from([0, 1e6]), change=st.sampled_from(sorted(CHANGES)))
def test_resume_is_exact_or_refused(world, batch, how, interval, change):
    root, loaded, spec, _ = world
    out = root / f"run-{next(RUNS)}"
    first = replace(BATCHING, checkpoint_seconds=interval)
    with stopped_at(batch, how), pytest.raises(Stop if how == "error" else KeyboardInterrupt):
        build_index(loaded, spec, out, OPTIONS, first, progress=False)
    run = RunDir(out)
    assert run.manifest().status == ("failed" if how == "error" else "interrupted")
    checkpointed = (run.partial / "checkpoint.pt").exists()
    options, batching, refusal = CHANGES[change]
    refused = refusal == "different run" or (refusal is not None and checkpointed)
    if refused:
        with pytest.raises(FfkvError, match=refusal):
            build_index(loaded, spec, out, options, batching, progress=False, resume=True)
        assert not run.manifest().complete
        options, batching = OPTIONS, first  # resuming as it was started finishes it
    resumed = build_index(loaded, spec, out, options, batching, progress=False, resume=True)
    expected = reference(world, options, batching)
    for table in ("examples", "trigger_examples"):
        assert resumed.table(table).read_bytes() == expected.table(table).read_bytes()
    assert resumed.manifest().complete and not run.partial.exists()
