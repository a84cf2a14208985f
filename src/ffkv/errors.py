"""The exceptions that reach users as a single clear line, and the exit status of each (`EXIT_CODES`); the
warnings, raised where the user's own code called ffkv (`warn`), in the words of what the user runs (`said`)."""

import contextlib
import contextvars
import os
import sys
import warnings
from typing import Iterator


class FfkvError(Exception):
    """A problem with the user's input: the message says what is wrong and what to do.

    The CLI prints it as one line and exits with its class's `exit_code` (2), without a traceback.
    """

    exit_code = 2


class StorageError(FfkvError):
    """The disk, not the input: full, read-only, or no permission (the message names the file and what to do)."""

    exit_code = 1


class DamagedRun(FfkvError):
    """A run directory's file is missing, damaged or not the table it should be: the message names the file
    and the command that rewrites it."""

    exit_code = 3


class FfkvWarning(UserWarning):
    """Something the user should know that does not stop the work (the CLI prints one line)."""


#: Whether the `ffkv` command runs (its messages name flags) or the library is called (they name arguments).
_COMMAND_LINE = contextvars.ContextVar("ffkv_command_line", default=False)
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Within it, messages speak the command line's words (`said`): the `ffkv` command runs in it."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def said(flags: str, arguments: str) -> str:
    """What to tell the user to change: the command line's `flags` when the `ffkv` command runs, the library's
    `arguments` when a function was called (``eval_corpus=`` is no flag of a notebook)."""
    return flags if _COMMAND_LINE.get() else arguments


def warn(message: str) -> None:
    """Raise an `FfkvWarning` attributed to the first frame outside ffkv: Python then names the user's own line
    (a notebook cell's ``ffkv.analyze(...)``), never one of ffkv's source lines."""
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, FfkvWarning, stacklevel=level)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a command where its work is safe: the message says what was kept and how to go on.

    A bare KeyboardInterrupt claims nothing (it may come before anything was saved).
    """


#: The exit status of every `ffkv` command, the one place they are defined (`ffkv --help` prints them).
EXIT_CODES = {
    0: "done (`ffkv status`: every run readable and whole, or being written by a live process)",
    1: "the file system: a full disk, a read-only folder, no permission (`StorageError`)",
    2: "the input: an option, a corpus, a model or a file that cannot be used as given (`FfkvError`)",
    3: "a damaged run: a file missing, damaged or not the one it should be (a table, a figure, the labels, the "
       "explorer's lookup files), an analyze that was cut off, or (`ffkv status`) an index or merge that stopped "
       "before its end (`DamagedRun`; `ffkv status RUN` names each, with the command that rewrites it)",
    130: "interrupted by Ctrl-C (the line says what was kept)",
    141: "the output's reader went away (e.g. `ffkv status RUN | head -1`); nothing is printed",
    143: "ended by SIGTERM (`ffkv serve` ends at once, with one line, as on Ctrl-C)",
}


def one_line(error: BaseException) -> str:
    """An error as one line (for a manifest's `error`): a filesystem error as its reason and file."""
    if isinstance(error, OSError) and error.errno:
        where = f" ({error.filename})" if error.filename else ""
        return f"{os.strerror(error.errno)}{where}"
    if isinstance(error, FfkvError):
        return str(error)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
