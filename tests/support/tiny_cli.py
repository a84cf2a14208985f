"""The ffkv command with ``--model tiny-gpt2``: a tiny random GPT-2 and a character tokenizer (no files).

In a test process: `install` (or the `tiny_gpt2` fixture of tests/cli). In a subprocess (a
read-only or full file system, another user, a second writer): ``python -m support.tiny_cli
index ...``, or ``python -m support.tiny_cli --many JOBS.json RESULTS.json`` for several commands
in one process (JOBS: name -> argv; RESULTS: name -> exit code, stderr and the run's status).
With ``FFKV_TEST_PAUSE=DIR`` the index pauses at its second batch: it creates DIR/paused and
waits for DIR/go, so that a test can act while it holds the run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

from ffkv import cli
from ffkv.models import loading


def loader(name, dtype, device):
    if name == "tiny-gpt2":
        from support.helpers import loaded_tiny

        got = loaded_tiny("gpt2")
        return got.model, got.tokenizer
    return None


def install() -> None:
    if loader not in loading.LOADERS:
        loading.LOADERS.insert(0, loader)


def pause_at_second_batch(folder: Path) -> None:
    import ffkv.indexing.indexer as indexer

    real, seen = indexer.index_batch, [0]

    def wrapper(*args):
        seen[0] += 1
        if seen[0] == 2:
            (folder / "paused").write_text(str(os.getpid()))
            deadline = time.time() + 120
            while not (folder / "go").exists() and time.time() < deadline:
                time.sleep(0.05)
        return real(*args)

    indexer.index_batch = wrapper


def many(jobs: Path, results: Path) -> None:
    done = {}
    for name, argv in json.loads(jobs.read_text()).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as exit_:
                code = exit_.code
        manifest = Path(argv[argv.index("--out") + 1]) / "manifest.json" if "--out" in argv else None
        status = json.loads(manifest.read_text())["status"] if manifest and manifest.exists() else None
        done[name] = {"code": code, "err": err.getvalue(), "status": status}
    results.write_text(json.dumps(done))


if __name__ == "__main__":
    install()
    if os.environ.get("FFKV_TEST_PAUSE"):
        pause_at_second_batch(Path(os.environ["FFKV_TEST_PAUSE"]))
    if sys.argv[1:2] == ["--many"]:
        many(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    sys.exit(cli.main(sys.argv[1:]))
