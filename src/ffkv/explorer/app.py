"""`ffkv serve RUN`: the explorer, a Starlette app with server-rendered pages (no build step).

Routes (LAYER counts from 1, as every page shows it; KEY is the 0-based memory index):
    /                                       overview: the run, the paper's findings, per-layer summaries, a
                                            dictionary's latents beside the neurons (`beside`), figures
    /layer/LAYER?sort=&order=&page=&census=&min_score=   a layer's keys, sortable by any column, filtered
    /layer/tLAYER?sort=&order=&page=        a sparse dictionary's latents (a run indexed with --dictionary), sortable
    /memory/LAYER/KEY?projection=&shown=    a memory: pattern, value (top and bottom tokens), activation
                                            histogram, trigger examples with per-token coefficients, annotation form
    /memory/LAYER/KEY.json?projection=&shown=  the same as JSON (a stable URL)
    /memory/LAYER/KEY/annotate              POST: save a human pattern label
    /memory/tLAYER:LATENT/annotate          POST: save a latent's (annotations/latent_labels.parquet)
    /memory/tLAYER:LATENT?projection=&shown=  a latent (`ffkv.memories.address.LatentRef`: t4:42, s4:42): value,
                                            activation histogram, trigger examples with per-token activations
    /memory/tLAYER:LATENT.json              the same as JSON
    /search?token= | ?q=                    memories promoting a token; trigger examples and explanations by text
    /concepts?layer=N|all                     values clustered by shared top tokens (`ffkv.tools.concepts`)
    /trace?prompt=&position=&target=&off=L:K&scale=L:K=F&set=L:K=V&generate=N&lens=final-norm|translator
                                            (GET, or POST from the form): trace, intervene, generate
    /files/PATH                             figures, metrics and the report of the run (nothing outside it)

The model loads in the background (`ModelHandle`): the overview answers at once. Every bad
request gets a 4xx page that says what was wrong; none shows a traceback. `security.Guard` answers
only loopback names and the names given, refuses cross-site changes, checks the access token of a
server bound beyond loopback, and sets the security headers. Page handlers run in a few threads of their
own (`PAGE_THREADS`; DuckDB: one cursor per query); pages that need the model (memory pages, trace,
generate) run in a thread of their own, one at a time, with a short queue (`ModelQueue`).

Under a crowd the explorer answers what it can and refuses the rest at once: at most `MAX_IN_FLIGHT` page
requests are in the app (`Admission`), and a request waits for the model only when it should be answered
in `MODEL_WAIT_S`; past either, the request gets a 503 page at once with ``Retry-After`` (whole
seconds, as HTTP defines it) and ``Retry-After-Ms`` (the milliseconds), never a place in a queue that would
keep it waiting for many seconds.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl, urlencode

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.middleware import Middleware
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from ffkv.errors import FfkvError, one_line
from ffkv.explorer import pages, validation
from ffkv.explorer.data import ExplorerData
from ffkv.explorer.model import load_run_model
from ffkv.explorer.security import MIN_TOKEN, Guard, is_loopback, new_token
from ffkv.explorer.validation import BadRequest
from ffkv.memories.address import latent_address, latent_kind, quoted
from ffkv.memories.projection import DEFAULT_FOR_RESIDUALS

REASONS = {400: "Bad request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 405: "Method not allowed",
           413: "Too large", 415: "Unsupported media type", 421: "Misdirected request", 422: "Cannot use this input",
           500: "Server error", 503: "Unavailable", 507: "Insufficient storage"}
#: Threads computing pages that read only tables. Few: page work is mostly Python and holds the GIL, and each
#: thread more takes a share of it from the event loop, which then answers everyone (refusals too) later. At
#: 500 clients (`benchmarks/explorer_crowd.py`, 20 s) a refusal took 0.07 s (median) with 4, 0.7 s with 40.
PAGE_THREADS = 4
#: Page requests in the app at once (those for the model included); more get a 503 at once. A small multiple of
#: the page threads: a table page costs 5-100 ms, so one admitted waits for a thread well under a second.
MAX_IN_FLIGHT = 16
#: The longest a request that needs the model (memory pages, traces) should expect to wait for its answer: the
#: model runs one request at a time, so one more is refused at once when those waiting, the one running and its
#: own, at the recent time of one, would take longer (but one may always wait). Well under the 5 s a crowd's
#: request may wait for its first byte: the recent time lags when the machine slows down.
MODEL_WAIT_S = 3.0
#: Requests waiting for the model at once, however fast it is; more get a 503 at once. Eight clients who all
#: ask for memory pages are never refused.
MAX_WAITING_FOR_MODEL = 8
#: A refused request is told to retry after this many milliseconds, drawn anew each time from this range so
#: that a crowd refused at once does not come back at once; its mean is the ``Retry-After: 1`` it also carries.
RETRY_AFTER_MS = (500, 1500)
#: Folders (and files) of the run directory that /files serves.
SERVED = ("figures", "metrics", "report.html")

__all__ = ["Admission", "Busy", "ModelQueue", "create_app", "serve", "load_run_model"]

T = TypeVar("T")


class Busy(BadRequest):
    """A request refused because the explorer is full: a 503 that says when to retry.

    HTTP's ``Retry-After`` counts whole seconds, too coarse for a wait of about one; the response also carries
    ``Retry-After-Ms``, the header that OpenAI's and Azure's clients read for the same purpose.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, 503)
        self.retry_after_ms = random.randrange(*RETRY_AFTER_MS)


class Admission:
    """At most `limit` requests in flight; one more is refused at once (`Busy`) instead of queued.

    The count lives on the event loop's thread (handlers start and end there), so it needs no lock; a request
    leaves its slot when its handler ends however it ends (an answer, an error, a cancellation), and a handler
    ends only after its page's thread: work still running keeps its slot.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot while the block runs, or raise `Busy` when every slot is taken."""
        if self.in_flight >= self.limit:
            raise Busy(f"the explorer is answering {self.limit} requests; try again in a second")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def admitted(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """`handler`, run only when a slot is free."""
        async def run(request: Request) -> Response:
            with self.slot():
                return await handler(request)
        return run


class ModelQueue:
    """Page work that needs the model, one request at a time (it holds the model's lock anyway: it waits here,
    not in the page threads), behind a short queue: `MODEL_WAIT_S` and `MAX_WAITING_FOR_MODEL`."""

    #: Weight of the newest request in `seconds`, the moving average of one request's time.
    SMOOTHING = 0.3

    def __init__(self) -> None:
        self.pool = anyio.CapacityLimiter(1)
        self.seconds = 0.0  # written by the model's thread only, one request at a time

    async def run(self, function: Callable[..., T], *args) -> T:
        """`function(*args)` in the model's thread, or `Busy` at once when the queue is full."""
        waiting = self.pool.statistics().tasks_waiting
        if waiting >= MAX_WAITING_FOR_MODEL or waiting and (waiting + 2) * self.seconds > MODEL_WAIT_S:
            raise Busy(f"the model is busy with {waiting + 1} requests; try again in a second")
        return await anyio.to_thread.run_sync(self._timed, function, args, limiter=self.pool)

    def _timed(self, function: Callable[..., T], args: tuple) -> T:
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            self.seconds += self.SMOOTHING * (time.perf_counter() - start - self.seconds)


def create_app(run_dir: str | Path, loaded=None, progress: bool = False, root: str = "",
               hosts: tuple[str, ...] = (), token: str | None = None,
               dictionary_at: str | Path | None = None) -> Starlette:
    """The explorer's web app for a run.

    Args:
        run_dir: a complete run directory.
        loaded: the run's model; default: loaded in the background by the manifest's model id and dtype.
        progress: print the preparation steps of a first start.
        root: URL prefix when mounted below another path.
        hosts: host names answered besides the loopback names (``"*"``: any; only with a token).
        token: an access token every request must carry (`security.Guard`), or None.
        dictionary_at: where the sparse dictionary the run was indexed with lies now, if its files moved.
    """
    run_dir = Path(run_dir)
    data = ExplorerData(run_dir, loaded, progress=progress, dictionary_at=dictionary_at)
    data.model.after_load(lambda: (data.warm(), pages.warm()))  # a model loaded in the background: warm up
    page_pool, model_queue, admission = anyio.CapacityLimiter(PAGE_THREADS), ModelQueue(), Admission(MAX_IN_FLIGHT)

    async def in_threads(function, *args):
        """Run page work that reads only tables in the page threads."""
        return await anyio.to_thread.run_sync(function, *args, limiter=page_pool)

    async def overview(request: Request):
        return _html(await in_threads(pages.overview, data, root))

    async def layer(request: Request):
        q = _query(request)
        if _is_latent(request.path_params["layer"]):  # a dictionary's latents: /layer/t4
            return _html(await in_threads(pages.latent_layer_page, data, request.path_params["layer"],
                                          _one(q, "sort"), _one(q, "order", "asc"), _one(q, "page", "1"), root))
        return _html(await in_threads(pages.layer_page, data, request.path_params["layer"],
                                            _one(q, "sort", "key"), _one(q, "order", "asc"), _one(q, "page", "1"), root,
                                            _one(q, "census"), _one(q, "min_score")))

    async def memory(request: Request):
        p, q = request.path_params, _query(request)
        return _html(await model_queue.run(pages.memory_page, data, p["layer"], p["key"], root,
                                           _one(q, "projection"), _one(q, "shown", "p")))

    async def memory_json(request: Request):
        p, q = request.path_params, _query(request)
        return JSONResponse(await model_queue.run(pages.memory_json, data, p["layer"], p["key"],
                                                  _one(q, "projection"), root, _one(q, "shown", "p")))

    async def latent(request: Request):
        p, q = request.path_params, _query(request)
        _check_latent(p["address"])
        return _html(await model_queue.run(pages.latent_page, data, p["address"], root,
                                           _one(q, "projection"), _one(q, "shown", "p")))

    async def latent_json(request: Request):
        p, q = request.path_params, _query(request)
        _check_latent(p["address"])
        return JSONResponse(await model_queue.run(pages.latent_json, data, p["address"],
                                                  _one(q, "projection"), root, _one(q, "shown", "p")))

    async def save_label(annotations, layer: int, key: int, request: Request, page_url: str):
        """Save the annotate form's label of one memory (a neuron's or a latent's), then back to its page."""
        f = await _form(request)
        try:
            annotations.save(layer, key, validation.label(_one(f, "label")),
                             validation.short_text(_one(f, "description"), "description", 2000),
                             validation.short_text(_one(f, "annotator"), "annotator", 100))
        except OSError as exc:  # a read-only run (a shared copy), a full disk, no permission
            raise BadRequest(f"the label was not saved: {one_line(exc)}; labels are saved in the run directory, "
                             "which must be writable (serve a copy of the run to annotate it)",
                             507 if exc.errno == errno.ENOSPC else 403) from None
        return RedirectResponse(f"{page_url}#pattern", status_code=303)

    async def annotate(request: Request):
        p = request.path_params
        layer, key = data.check(p["layer"], p["key"])
        return await save_label(data.annotations, layer, key, request, f"{root}/memory/{p['layer']}/{key}")

    async def annotate_latent(request: Request):
        address = request.path_params["address"]
        _check_latent(address)
        latents = pages.latents_of(data)
        ref = latents.check(address)
        return await save_label(latents.annotations, ref.layer, ref.latent, request, f"{root}/memory/{ref}")

    async def search(request: Request):
        q = _query(request)
        return _html(await in_threads(pages.search_page, data, _one(q, "token"), _one(q, "q"), root,
                                      _one(q, "page") or 1))

    async def concepts(request: Request):
        return _html(await model_queue.run(pages.concepts_page, data, _one(_query(request), "layer"), root))

    def run_trace(params: dict[str, list[str]]) -> str:
        from ffkv.explorer.notebook import run_trace as traced

        prompt = _one(params, "prompt")
        if prompt is None:
            return pages.trace_page(data, None, None, None, root)
        state = trace_state(params)
        t = traced(data, validation.prompt(prompt), state["position"], state["target"] or None,
                   state["edits"].values(), state["generate"], root, state["lens"])
        return pages.trace_page(data, prompt, t.base, t.edited, root, generation=t.generation,
                                target_text=state["target"], n_generate=state["generate"] or 20)

    def trace_state(params: dict[str, list[str]]) -> dict:
        """What a trace request asks for, checked: the prompt, position, target, lens, edits and tokens to generate.
        generate=N (a URL) generates; the form's n_generate only with its Generate button, so that a click on a
        position, Trace or Apply does not generate again."""
        edits = validation.edits(params, data.n_layers, data.d_m,
                                 data.latents.layout.latents if data.latents is not None else None)
        position = _one(params, "position") or _one(params, "current_position")
        position = -1 if position in (None, "") else validation.integer(position, "position", 0, 100_000, 422)
        action = _one(params, "action")
        n_generate = (_one(params, "n_generate") or _one(params, "generate")) if action == "generate" else \
            None if action else _one(params, "generate")
        n_generate = 0 if n_generate in (None, "") else \
            validation.integer(n_generate, "generate", 1, validation.MAX_NEW_TOKENS, 422)
        return {"prompt": validation.prompt(_one(params, "prompt")), "position": position,
                "target": (_one(params, "target") or "").strip(), "edits": edits, "generate": n_generate,
                "lens": _one(params, "lens") or DEFAULT_FOR_RESIDUALS}

    def trace_query(state: dict) -> list[tuple[str, str]]:
        """The one URL query of a trace's state (`trace_state`): its page is what that URL shows, and the form's every
        control lands on it (the form's empty fields and its buttons' names stay out)."""
        from ffkv.memories.address import edit_text

        query = [("prompt", state["prompt"])]
        query += [("position", str(state["position"]))] if state["position"] >= 0 else []
        query += [("target", state["target"])] if state["target"] else []
        query += [("lens", state["lens"])] if state["lens"] != DEFAULT_FOR_RESIDUALS else []
        query += [edit_text(edit) for edit in state["edits"].values()]
        query += [("generate", str(state["generate"]))] if state["generate"] else []
        return query

    async def traced(params: dict[str, list[str]]) -> HTMLResponse:
        if _one(params, "prompt") is None:
            return _html(await in_threads(run_trace, params))
        return _html(await model_queue.run(run_trace, params))

    async def trace_get(request: Request):
        params = _query(request)
        if _one(params, "prompt") is not None:
            query = await in_threads(lambda: trace_query(trace_state(params)))
            if query != parse_qsl(request.url.query, keep_blank_values=True):  # the form's: to the state's own URL
                return RedirectResponse(f"{root}/trace?{urlencode(query)}", status_code=303)
        return await traced(params)

    async def trace_post(request: Request):
        return await traced(await _form(request))

    async def files(request: Request):
        rel = request.path_params["path"]
        base = data.run.path.resolve()
        try:
            target = (base / rel).resolve()
            target.relative_to(base)
        except (ValueError, OSError):
            raise BadRequest(f"{rel[:80]!r} is outside the run directory", 403) from None
        inside = target.relative_to(base).parts
        if not inside or inside[0] not in SERVED or not target.is_file():
            raise BadRequest(f"no file {rel[:80]!r} in the run's figures, metrics or report", 404)
        return FileResponse(target)

    page = admission.admitted
    routes = [
        Route("/", page(overview)),
        Route("/layer/{layer}", page(layer)),
        Route("/memory/{layer}/{key}.json", page(memory_json)),
        Route("/memory/{layer}/{key}", page(memory)),
        Route("/memory/{layer}/{key}/annotate", page(annotate), methods=["POST"]),
        Route("/memory/{address}.json", page(latent_json)),  # a latent, addressed as everywhere: /memory/t4:42
        Route("/memory/{address}", page(latent)),
        Route("/memory/{address}/annotate", page(annotate_latent), methods=["POST"]),
        Route("/search", page(search)),
        Route("/concepts", page(concepts)),
        Route("/trace", page(trace_get), methods=["GET"]),
        Route("/trace", page(trace_post), methods=["POST"]),
        # Not counted: the figures of a page already admitted (refused, the page would show broken images).
        Route("/files/{path:path}", files),
        Route("/favicon.ico", lambda request: Response(status_code=204)),  # a browser asks, on the JSON pages too
    ]
    app = Starlette(routes=routes, exception_handlers=_error_handlers(data, root),
        middleware=[Middleware(Guard, hosts=hosts, token=token),
                    Middleware(LoadModelAfterFirstResponse, model=data.model)])
    app.state.data, app.state.admission, app.state.model_queue = data, admission, model_queue
    return app


def _is_latent(text: str) -> bool:
    """Whether a URL's layer or memory names a dictionary's latents (``t4``, ``t4:42``: the prefix of
    `ffkv.memories.address.LATENT_PREFIX`), not a layer's neurons."""
    return latent_kind(text) is not None


def _check_latent(address: str) -> None:
    """A 404 at once, before the page waits for the model, for a one-part memory URL that is not a latent's
    address as written (``/memory/3``; ``/memory/t4:1_0``, ``/memory/t４:1``: `ffkv.memories.address.latent_address`),
    quoting it cut short."""
    if not _is_latent(address):
        raise BadRequest(f"no page for {quoted(address)} under /memory: a neuron's page is /memory/LAYER/KEY "
                         "(3/17), a latent's /memory/tLAYER:LATENT (t4:42)", 404)
    try:
        latent_address(address)
    except FfkvError as exc:
        raise BadRequest(str(exc), 404) from None


def _html(text: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(text, status_code=status)


async def _form(request: Request) -> dict[str, list[str]]:
    """A posted form's fields (name -> values), read up to `validation.MAX_BODY_BYTES`."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    if kind not in ("application/x-www-form-urlencoded", ""):
        raise BadRequest(f"send the form as application/x-www-form-urlencoded, not {kind[:60]}", 415)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > validation.MAX_BODY_BYTES:
            raise BadRequest(f"the request is larger than {validation.MAX_BODY_BYTES // 1024} kB", 413)
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise BadRequest("the form is not valid UTF-8", 400) from None
    out: dict[str, list[str]] = {}
    for k, v in pairs:
        out.setdefault(k, []).append(v)
    return out


def _query(request: Request) -> dict[str, list[str]]:
    """The URL's parameters (name -> values)."""
    out: dict[str, list[str]] = {}
    for k, v in request.query_params.multi_items():
        out.setdefault(k, []).append(v)
    return out


def _one(params: dict[str, list[str]], name: str, default=None):
    """The last value given for `name` (a URL or a form may repeat it), or `default`."""
    values = params.get(name)
    return values[-1] if values else default


def _error_handlers(data: ExplorerData, root: str) -> dict:
    """Every error as a page (or JSON for a .json URL) with its status and one line: bad requests, ffkv's
    refusals, unknown pages and methods, and what the explorer did not expect."""
    def error(status: int, message: str, request: Request):
        if request.url.path.endswith(".json"):
            return JSONResponse({"error": message, "status": status}, status_code=status)
        return _html(pages.error_page(status, REASONS.get(status, "Error"), message, data.run.path.name, root,
                                     data.n_layers), status)

    async def bad_request(request: Request, exc: BadRequest):
        response = error(exc.status, str(exc), request)
        if isinstance(exc, Busy):
            response.headers["retry-after"] = str(max(1, round(exc.retry_after_ms / 1000)))
            response.headers["retry-after-ms"] = str(exc.retry_after_ms)
        elif exc.status == 503:  # the model could not be loaded, or a run without weights: not soon
            response.headers["retry-after"] = "5"
        return response

    async def ffkv_error(request: Request, exc: FfkvError):
        return error(400, str(exc), request)

    async def http_error(request: Request, exc: HTTPException):
        message = {404: f"no page at {request.url.path[:200]}", 405: f"{request.method} is not allowed here"}.get(
            exc.status_code, str(exc.detail))
        return error(exc.status_code, message, request)

    async def server_error(request: Request, exc: Exception):
        return error(500, f"the explorer failed on this request ({type(exc).__name__}); please report it", request)

    return {BadRequest: bad_request, FfkvError: ffkv_error, HTTPException: http_error, Exception: server_error}


class LoadModelAfterFirstResponse:
    """ASGI middleware: once a first response has gone out, the model starts loading in the background, and so
    does the import of what the concepts page computes with (`pages.warm_up`)."""

    def __init__(self, app, model) -> None:
        self.app, self.model = app, model
        self._warming = False

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)
        if scope["type"] == "http":
            self.model.start()
            if not self._warming:
                self._warming = True
                threading.Thread(target=pages.warm_up, name="ffkv-warm-up", daemon=True).start()


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, loaded=None,
          allow_hosts: tuple[str, ...] = (), token: str | None = None, require_token: bool | None = None,
          dictionary_at: str | Path | None = None, stop_process_on_signal: bool = False) -> None:
    """Start the explorer on http://HOST:PORT (blocks until Ctrl-C); the model loads while it serves.

    Args:
        host: the interface to listen on. Beyond loopback, anyone who can reach it can read the run and
            post labels: a warning is printed and an access token is required unless `require_token` is False.
        allow_hosts: further host names the server answers to (e.g. the machine's DNS name behind a tunnel).
        token: the access token (default: a random one when a token is required).
        require_token: default: only when `host` is not a loopback address.
        dictionary_at: where the sparse dictionary the run was indexed with lies now, if its files moved.
        stop_process_on_signal: Ctrl-C (or SIGTERM) ends the whole process at once, with one line and exit status
            130 (143), whatever runs (a page, a generation, the model's load): the `ffkv serve` command. The
            explorer writes nothing a cut could leave half-written (annotations are written atomically), and a
            process whose torch threads are still running when Python shuts down aborts instead of exiting.
    """
    import uvicorn

    if stop_process_on_signal:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _stop_now)

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise FfkvError(f"--port must be from 0 to 65535, got {port!r}")
    loopback = is_loopback(host)
    if token is not None and not loopback and len(token) < MIN_TOKEN:
        raise FfkvError(f"--token must be at least {MIN_TOKEN} characters beyond loopback (got {len(token)}): anyone "
                        "who can reach the port could guess a short one; leave --token out for a random one")
    if require_token is None:
        require_token = not loopback or token is not None
    token = (token or new_token()) if require_token else None
    hosts = tuple(allow_hosts)
    if not loopback:
        # A wildcard bind is reached by whatever names point at this machine; the token is the guard there.
        hosts += ("*",) if token is not None and host in ("0.0.0.0", "::") else (host,)
        print(f"ffkv serve: warning: listening on {host}, not only on this machine: anyone who can reach it "
              + ("and has the token can read the run and post labels" if token else
                 "can read the run and post labels (no access token: --no-token)"), flush=True)
    listening = bind(host, port)  # before anything is built or printed: a taken port is one line, at once
    try:
        app = create_app(run_dir, loaded=loaded, progress=True, hosts=hosts, token=token,
                         dictionary_at=dictionary_at)
        port = listening.getsockname()[1]  # the port the system gave, for --port 0
        shown = f"[{host}]" if ":" in host else host
        if host in ("0.0.0.0", "::"):
            shown = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
        link = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
        print(f"ffkv serve: exploring {Path(run_dir)} at {link} (Ctrl-C to stop)", flush=True)
        # Not uvicorn's limit_concurrency: it counts open connections (idle keep-alive ones too) and answers
        # past it with a bare 503 that has no Retry-After and skips the security headers; `Admission` refuses
        # in the app instead. Its backlog applies only to a socket uvicorn opens (ours is `bind`'s).
        server = _server_class() if stop_process_on_signal else uvicorn.Server
        server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])
    finally:
        listening.close()


def _stop_now(signum: int, frame: object = None) -> None:
    """End the process at once: one line, exit status 128 + the signal's number (130 for Ctrl-C)."""
    try:
        sys.stdout.flush()
        sys.stderr.write(f"\nffkv: interrupted: the explorer stopped ({signal.Signals(signum).name})\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


def _server_class() -> type:
    import uvicorn

    class StoppingServer(uvicorn.Server):
        """uvicorn's server, but a signal ends the process at once (`_stop_now`) rather than after the requests
        in flight: a generation would keep it for its whole length, and torch's threads abort the shutdown."""

        def handle_exit(self, sig: int, frame) -> None:
            _stop_now(sig, frame)

    return StoppingServer


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; a taken port (or an address this machine does not have) is an
    `FfkvError` naming --port (or --host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise FfkvError(f"--host {host!r} is not an address of this machine ({exc.strerror})") from None
    listening = socket.socket(family, kind, proto)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts need no wait
        listening.bind(address)
        listening.listen(2048)
    except OSError as exc:
        listening.close()
        if exc.errno == errno.EADDRINUSE:
            raise FfkvError(f"port {port} on {host} is taken (another `ffkv serve`?): choose another with "
                            f"--port, e.g. --port {port + 1}") from None
        if exc.errno == errno.EACCES:
            raise FfkvError(f"port {port} on {host} needs privileges this user lacks: choose one above 1023 "
                            "with --port") from None
        raise FfkvError(f"cannot listen on {host}:{port} ({exc.strerror}): check --host and --port") from None
    listening.set_inheritable(True)
    return listening
