"""kill -9 at seeded points, in real processes, then --resume: the tables are byte-identical every time.

`support.killing` runs every attempt in a process forked from one server (the model is
loaded once), kills it with SIGKILL at the k-th event (a batch, a rename, an fsync) or
at a random moment, sometimes kills the resume too, and resumes until complete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ffkv.store.run import RunDir
from support.scratch import memory_dir

SEEDS = list(range(24))
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def killed():
    # In memory: what a kill leaves does not depend on the disk, and the many checkpoints sync for free.
    with memory_dir("ffkv-kill-") as root:
        yield from _kill_runs(root)


def _kill_runs(root: Path):
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"line {i} " + "ab" * (i % 7) + "\n" for i in range(60)))
    job = {"root": str(root), "report": str(root / "report.json"), "seeds": SEEDS,
           "corpus": {"source": str(corpus), "unit": "line"}, "options": {"top_k": 7, "mode": "example"},
           "batching": {"batch_size": 4, "window_batches": 2, "checkpoint_seconds": 0, "part_rows": 5}}
    (root / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "support.killing", str(root / "job.json")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    yield root, json.loads((root / "report.json").read_text())


def test_the_reference_run_is_whole(killed):
    root, report = killed
    assert report["reference"] == "ok" and report["n_events"] > 50
    assert RunDir(root / "reference").manifest().complete


@pytest.mark.parametrize("seed", SEEDS)
def test_killed_then_resumed_equals_uninterrupted(killed, seed):
    root, report = killed
    point = next(p for p in report["points"] if p["seed"] == seed)
    assert all(a in ("ok", "killed") for a in point["attempts"]), point
    # A killed run never reads as running (its lock is free) and is complete only when the kill came after that.
    assert all(state in ("interrupted", "complete") for state in point["states"]), point
    run = RunDir(root / f"seed-{seed}")
    manifest = run.manifest()
    assert manifest.complete and manifest.process is None and manifest.error is None, point
    for table in ("examples", "trigger_examples", "control_trigger_examples", "control_keys"):
        assert run.table(table).read_bytes() == RunDir(root / "reference").table(table).read_bytes(), point
    if run.partial.exists():  # the kill came after the run was marked complete: the next writer cleans
        with run.lock("analyze"):
            pass
    assert not run.partial.exists()
    assert not list(run.path.rglob("*.tmp")), point
    assert run.lock_path.read_text() == ""  # no writer recorded: every kill's record was replaced


def test_some_kills_hit_each_kind_of_point(killed):
    _, report = killed
    kinds = {k["kind"] for p in report["points"] for k in p["kills"]}
    assert kinds == {"event", "time"}
    assert sum(a == "killed" for p in report["points"] for a in p["attempts"]) >= 20
    assert any(p["workers"] for p in report["points"])
