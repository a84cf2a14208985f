"""The ffkv command in the test process: its exit code and output, and its one error line."""

from __future__ import annotations

from ffkv import cli


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
