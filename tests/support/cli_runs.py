"""The ffkv command in the test process: its exit code and output, and its one error line."""

from __future__ import annotations

import errno
import os

from ffkv import cli
from ffkv.store import atomic


def run(capsys, *argv) -> tuple[int, str, str]:
    """`ffkv ARGV` (each argument as text): exit code, stdout, stderr."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one ``ffkv: error:`` line of stderr (warnings aside); fails the test on anything else, a traceback
    included."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("ffkv: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("ffkv: error: "), err
    return lines[0]


def disk_full_at(monkeypatch, n: int) -> list:
    """A full disk from the n-th file ffkv syncs (`ffkv.store.atomic.fsync`, a write's last step) on: that sync
    raises ENOSPC. Returns the paths synced so far (the n-th named in the error); `monkeypatch.undo()` or setting
    `atomic.fsync` back frees the space."""
    real, calls = atomic.fsync, []

    def full(path):
        calls.append(path)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path)

    monkeypatch.setattr(atomic, "fsync", full)
    return calls
