"""A chat-completions server on loopback that explains and simulates by a known rule (tests/tools).

It speaks the OpenAI API's ``POST /v1/chat/completions`` (with ``logprobs`` and ``top_logprobs``) for the
prompts of `ffkv.tools.explain` and `ffkv.tools.score`, on a character-level tiny model:

- explain: "Fires on the character 'X'.", X the token marked with the largest activation in the examples;
- simulate: for an explanation naming character X, activation 10 on every token that is X and 0 elsewhere,
  written as the reply ``i<TAB>digit`` lines, with log-probabilities putting 0.9 on that digit and 0.1 on 5 (so
  the expected digit is 9.5 or 0.5, and a client that reads the logprobs is told apart from one that does not).

`mode` makes it misbehave from the `fail_from`-th request on (1-based): ``drop`` closes the connection without an
answer, ``slow`` answers after `delay` seconds, ``malformed`` answers JSON with no choices, ``garbage`` answers
text that is not JSON; and as a hostile server would: ``drip`` announces 1,000,000 bytes and sends 100 every
50 ms, ``drip_chunked`` sends 100-byte chunks every 50 ms (both for at most `DRIP_SECONDS`), ``huge`` announces
999,999,999 bytes and sends them quickly, ``bad_usage`` answers ``"usage": "x"``, ``blank`` answers an
explanation of spaces, ``error500`` answers HTTP 500. Every request's body is kept in `requests` (a list, in
arrival order).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MARK = re.compile(r"(.)\[\[(\d+)\]\]", re.S)
#: How long a dripping answer goes on at most (the client must give up long before).
DRIP_SECONDS = 30.0


def explain_rule(user: str) -> str:
    best, char = -1, "?"
    for ch, digit in MARK.findall(user):
        if int(digit) > best:
            best, char = int(digit), ch
    return f"Fires on the character '{char}'."


def simulate_rule(user: str) -> list[int]:
    named = re.search(r"character '(.)'", user)
    char = named.group(1) if named else None
    digits = []
    for line in user.splitlines():
        m = re.match(r"^(\d+)\t(.*)$", line)
        if m:
            digits.append(10 if m.group(2) == char else 0)
    return digits


def _reply(body: dict, with_logprobs: bool) -> dict:
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    if "Tokens of the text" in user:
        digits = simulate_rule(user)
        text = "".join(f"{i}\t{d}\n" for i, d in enumerate(digits, 1))
        content = []
        for i, d in enumerate(digits, 1):
            other = "5"
            content += [{"token": str(i), "logprob": 0.0, "top_logprobs": []},
                        {"token": "\t", "logprob": 0.0, "top_logprobs": []},
                        {"token": str(d), "logprob": -0.105,
                         "top_logprobs": [{"token": str(d), "logprob": -0.10536}, {"token": other, "logprob": -2.302585}]},
                        {"token": "\n", "logprob": 0.0, "top_logprobs": []}]
        logprobs = {"content": content} if body.get("logprobs") and with_logprobs else None
    else:
        text, logprobs = explain_rule(user), None
    return {"id": "x", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(user) // 4, "completion_tokens": len(text) // 4,
                      "total_tokens": (len(user) + len(text)) // 4}}


class ChatServer:
    """Start with `start()` (or as a context manager); `url` is its ``http://127.0.0.1:PORT/v1``."""

    def __init__(self, mode: str = "ok", fail_from: int = 1, delay: float = 0.0, with_logprobs: bool = True,
                 pause: float = 0.0) -> None:
        self.mode, self.fail_from, self.delay, self.with_logprobs, self.pause = mode, fail_from, delay, with_logprobs, pause
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    n = len(server.requests)
                if self.path.split("?")[0] != "/v1/chat/completions":
                    self.send_error(404)
                    return
                mode = server.mode if n >= server.fail_from else "ok"
                if server.pause:
                    time.sleep(server.pause)
                if mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if mode == "slow":
                    time.sleep(server.delay)
                if mode in ("drip", "drip_chunked", "huge"):
                    self._drip(mode)
                    return
                if mode == "error500":
                    self.send_error(500)
                    return
                if mode == "malformed":
                    payload = json.dumps({"id": "x", "object": "chat.completion"}).encode()
                elif mode == "garbage":
                    payload = b"<html>502 bad gateway</html>"
                else:
                    answer = _reply(body, server.with_logprobs)
                    if mode == "bad_usage":
                        answer["usage"] = "x"
                    elif mode == "blank":
                        answer["choices"][0]["message"]["content"] = " \n\t "
                    payload = json.dumps(answer).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _drip(self, mode: str) -> None:
                """A body that never ends in time: 100 bytes every 50 ms (or at once, `huge`)."""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if mode == "drip_chunked":
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", "999999999" if mode == "huge" else "1000000")
                self.end_headers()
                ends = time.monotonic() + DRIP_SECONDS
                try:
                    while time.monotonic() < ends:
                        piece = b" " * 100
                        self.wfile.write(b"64\r\n" + piece + b"\r\n" if mode == "drip_chunked" else piece * (
                            1000 if mode == "huge" else 1))
                        self.wfile.flush()
                        if mode != "huge":
                            time.sleep(0.05)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def start(self) -> "ChatServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "ChatServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
