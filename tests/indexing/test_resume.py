"""An interrupted index resumes from its checkpoint and ends with the identical result."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
from dataclasses import replace

import pandas as pd
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.checkpoint import Checkpoint
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.indexing.topk import EMPTY
from ffkv.store.lock import RunLocked
from ffkv.store.run import RunDir
from ffkv.store.state import run_state
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
    return tuple(pd.read_parquet(run.table(name)) for name in ("trigger_examples", "examples",
                                                               "control_trigger_examples", "control_keys"))


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
    assert resumed.manifest().sign == "both" and set(read(resumed)[0]["direction"]) == {1, -1}  # GELU: signed


@pytest.mark.parametrize("family,mode", [("llama", "prefix"), ("llama", "example"), ("opt", "prefix")])
def test_resume_equals_uninterrupted_in_both_directions(tmp_path, setup, family, mode):
    """A gated model's signed state (and a ReLU model's positive one) checkpoints and resumes exactly."""
    _, spec = setup
    loaded = loaded_tiny(family)
    options = IndexOptions(top_k=5, mode=mode)
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=0, part_rows=5)
    whole = build_index(loaded, spec, tmp_path / "whole", options, batching, progress=False)
    with pytest.raises(KeyboardInterrupt):
        build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False, after_window=ctrl_c_at(3))
    resumed = build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False, resume=True)
    assert same_bytes(whole, resumed)
    assert resumed.manifest().sign == ("positive" if family == "opt" else "both")


def test_unfinished_run_of_an_older_format_is_refused(tmp_path, setup):
    """An unfinished run of format 2 (one direction, no `direction` column) is not continued by this ffkv."""
    import json

    loaded, spec = setup
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=0)
    with pytest.raises(KeyboardInterrupt):
        build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=5), batching, progress=False,
                    after_window=ctrl_c_at(2))
    path = tmp_path / "run" / "manifest.json"
    data = json.loads(path.read_text())
    data["format_version"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(FfkvError, match="unfinished run of an older ffkv \\(run format 2; this ffkv writes 3\\)"):
        build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=5), batching, progress=False, resume=True)


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


# ------------------------------------------------------------------ resume is exact or refused

def ctrl_c_at(n):
    """An after_window hook that presses Ctrl-C after window n (noticed at the next batch, mid-window)."""
    def hook(n_windows):
        if n_windows == n:
            os.kill(os.getpid(), signal.SIGINT)
    return hook


def same_bytes(a, b):
    return all(a.table(t).read_bytes() == b.table(t).read_bytes() for t in ("examples", "trigger_examples"))


def test_resume_with_another_batch_size_is_refused_naming_it(tmp_path, setup):
    """The audit's wrong result: a mid-window Ctrl-C, then --resume with another --batch-size, exited 0
    with other tokens and other trigger rows. Now the checkpoint's batching must be kept."""
    loaded, spec = setup
    options = IndexOptions(top_k=7)
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=1e6)
    with pytest.raises(KeyboardInterrupt):
        build_index(loaded, spec, tmp_path / "run", options, batching, progress=False, after_window=ctrl_c_at(2))
    for change, option in [({"batch_size": 8}, "--batch-size 8"), ({"max_batch_tokens": 40}, "--max-batch-tokens 40"),
                           ({"window_batches": 3}, "window_batches")]:
        with pytest.raises(FfkvError, match=f"cannot resume with {option}.*checkpoint was made with"):
            build_index(loaded, spec, tmp_path / "run", options, replace(batching, **change), progress=False,
                        resume=True)
    assert RunDir(tmp_path / "run").manifest().status == "interrupted"
    # What does not cut batches may change: the result is the uninterrupted run's.
    resumed = build_index(loaded, spec, tmp_path / "run", options,
                          replace(batching, checkpoint_seconds=0, part_rows=3), progress=False, resume=True)
    whole = build_index(loaded, spec, tmp_path / "whole", options, batching, progress=False)
    assert same_bytes(resumed, whole)


def test_a_second_resume_while_the_first_runs_is_refused(tmp_path, setup):
    """The audit's wrong result: two `--resume` at once both exited 0 and left a run marked complete
    with 196 of 452 examples. Now the second gets one line naming the first."""
    loaded, spec = setup
    options, batching = IndexOptions(top_k=7), BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=0)
    with pytest.raises(Killed):
        build_index(loaded, spec, tmp_path / "run", options, batching, progress=False,
                    after_window=lambda n: (_ for _ in ()).throw(Killed()) if n == 2 else None)
    inside, release = threading.Event(), threading.Event()

    def pause(n_windows):
        if n_windows == 4:
            inside.set()
            release.wait(30)

    first = {}
    thread = threading.Thread(target=lambda: first.update(run=build_index(
        loaded, spec, tmp_path / "run", options, batching, progress=False, resume=True, after_window=pause)))
    thread.start()
    try:
        assert inside.wait(30)
        manifest = RunDir(tmp_path / "run").manifest()
        assert manifest.status == "running" and manifest.process.pid == os.getpid()
        with pytest.raises(RunLocked, match=rf"is being written by `ffkv index` \(pid {os.getpid()} on "
                                            rf"{socket.gethostname()}, since .*\); wait for it to finish"):
            build_index(loaded, spec, tmp_path / "run", options, batching, progress=False, resume=True)
        assert run_state(tmp_path / "run").alive is True
    finally:
        release.set()
        thread.join()
    whole = build_index(loaded, spec, tmp_path / "whole", options, batching, progress=False)
    assert first["run"].manifest().complete and same_bytes(first["run"], whole)


def test_relative_and_absolute_corpus_paths_are_one_run(tmp_path, setup, monkeypatch):
    """A corpus is known by its content: a run started with a relative path resumes with the absolute
    one, and a copy elsewhere is the same corpus; one byte changed is another."""
    loaded, spec = setup
    monkeypatch.chdir(tmp_path)
    options, batching = IndexOptions(top_k=5), BatchOptions(batch_size=4, window_batches=2)
    with pytest.raises(KeyboardInterrupt):
        build_index(loaded, replace(spec, source="c.txt"), tmp_path / "run", options, batching, progress=False,
                    after_window=ctrl_c_at(2))
    resumed = build_index(loaded, replace(spec, source=str(tmp_path / "c.txt")), tmp_path / "run", options,
                          batching, progress=False, resume=True)
    assert same_bytes(resumed, build_index(loaded, spec, tmp_path / "whole", options, batching, progress=False))
    copy = tmp_path / "elsewhere" / "copy.txt"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "c.txt", copy)
    with pytest.raises(FfkvError, match="already holds this run"):
        build_index(loaded, replace(spec, source=str(copy)), tmp_path / "run", options, batching, progress=False)
    copy.write_text(copy.read_text().replace("line 30", "line 3O"))
    with pytest.raises(FfkvError, match="holds a different run"):
        build_index(loaded, replace(spec, source=str(copy)), tmp_path / "run", options, batching, progress=False)


def test_checkpoints_come_on_time_inside_a_window(tmp_path, setup, monkeypatch):
    """One window of 60 examples; the interval is honoured after each batch, not once per window."""
    loaded, spec = setup
    saved = []
    real = Checkpoint.save
    monkeypatch.setattr(Checkpoint, "save", lambda self, path: (saved.append(self.groups_done), real(self, path)))
    build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=5),
                BatchOptions(batch_size=4, window_batches=100, checkpoint_seconds=0), progress=False)
    assert saved[:3] == [1, 2, 3] and len(saved) >= 15  # after every batch of the one window


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0, "5"])
def test_checkpoint_interval_must_be_finite(seconds):
    with pytest.raises(FfkvError, match="--checkpoint-seconds must be a finite number of seconds >= 0"):
        BatchOptions(checkpoint_seconds=seconds).validate()


def test_a_writer_killed_before_its_first_manifest_leaves_a_usable_folder(tmp_path, setup):
    """kill -9 between creating .partial/ and writing the manifest (test_kill found it) leaves the lock and
    .partial/ only: the same command then starts the run; a folder with anything else is still refused."""
    loaded, spec = setup
    options, batching = IndexOptions(top_k=3), BatchOptions(batch_size=8)
    out = tmp_path / "run"
    (out / ".partial").mkdir(parents=True)
    (out / ".lock").write_text("")
    (out / ".partial" / "examples-000000.parquet").write_text("a part of a run that never wrote its manifest")
    run = build_index(loaded, spec, out, options, batching, progress=False)
    assert same_bytes(run, build_index(loaded, spec, tmp_path / "whole", options, batching, progress=False))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FfkvError, match="is not empty and holds no ffkv run"):
        build_index(loaded, spec, tmp_path / "other", options, batching, progress=False)


@pytest.mark.parametrize("checkpoint_seconds", [0, 3600])  # checkpoints along the way, or none before the end
def test_failed_table_write_resumes_with_nothing_left_to_index(tmp_path, setup, monkeypatch, checkpoint_seconds):
    """A table write that fails at the end saves the finished state then; the resume only writes the tables,
    and its tables equal an uninterrupted run's."""
    import ffkv.indexing.indexer as indexer

    loaded, spec = setup
    options = IndexOptions(top_k=5)
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=checkpoint_seconds, part_rows=5)
    whole = build_index(loaded, spec, tmp_path / "whole", options, batching, progress=False)
    write = indexer.write_triggers

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(indexer, "write_triggers", full_disk)
    with pytest.raises(FfkvError):
        build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False)
    cut = RunDir(tmp_path / "cut")
    assert cut.manifest().status == "failed" and not cut.table("trigger_examples").exists()
    saved = Checkpoint.load(cut.partial / "checkpoint.pt", "cpu")
    assert saved.consumed == 60  # every example of the corpus: nothing left to index
    monkeypatch.setattr(indexer, "write_triggers", write)
    resumed = build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False, resume=True)
    assert resumed.manifest().status == "complete"
    assert resumed.manifest().counts == whole.manifest().counts
    for a, b in zip(read(whole), read(resumed)):
        pd.testing.assert_frame_equal(a, b)


def _state(name: str, change):
    def alter(saved):
        saved["state"][name] = change(saved["state"][name])
    return alter


def _k(saved, k=5):
    for name in list(saved["state"]):
        saved["state"][name] = saved["state"][name][..., :k].contiguous()


CRAFTED = {
    "a top-k of 5 where the run keeps 7": (_k, "state.values has shape (3, 80, 5), not (3, 80, 7)"),
    "scores of another k than the rest": (_state("values", lambda t: t[..., :5].contiguous()),
                                          "state.values has shape (3, 80, 5), not (3, 80, 7)"),
    "a layer too few": (_state("values", lambda t: t[:2].contiguous()),
                        "state.values has shape (2, 80, 7), not (3, 80, 7)"),
    "negative example ids": (_state("example_id", lambda t: torch.where(t == EMPTY, t, -t - 1)),
                             "state.example_id holds"),
    "positions as floats": (_state("position", lambda t: t.float()),
                            "state.position is torch.float32, not torch.int32"),
    "next tokens below -1": (_state("next_token", lambda t: t - 5), "state.next_token holds"),
    "control scores of another width": (lambda saved: saved["control"].__setitem__(
        "values", saved["control"]["values"][:, :3].contiguous()), "control.values has shape (3, 3, 7)"),
    "a count as text": (lambda saved: saved.__setitem__("consumed", "12"), "consumed is '12' (str), not a count"),
    "a negative count": (lambda saved: saved.__setitem__("consumed", -5), "consumed is -5 (int), not a count"),
    "a NaN elapsed time": (lambda saved: saved.__setitem__("elapsed", float("nan")), "elapsed is nan, not a finite"),
    "an unknown entry": (lambda saved: saved.__setitem__("extra", 1), "the top level holds unexpected 'extra'"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_checkpoint_is_refused_before_anything_merges_into_it(case, tmp_path, setup):
    """A checkpoint changed in one entry: refused in one line naming the file and the entry (a state of another
    top-k, or negative ids, or a count of "12", resumed into other tables without a word; others into tracebacks)."""
    change, expected = CRAFTED[case]
    loaded, spec = setup
    options = IndexOptions(top_k=7, mode="example")
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=0, part_rows=5)

    def killed(n_windows):
        if n_windows == 3:
            raise Killed

    with pytest.raises(Killed):
        build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False, after_window=killed)
    path = tmp_path / "cut" / ".partial" / "checkpoint.pt"
    saved = torch.load(path, weights_only=True)
    change(saved)
    torch.save(saved, path)
    with pytest.raises(FfkvError) as refused:
        build_index(loaded, spec, tmp_path / "cut", options, batching, progress=False, resume=True)
    assert f"the checkpoint {path} cannot be resumed: {expected}" in str(refused.value), str(refused.value)
    assert str(refused.value).endswith("choose a new --out")
    assert not RunDir(tmp_path / "cut").table("trigger_examples").exists()
