"""The ffkv command with ``--model tiny-gpt2``: a tiny random GPT-2 and a character tokenizer (no files).

In a test process: `install` (or the `tiny_gpt2` fixture of tests/cli). In a subprocess (a
read-only or full file system, another user, a second writer): ``python -m support.tiny_cli
index ...``. With ``FFKV_TEST_PAUSE=DIR`` the index pauses at its second batch: it creates
DIR/paused and waits for DIR/go, so that a test can act while it holds the run.
"""

from __future__ import annotations

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
    import ffkv.index.indexer as indexer

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


if __name__ == "__main__":
    install()
    if os.environ.get("FFKV_TEST_PAUSE"):
        pause_at_second_batch(Path(os.environ["FFKV_TEST_PAUSE"]))
    sys.exit(cli.main(sys.argv[1:]))
