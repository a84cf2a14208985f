"""Reading a file someone else made: the one way ffkv opens a file it did not write itself.

Such a file may be anything its name does not say: a FIFO (whose open or read waits for a writer forever), a
device (``/dev/zero`` reads without end and reports a size of 0), a directory, or a file far larger than what
it claims to be. Here:

- only a regular file is opened (a symlink to one is followed); anything else is refused before it is read,
  and the open itself never waits (``O_NONBLOCK``), the opened descriptor checked again (`fstat`);
- bytes are read within a budget that is counted while reading, never taken from ``st_size``: at most
  ``limit + 1`` bytes are read, and a file that has them is refused;
- JSON is parsed with a nesting-depth limit, and integers of more digits than any count has are refused
  (Python's own `int` refuses past 4,300 digits with a message about its interpreter).

Every refusal is one line (an `FfkvError`; a file ffkv may not read is a `StorageError`) that names the file.
`what` names what the file was expected to be, with its article ("a JSON config"), for the messages.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ffkv.errors import FfkvError, StorageError

#: How deep a JSON file read here may nest objects and arrays (a config nests two or three levels).
MAX_DEPTH = 64
#: The most digits an integer of a JSON file read here may have (a count or a size has at most 20).
MAX_INT_DIGITS = 100

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def check_regular(path: str | os.PathLike, what: str = "a file") -> None:
    """Refuse `path` unless it is a regular file (or a symlink to one), without opening it: for a file handed to a
    library that opens it itself (safetensors' ``safe_open``), which would wait on a FIFO or read a device."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise _unreadable(path, what, error) from None
    _require_regular(path, what, mode)


@contextmanager
def open_regular(path: str | os.PathLike, what: str = "a file") -> Iterator[BinaryIO]:
    """`path` opened for reading in binary, refused unless a regular file: checked before the open (a device is
    never opened) and on the opened descriptor (what was opened is what was checked). The open does not wait."""
    path = Path(path)
    check_regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise _unreadable(path, what, error) from None
    try:
        _require_regular(path, what, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        yield handle


def read_bytes(path: str | os.PathLike, limit: int, what: str = "a file") -> bytes:
    """The bytes of the regular file `path`, refused when it has more than `limit` (counted as they are read)."""
    path = Path(path)
    with open_regular(path, what) as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as error:
            raise _unreadable(path, what, error) from None
    if len(data) > limit:
        raise FfkvError(f"{path}: more than {limit:,} bytes, too large for {what}")
    return data


def read_json(path: str | os.PathLike, limit: int, what: str = "a JSON file", depth: int = MAX_DEPTH) -> Any:
    """The JSON value of the regular file `path` (UTF-8, at most `limit` bytes, nested at most `depth` deep)."""
    path = Path(path)
    data = read_bytes(path, limit, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FfkvError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}): not {what}") from None
    try:
        return parse_json(text, depth)
    except ValueError as error:
        raise FfkvError(f"{path}: not {what} ({error})") from None


def read_json_object(path: str | os.PathLike, limit: int, what: str = "a JSON file",
                     depth: int = MAX_DEPTH) -> dict[str, Any]:
    """`read_json`, refused unless the value is a JSON object."""
    value = read_json(path, limit, what, depth)
    if not isinstance(value, dict):
        raise FfkvError(f"{path}: expected a JSON object, found {type(value).__name__}: not {what}")
    return value


def parse_json(text: str, depth: int = MAX_DEPTH) -> Any:
    """The JSON value of `text`; `ValueError` (one line) for text that is not JSON, nests deeper than `depth`,
    or holds an integer of more than `MAX_INT_DIGITS` digits. For text already read within a budget (a line of a
    JSON Lines file)."""
    try:
        value = json.loads(text, parse_int=_int)
    except RecursionError:   # deeper than Python's recursion limit: the parser itself gave up
        raise ValueError(f"nested more than {depth} deep") from None
    except json.JSONDecodeError as error:
        raise ValueError(str(error)) from None
    if _deeper_than(value, depth):
        raise ValueError(f"nested more than {depth} deep")
    return value


def quoted(value: Any, limit: int = 80) -> str:
    """`value`'s repr for a message, cut to about `limit` characters (a value from a file may be a megabyte long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-')):,} digits (at most {MAX_INT_DIGITS} are read)")
    return int(digits)


def _deeper_than(value: Any, depth: int) -> bool:
    """Whether `value` nests objects and arrays more than `depth` deep (counted without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > depth:
                return True
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _require_regular(path: Path, what: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise FfkvError(f"{path}: {kind}, not a regular file: ffkv reads {what} only from a regular file")


def _unreadable(path: Path, what: str, error: OSError) -> FfkvError:
    """The one line for an `OSError` met opening or reading `path`."""
    if isinstance(error, FileNotFoundError):
        return FfkvError(f"{path}: missing (expected {what} here)")
    if isinstance(error, PermissionError):
        return StorageError(f"{path}: no permission to read it (expected {what})")
    return FfkvError(f"{path}: cannot be read ({error.strerror or type(error).__name__}; expected {what})")
