"""Atomic file writes: write to a temporary name in the same folder, then rename.

A reader never sees a half-written file, and an interrupted run leaves at most a
stray temporary file (``.NAME.*.tmp``), never a table that reads as complete. The file
is fsynced before the rename and its folder after it, so a table that exists after a
crash of the machine is whole too.

While it is written, a temporary file (or folder: `atomic_folder`) is held under an
OS lock (flock) by its writer; the kernel drops that lock when the writer ends in any
way. `clean_stale` removes the temporaries of a name whose lock is free: those of a
writer that was killed, never those of one that still writes. Every atomic write of a
name first cleans that name's, so whatever command was killed, its next run cleans up
after it (and a run's writer cleans the whole run: `RunDir.lock`).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

try:
    import fcntl
except ImportError:  # not a POSIX system: temporaries are not locked, and any found is taken as stale
    fcntl = None


def make_readable(path: str | os.PathLike) -> None:
    """Give a file the permissions open() would (0666 less the umask); mkstemp makes 0600."""
    os.chmod(path, 0o666 & ~_umask())


def _hold(fd: int) -> None:
    """Lock an open temporary file or folder for its writer (released when the descriptor closes)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _free(path: Path) -> bool:
    """Whether no living process holds the temporary `path` (its writer ended); False when it is held."""
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # also releases the lock just taken
    return True


def clean_stale(folder: str | os.PathLike, name: str = "*") -> list[Path]:
    """Remove the temporaries ``.NAME.*.tmp`` (files or folders) in `folder` that no living writer holds.

    Each command calls it for the names it writes, before it writes them: what a killed writer left is
    removed at the next start, and only that. Returns what was removed.
    """
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for tmp in folder.glob(f".{name if name == '*' else glob.escape(name)}.*.tmp"):
        if _free(tmp):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


_OS_CODE = re.compile(r"(?:os error |code: )(\d+)")


def written_errno(error: BaseException) -> int | None:
    """The errno behind a library's failed write (safetensors and tokenizers report a full disk as
    ``IoError(Os { code: 28, ... })``), found in the error, its causes, or its message; None if none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno
        found = _OS_CODE.search(str(error))
        if found:
            return int(found.group(1))
        error = error.__cause__ or error.__context__
    return None


def _named(error: BaseException, path: Path) -> BaseException:
    """An OSError without a file name (e.g. from pyarrow) as one that names `path`."""
    if isinstance(error, OSError) and error.errno and not error.filename:
        return OSError(error.errno, os.strerror(error.errno), str(path))
    return error


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` (held by this process: `clean_stale`); on success it is renamed
    onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path.parent, path.name)  # what a killed writer of the same file left
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        _hold(fd)
        make_readable(tmp)
        yield Path(tmp)
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    except BaseException as error:
        if os.path.exists(tmp):
            os.unlink(tmp)
        named = _named(error, path)
        if named is not error:
            raise named from error
        raise
    finally:
        os.close(fd)


@contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new temporary folder beside `path` (held by this process: `clean_stale`); when the block
    ends without an error it is renamed to `path`, which must not exist (`FileExistsError` otherwise).
    On an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path.parent, path.name)  # what a killed writer of the same folder left
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _hold(fd)
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        if path.exists():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        os.rename(tmp, path)
        fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
