"""Atomic file writes: write to a temporary name in the same folder, then rename.

A reader never sees a half-written file, and an interrupted run leaves at most a
stray temporary file, never a table that reads as complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq


def make_readable(path: str | os.PathLike) -> None:
    """Give a file the permissions open() would (0666 less the umask); mkstemp makes 0600."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    make_readable(tmp)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write bytes atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON (indented, keys in insertion order) atomically."""
    write_bytes(path, (json.dumps(obj, indent=2, default=str) + "\n").encode())


def write_parquet(path: str | os.PathLike, table: pa.Table) -> None:
    """Write one Arrow table as Parquet atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
