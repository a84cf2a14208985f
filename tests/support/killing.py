"""Kill -9 an index at seeded points, in real processes, then resume it (tests/indexing/test_kill.py).

Run as ``python -m support.killing JOB.json`` with tests/ on the path. The server loads a
tiny model once and never runs it; every index attempt runs in a child forked from it,
so that each kill is a real SIGKILL of a real process (nothing runs on the way out: no
except, no finally, no atexit), and each resume is a fresh process that finds only
what the killed one left on disk.

A kill point is drawn from its seed: either the k-th event of the run (a batch, a
rename, an fsync: k uniform over the events of an uninterrupted run) or a moment
(uniform over an uninterrupted run's time). Some points kill the resume too. The
server writes a JSON report: per point, what was drawn and how each attempt ended.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from pathlib import Path


def _arm(kill: dict | None, counter: Path | None = None) -> None:
    """In the child: SIGKILL this process at the kill point, or count the events into `counter`."""
    import ffkv.indexing.indexer as indexer
    from ffkv.store import atomic

    if kill is not None and kill["kind"] == "time":
        threading.Timer(kill["at"], os.kill, (os.getpid(), signal.SIGKILL)).start()
        return
    seen = [0]

    def event() -> None:
        seen[0] += 1
        if kill is not None and seen[0] == kill["at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if counter is not None:
            counter.write_text(str(seen[0]))

    def counted(fn):
        def wrapper(*args, **kwargs):
            event()  # before the call: a batch not run, a file written but not renamed, not synced
            return fn(*args, **kwargs)
        return wrapper

    indexer.index_batch = counted(indexer.index_batch)
    atomic.fsync = counted(atomic.fsync)
    os.replace = counted(os.replace)


def _attempt(job: dict, loaded, out: Path, resume: bool, kill: dict | None, workers: int = 0,
             counter: Path | None = None) -> str:
    """One index attempt in a forked child: "ok", "killed", or "exit N: message"."""
    from ffkv.corpus import CorpusSpec
    from ffkv.errors import FfkvError
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index

    err = out.parent / f".{out.name}.err"
    pid = os.fork()
    if pid == 0:  # the child: index, then leave without any cleanup of the parent's
        code = 0
        try:
            _arm(kill, counter)
            build_index(loaded, CorpusSpec(**job["corpus"]), out, IndexOptions(**job["options"]),
                        BatchOptions(**job["batching"], tokenizer_workers=workers), resume=resume, progress=False)
        except FfkvError as error:
            err.write_text(str(error))
            code = 2
        except BaseException:  # noqa: BLE001 - reported to the test
            err.write_text(traceback.format_exc())
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return "ok" if code == 0 else f"exit {code}: {err.read_text() if err.exists() else ''}"


def _draw(seed: int, n_events: int, seconds: float) -> dict:
    rng = random.Random(seed)
    if rng.random() < 0.6:
        return {"kind": "event", "at": rng.randint(1, n_events)}
    return {"kind": "time", "at": round(rng.uniform(0.0, 0.9 * seconds), 4)}


def serve(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)  # the children fork from here: no thread pool to inherit
    from ffkv.store.state import run_state
    from support.helpers import loaded_tiny

    loaded = loaded_tiny("gpt2")
    root = Path(job["root"])
    counter = root / "events"
    warm = _attempt(job, loaded, root / "warm", False, None, counter=counter)  # counts the events
    start = time.perf_counter()
    reference = _attempt(job, loaded, root / "reference", False, None)  # times a run, past first-call costs
    seconds = time.perf_counter() - start
    n_events = int(counter.read_text()) if warm == "ok" else 1
    report = {"reference": reference, "n_events": n_events, "seconds": seconds, "points": []}
    for seed in job["seeds"]:
        rng = random.Random(seed)
        out = root / f"seed-{seed}"
        workers = 2 if rng.random() < 0.25 else 0  # tokenizer processes forked while the lock is held
        kills = [_draw(seed, n_events, seconds)]
        if rng.random() < 0.3:  # kill the resume as well
            kills.append(_draw(seed + 10_000, n_events, seconds))
        attempts, states = [], []
        for kill in kills:
            attempts.append(_attempt(job, loaded, out, (out / "manifest.json").exists(), kill, workers))
            if attempts[-1] == "killed" and (out / "manifest.json").exists():
                states.append(run_state(out).status)  # what `ffkv status` says of the killed run
        manifest = out / "manifest.json"
        if not manifest.exists() or json.loads(manifest.read_text())["status"] != "complete":
            attempts.append(_attempt(job, loaded, out, manifest.exists(), None))
        report["points"].append({"seed": seed, "workers": workers, "kills": kills, "attempts": attempts,
                                 "states": states})
    return report


if __name__ == "__main__":
    job = json.loads(Path(sys.argv[1]).read_text())
    Path(job["report"]).write_text(json.dumps(serve(job), indent=1))
