"""Ctrl-C ends a real `ffkv serve` at once: one line, exit status 130, whatever it was doing (a page just
answered, a generation running), and never the abort of torch threads still alive at Python's shutdown."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ffkv.models.default_corpus import default_corpus_path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve-stop") / "run"
    done = subprocess.run([sys.executable, "-m", "ffkv.cli", "index", "--model", "ffkv-tiny", "--corpus",
                           str(default_corpus_path("train")), "--unit", "line", "--max-examples", "120", "--top-k",
                           "5", "--control-keys", "8", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


def _serving(run: Path) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "serve", str(run), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        if found:
            return server, found.group(1)
        if not line and server.poll() is not None:
            break
    server.kill()
    pytest.fail(f"ffkv serve did not start: {server.stderr.read()}")


def _get(url: str, timeout: float = 300) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        answer.read()
        return answer.status


def _stopped(server: subprocess.Popen) -> tuple[int, float, str]:
    start = time.monotonic()
    server.send_signal(signal.SIGINT)
    try:
        code = server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        pytest.fail("ffkv serve was still running 10 s after Ctrl-C")
    return code, time.monotonic() - start, server.stderr.read()


def test_ctrl_c_right_after_a_memory_page_exits_130_with_one_line(tiny_run):
    server, url = _serving(tiny_run)
    assert _get(url + "memory/2/5") == 200
    code, seconds, err = _stopped(server)
    assert code == 130 and seconds < 2, (code, seconds, err)
    assert "terminate called" not in err and "Traceback" not in err
    said = err.split("explorer lookups")[-1].split("\n", 1)[-1]  # after the first start's progress bars
    assert [line for line in said.splitlines() if line.strip()] == ["ffkv: interrupted: the explorer stopped (SIGINT)"]


def test_ctrl_c_during_a_generation_does_not_wait_for_it(tiny_run):
    server, url = _serving(tiny_run)
    assert _get(url + "memory/1/0") == 200  # the model is loaded
    thread = threading.Thread(target=lambda: _quietly(lambda: _get(url + "trace?prompt=And+God+said&generate=64")),
                              daemon=True)
    thread.start()
    time.sleep(0.3)
    code, seconds, err = _stopped(server)
    assert code == 130 and seconds < 2, (code, seconds, err)
    assert "terminate called" not in err and "Traceback" not in err


def test_sigterm_ends_it_too(tiny_run):
    server, url = _serving(tiny_run)
    assert _get(url) == 200
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=10) == 128 + signal.SIGTERM
    assert "the explorer stopped (SIGTERM)" in server.stderr.read()


def _quietly(call) -> None:
    try:
        call()
    except OSError:  # the server went away mid-answer, as it should
        pass
