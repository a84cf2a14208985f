"""One writer at a time: an exclusive lock on a run directory that names its holder.

Every command that writes a run (`ffkv index`, `merge`, `analyze`, `annotate import`)
holds ``RUN/.lock`` while it works. The lock is an OS file lock (`filelock`, flock on
Unix): the kernel drops it when its process ends, even by ``kill -9``, and `filelock`
closes it in forked children (tokenizer workers), so an orphaned child never keeps a
dead run locked. While held, the file records the holder (pid, host, command, start
time) as one JSON object, for the message a second writer gets; a release empties it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import filelock

from ffkv.errors import FfkvError, StorageError


def now_iso() -> str:
    """The current time, ISO 8601 with the UTC offset (the manifest's time format)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass(frozen=True)
class Holder:
    """A process that writes (or wrote) a run: who, where, since when."""

    pid: int
    host: str
    command: str
    started: str

    @classmethod
    def me(cls, command: str) -> "Holder":
        return cls(pid=os.getpid(), host=socket.gethostname(), command=command, started=now_iso())

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        """The holder recorded in a lock file's text (None: empty or not a record)."""
        try:
            data = json.loads(text)
            return cls(pid=int(data["pid"]), host=str(data["host"]), command=str(data["command"]),
                       started=str(data["started"]))
        except (ValueError, KeyError, TypeError):
            return None

    def alive(self) -> bool | None:
        """Whether the process still runs: None when it ran on another host (it cannot be asked)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # it exists, under another user
            return True
        return True

    def describe(self) -> str:
        return f"`ffkv {self.command}` (pid {self.pid} on {self.host}, since {self.started})"


class RunLocked(FfkvError):
    """Another process writes this run (the message names it)."""


def read_holder(path: Path) -> Holder | None:
    """The holder recorded in the lock file at `path` (None: no file, empty, or unreadable)."""
    try:
        return Holder.parse(path.read_text())
    except OSError:
        return None


def _write_holder(path: Path, holder: Holder) -> None:
    """Replace the lock file's record (another descriptor on the file leaves the lock as it is)."""
    with open(path, "r+b") as handle:
        handle.truncate(0)
        handle.write((json.dumps(asdict(holder)) + "\n").encode())
        handle.flush()
        os.fsync(handle.fileno())


def _cannot_lock(path: Path, error: OSError) -> FfkvError:
    reason = error.strerror or str(error)
    return StorageError(f"cannot lock the run directory {path.parent} ({reason}): a command that writes a run "
                     "needs it writable")


@contextmanager
def exclusive(path: Path, command: str, what: str, wait: float = 1.0) -> Iterator[Holder]:
    """Hold the lock file `path` for `command`, or raise `RunLocked` naming the holder.

    `what` says in the message what is locked (e.g. "run runs/x"). `wait` seconds of
    patience ride over a short holder (`ffkv status` probing the lock).
    """
    me = Holder.me(command)
    lock = filelock.FileLock(path, timeout=wait, fallback_to_soft=False)
    try:
        lock.acquire()
    except filelock.Timeout:
        holder = read_holder(path)
        if holder is None:
            raise RunLocked(f"{what} is being written by another process; wait for it to finish") from None
        if holder.alive() is False:
            raise RunLocked(f"{what} is locked by a process other than its recorded writer {holder.describe()}, "
                            f"which has ended: a child process of it may still run; end it, then retry") from None
        raise RunLocked(f"{what} is being written by {holder.describe()}; wait for it to finish "
                        "or stop it first") from None
    except OSError as error:
        raise _cannot_lock(path, error) from None
    try:
        try:
            _write_holder(path, me)
        except OSError as error:
            raise _cannot_lock(path, error) from None
        yield me
    finally:
        try:
            with open(path, "r+b") as handle:  # a normal release leaves no record behind
                handle.truncate(0)
        except OSError:
            pass
        lock.release()


def probe(path: Path) -> bool | None:
    """Whether a process holds the lock file now: None when it cannot be tried (read-only run)."""
    if not path.exists():
        return False
    lock = filelock.FileLock(path, timeout=0, fallback_to_soft=False)
    try:
        lock.acquire()
    except filelock.Timeout:
        return True
    except OSError:
        return None
    lock.release()
    return False


__all__ = ["Holder", "RunLocked", "exclusive", "now_iso", "probe", "read_holder"]
