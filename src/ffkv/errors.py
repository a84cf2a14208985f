"""The one exception type that reaches users as a single clear line."""


class FfkvError(Exception):
    """A problem with the user's input: the message says what is wrong and what to do.

    The CLI prints it as one line and exits with status 2, without a traceback.
    """


class FfkvWarning(UserWarning):
    """Something the user should know that does not stop the work (the CLI prints one line)."""
