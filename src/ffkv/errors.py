"""The one exception type that reaches users as a single clear line."""

import os


class FfkvError(Exception):
    """A problem with the user's input: the message says what is wrong and what to do.

    The CLI prints it as one line and exits with status 2, without a traceback.
    """


class FfkvWarning(UserWarning):
    """Something the user should know that does not stop the work (the CLI prints one line)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a command where its work is safe: the message says what was kept and how to go on.

    A bare KeyboardInterrupt claims nothing (it may come before anything was saved).
    """


def one_line(error: BaseException) -> str:
    """An error as one line (for a manifest's `error`): a filesystem error as its reason and file."""
    if isinstance(error, OSError) and error.errno:
        where = f" ({error.filename})" if error.filename else ""
        return f"{os.strerror(error.errno)}{where}"
    if isinstance(error, FfkvError):
        return str(error)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
