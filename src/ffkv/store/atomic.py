"""Atomic file writes: write to a temporary name in the same folder, then rename.

A reader never sees a half-written file, and an interrupted run leaves at most a
stray temporary file (``.NAME.*.tmp``, removed by the next writer: `RunDir.lock`),
never a table that reads as complete. The file is fsynced before the rename and its
folder after it, so a table that exists after a crash of the machine is whole too.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

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
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    except BaseException as error:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(error, OSError) and error.errno and not error.filename:  # e.g. from pyarrow: name the file
            raise OSError(error.errno, os.strerror(error.errno), str(path)) from error
        raise


def fsync(path: str | os.PathLike) -> None:
    """Flush a file, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno != errno.EINVAL:  # a file system that cannot sync a folder (some network ones)
            raise
    finally:
        os.close(fd)


class _Recording:
    """A binary file that remembers the OSError of a failed write (libraries such as torch.save
    report a full disk as a RuntimeError without the cause)."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def write_with(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Write a file atomically with `write(handle)` (e.g. ``lambda f: torch.save(obj, f)``); a failed
    write raises its OSError (ENOSPC, EROFS, ...) whatever the library made of it."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        recording = _Recording(handle)
        try:
            write(recording)
        except Exception:
            if recording.error is not None:
                raise recording.error from None
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
