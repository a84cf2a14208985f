"""Scratch folders in memory: tests that write many small checkpoints pay no disk syncs there."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SHM = Path("/dev/shm")


@contextmanager
def memory_dir(prefix: str = "ffkv-") -> Iterator[Path]:
    """A temporary folder on /dev/shm where it is writable, else in the system's temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=SHM if os.access(SHM, os.W_OK) else None))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
