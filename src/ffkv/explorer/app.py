"""`ffkv serve RUN`: the explorer, a Starlette app with server-rendered pages (no build step).

Routes:
    /                               overview: the run, per-layer summaries, the figures
    /layer/{layer}?sort=&order=     a layer's keys, sorted by any metric
    /memory/{layer}/{key}           a memory: trigger examples, value tokens, pattern, annotation form
    /memory/{layer}/{key}/annotate  POST: save a human pattern label
    /search?token= | ?q=            memories promoting a token; full-text search of trigger examples
    /trace?prompt=&off=L:K&scale=L:K:S  (GET, or POST from the form): trace and intervene
    /files/{path}                   figures, metrics and the report of the run (nothing outside it)

Every bad request gets a 4xx page that says what was wrong; none shows a traceback.
"""

from __future__ import annotations

import threading
from pathlib import Path
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse
from starlette.routing import Route

from ffkv.errors import FfkvError
from ffkv.explorer import pages, validation
from ffkv.explorer.data import ExplorerData
from ffkv.explorer.tracing import max_prompt_tokens, trace
from ffkv.explorer.validation import BadRequest

REASONS = {400: "Bad request", 403: "Forbidden", 404: "Not found", 405: "Method not allowed",
           413: "Too large", 415: "Unsupported media type", 422: "Cannot use this input", 500: "Server error"}
#: Folders (and files) of the run directory that /files serves.
SERVED = ("figures", "metrics", "report.html")


def load_run_model(run_dir: str | Path):
    """The model a complete run was indexed with, loaded as the manifest names it."""
    from ffkv.models.loading import load_model
    from ffkv.store.run import RunDir

    model = RunDir(run_dir).require_complete().model
    return load_model(model.id, dtype=model.dtype)


def create_app(run_dir: str | Path, loaded=None, progress: bool = False, root: str = "") -> Starlette:
    """The explorer's web app for a run.

    Args:
        run_dir: a complete run directory.
        loaded: the run's model; default: loaded by the manifest's model id and dtype.
        progress: print the preparation steps of a first start.
        root: URL prefix when mounted below another path.
    """
    run_dir = Path(run_dir)
    if loaded is None:
        loaded = load_run_model(run_dir)
    data = ExplorerData(run_dir, loaded, progress=progress)
    model_lock = threading.Lock()  # hooks live on the model: one trace at a time
    max_tokens = max_prompt_tokens(loaded)

    def html(text: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(text, status_code=status)

    async def form(request: Request) -> dict[str, list[str]]:
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

    def query(request: Request) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for k, v in request.query_params.multi_items():
            out.setdefault(k, []).append(v)
        return out

    def one(params: dict[str, list[str]], name: str, default=None):
        values = params.get(name)
        return values[-1] if values else default

    async def overview(request: Request):
        return html(pages.overview(data, root))

    async def layer(request: Request):
        q = query(request)
        return html(pages.layer_page(data, request.path_params["layer"], one(q, "sort", "key"),
                                     one(q, "order", "asc"), one(q, "page", "0"), root))

    async def memory(request: Request):
        p = request.path_params
        return html(pages.memory_page(data, p["layer"], p["key"], root))

    async def annotate(request: Request):
        p = request.path_params
        layer, key = data.check(p["layer"], p["key"])
        f = await form(request)
        data.annotations.save(layer, key, validation.label(one(f, "label")),
                              validation.short_text(one(f, "description"), "description", 2000),
                              validation.short_text(one(f, "annotator"), "annotator", 100))
        return RedirectResponse(f"{root}/memory/{layer}/{key}#pattern", status_code=303)

    async def search(request: Request):
        q = query(request)
        return html(pages.search_page(data, one(q, "token"), one(q, "q"), root))

    def run_trace(params: dict[str, list[str]]) -> str:
        prompt = one(params, "prompt")
        if prompt is None:
            return pages.trace_page(data, None, None, None, root)
        prompt = validation.prompt(prompt)
        token_ids = list(data.loaded.tokenizer.encode(prompt))
        if not token_ids:
            raise BadRequest("the prompt gives no tokens", 422)
        if len(token_ids) > max_tokens:
            raise BadRequest(f"the prompt has {len(token_ids):,} tokens; this model takes at most {max_tokens:,}", 413)
        fields = {k: v[-1] for k, v in params.items() if k.startswith("scale:")}
        edits = validation.edits(params.get("off", []), params.get("scale", []), fields, data.n_layers, data.d_m)
        with model_lock:
            base = trace(data.loaded, token_ids)
            edited = trace(data.loaded, token_ids, edits) if edits else None
        return pages.trace_page(data, prompt, base, edited, root)

    async def trace_get(request: Request):
        from starlette.concurrency import run_in_threadpool

        return html(await run_in_threadpool(run_trace, query(request)))

    async def trace_post(request: Request):
        from starlette.concurrency import run_in_threadpool

        params = await form(request)
        return html(await run_in_threadpool(run_trace, params))

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

    async def bad_request(request: Request, exc: BadRequest):
        return html(pages.error_page(exc.status, REASONS.get(exc.status, "Error"), str(exc),
                                     data.run.path.name, root), exc.status)

    async def ffkv_error(request: Request, exc: FfkvError):
        return html(pages.error_page(400, REASONS[400], str(exc), data.run.path.name, root), 400)

    async def http_error(request: Request, exc: HTTPException):
        message = {404: f"no page at {request.url.path[:200]}", 405: f"{request.method} is not allowed here"}.get(
            exc.status_code, str(exc.detail))
        return html(pages.error_page(exc.status_code, REASONS.get(exc.status_code, "Error"), message,
                                     data.run.path.name, root), exc.status_code)

    async def server_error(request: Request, exc: Exception):
        return html(pages.error_page(500, REASONS[500], f"the explorer failed on this request ({type(exc).__name__}); "
                                     "please report it", data.run.path.name, root), 500)

    routes = [
        Route("/", overview),
        Route("/layer/{layer}", layer),
        Route("/memory/{layer}/{key}", memory),
        Route("/memory/{layer}/{key}/annotate", annotate, methods=["POST"]),
        Route("/search", search),
        Route("/trace", trace_get, methods=["GET"]),
        Route("/trace", trace_post, methods=["POST"]),
        Route("/files/{path:path}", files),
    ]
    app = Starlette(routes=routes, exception_handlers={
        BadRequest: bad_request, FfkvError: ffkv_error, HTTPException: http_error, Exception: server_error})
    app.state.data = data
    return app


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, loaded=None) -> None:
    """Start the explorer on http://HOST:PORT (blocks until Ctrl-C)."""
    import uvicorn

    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise FfkvError(f"--port must be from 0 to 65535, got {port!r}")
    app = create_app(run_dir, loaded=loaded, progress=True)
    shown = f"[{host}]" if ":" in host else host
    print(f"ffkv serve: exploring {Path(run_dir)} at http://{shown}:{port}/ (Ctrl-C to stop)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
