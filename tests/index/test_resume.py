"""An interrupted index resumes from its checkpoint and ends with the identical result."""

from __future__ import annotations

import os
import signal

import pandas as pd
import pytest

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.index.indexer import BatchOptions, IndexOptions, build_index
from ffkv.store.run import RunDir
from support.helpers import loaded_tiny


class Killed(Exception):
    """Stands for a process killed without warning (no checkpoint on the way out)."""


@pytest.fixture
def setup(tmp_path):
    lines = [f"line {i} " + "ab" * (i % 7) for i in range(60)]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    spec = CorpusSpec(source=str(tmp_path / "c.txt"), unit="line")
    return loaded_tiny("gpt2"), spec


def read(run):
    return (pd.read_parquet(run.table("trigger_examples")), pd.read_parquet(run.table("examples")))


@pytest.mark.parametrize("how", ["killed", "ctrl-c"])
def test_resume_equals_uninterrupted(tmp_path, setup, how):
    loaded, spec = setup
    options = IndexOptions(top_k=7, mode="example")
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=0, part_rows=5)
    whole = build_index(loaded, spec, tmp_path / "whole", options, batching, progress=False)

    def interrupt(n_windows):
        if n_windows == 3:
            if how == "killed":
                raise Killed
            os.kill(os.getpid(), signal.SIGINT)  # noticed at the next batch

    with pytest.raises(Killed if how == "killed" else KeyboardInterrupt):
        build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False, after_window=interrupt)
    cut = RunDir(tmp_path / "cut")
    assert cut.manifest().status != "complete"
    assert not cut.table("trigger_examples").exists()
    with pytest.raises(FfkvError, match="--resume"):
        build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False)
    resumed = build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False, resume=True)
    assert resumed.manifest().status == "complete"
    for a, b in zip(read(whole), read(resumed)):
        pd.testing.assert_frame_equal(a, b)
    assert not (tmp_path / "cut" / ".partial").exists()


def test_other_run_in_out_dir_is_refused(tmp_path, setup):
    loaded, spec = setup
    build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=3), progress=False)
    with pytest.raises(FfkvError, match="different run"):
        build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=4), progress=False)
    with pytest.raises(FfkvError, match="already holds this run"):
        build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=3), progress=False)


def test_tokenizing_processes_give_the_same_run(tmp_path, setup):
    loaded, spec = setup
    options = IndexOptions(top_k=5)
    plain = build_index(loaded, spec, tmp_path / "plain", options, BatchOptions(batch_size=8, tokenizer_workers=0),
                        progress=False)
    ahead = build_index(loaded, spec, tmp_path / "ahead", options, BatchOptions(batch_size=8, tokenizer_workers=3),
                        progress=False)
    for a, b in zip(read(plain), read(ahead)):
        pd.testing.assert_frame_equal(a, b)
