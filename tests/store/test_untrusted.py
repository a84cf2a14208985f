"""`ffkv.store.untrusted`, the one way ffkv reads a file it did not write: regular files only (a FIFO, a device, a
socket or a directory refused at once, a FIFO never waited on), a byte budget counted while reading (a file whose
size says 0 is read no further than the budget), JSON within a nesting depth and a number of digits; every
refusal one line naming the file."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from ffkv.errors import FfkvError, StorageError
from ffkv.store import untrusted


def refused(call, path: Path, match: str, error=FfkvError) -> str:
    """`call()` is refused (`error`) in one line naming `path`, within 10 s (a reader waiting on a FIFO is let go by
    opening the FIFO for writing, and fails the test); the message."""
    outcome: dict = {}

    def attempt():
        try:
            outcome["value"] = call()
        except BaseException as exc:   # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        release(path)
        worker.join(10)
        pytest.fail(f"reading {path} waited (on a FIFO?)")
    caught = outcome.get("error")
    assert isinstance(caught, error), outcome
    message = str(caught)
    assert str(path) in message and "\n" not in message and match in message, message
    return message


def release(path: Path) -> None:
    """Let a reader waiting on the FIFO `path` go (it reads end of file)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_regular_file_and_a_symlink_to_one_are_read(tmp_path):
    (tmp_path / "cfg.json").write_text('{"a": [1, {"b": null}]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "cfg.json")
    for name in ("cfg.json", "link.json"):
        assert untrusted.read_json_object(tmp_path / name, 100) == {"a": [1, {"b": None}]}
        untrusted.check_regular(tmp_path / name)
        with untrusted.open_regular(tmp_path / name) as handle:
            assert handle.read() == b'{"a": [1, {"b": null}]}'


def test_a_fifo_is_refused_at_once_and_never_waited_on(tmp_path):
    fifo = tmp_path / "cfg.json"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    for path in (fifo, link):
        refused(lambda: untrusted.read_json_object(path, 100, "a JSON config"), path, "a FIFO (named pipe), not a "
                "regular file: ffkv reads a JSON config only from a regular file")
        refused(lambda: untrusted.check_regular(path, "a safetensors file"), path, "a FIFO")
        refused(lambda: untrusted.open_regular(path).__enter__(), path, "a FIFO")


def test_a_device_a_socket_and_a_directory_are_refused_unread(tmp_path):
    zero = tmp_path / "cfg.json"
    zero.symlink_to("/dev/zero")   # reads without end, and says its size is 0
    refused(lambda: untrusted.read_bytes(zero, 1 << 20), zero, "a character device, not a regular file")
    listening = socket.socket(socket.AF_UNIX)
    try:
        listening.bind(str(tmp_path / "s"))
        refused(lambda: untrusted.read_bytes(tmp_path / "s", 100), tmp_path / "s", "a socket, not a regular file")
    finally:
        listening.close()
    (tmp_path / "folder.json").mkdir()
    refused(lambda: untrusted.read_json(tmp_path / "folder.json", 100), tmp_path / "folder.json",
            "a directory, not a regular file")


def test_the_budget_is_counted_while_reading_not_taken_from_the_size(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert untrusted.read_bytes(tmp_path / "f", 100) == b"x" * 100
    refused(lambda: untrusted.read_bytes(tmp_path / "f", 99, "a JSON config"), tmp_path / "f",
            "more than 99 bytes, too large for a JSON config")
    maps = Path("/proc/self/maps")   # a regular file whose st_size is 0, whatever it holds
    assert maps.stat().st_size == 0 and len(maps.read_bytes()) > 64
    refused(lambda: untrusted.read_bytes(maps, 64), maps, "more than 64 bytes")


@pytest.mark.parametrize("text, match", [
    ("[" * 65 + "]" * 65, "nested more than 64 deep"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nested more than 64 deep"),
    ("[" * 100_000 + "]" * 100_000, "nested more than 64 deep"),   # past Python's recursion limit
    ('{"d_in": ' + "7" * 5000 + "}", "an integer of 5,000 digits"),   # past Python's int() limit
    ("{not json", "not a JSON config (Expecting property name"),
    ("", "not a JSON config (Expecting value"),
])
def test_json_too_deep_or_with_huge_integers_or_damaged_is_one_line(tmp_path, text, match):
    path = tmp_path / "cfg.json"
    path.write_text(text)
    refused(lambda: untrusted.read_json(path, 1 << 20, "a JSON config"), path, match)


def test_json_at_the_limits_is_read(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text("[" * 64 + "]" * 64)
    assert untrusted.read_json(path, 1 << 20) is not None
    path.write_text(json.dumps({"n": int("9" * untrusted.MAX_INT_DIGITS), "m": -12}))
    assert untrusted.read_json_object(path, 1 << 20)["m"] == -12


def test_not_an_object_not_utf8_missing_or_forbidden(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text("[1, 2]")
    refused(lambda: untrusted.read_json_object(path, 100, "a JSON config"), path,
            "expected a JSON object, found list: not a JSON config")
    path.write_bytes(b'{"a": "\xff"}')
    refused(lambda: untrusted.read_json_object(path, 100), path, "not UTF-8 text")
    refused(lambda: untrusted.read_json(tmp_path / "gone.json", 100, "a JSON config"), tmp_path / "gone.json",
            "missing (expected a JSON config here)")
    if os.geteuid() != 0:   # root reads any file
        path.chmod(0)
        refused(lambda: untrusted.read_bytes(path, 100), path, "no permission to read it", StorageError)


def test_parse_json_says_why_in_one_line():
    assert untrusted.parse_json('{"prompt": "a"}') == {"prompt": "a"}
    for text, match in (("[" * 65 + "]" * 65, "nested more than 64 deep"), ("1" * 200, "an integer of 200 digits"),
                        ("{", "Expecting property name")):
        with pytest.raises(ValueError, match=match):
            untrusted.parse_json(text)


def test_quoted_cuts_a_long_value():
    assert untrusted.quoted("false") == "'false'"
    long = untrusted.quoted("1" * 100_000)
    assert len(long) < 120 and long.endswith("(100,002 characters)")
