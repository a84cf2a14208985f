"""Under a crowd the explorer answers what it can and refuses the rest at once: with every slot taken by a
page whose work is held, one more request is a 503 with Retry-After while the others still wait; once the
work is released every held request is answered, and no slot is lost to an error or a client that left.
How fast it answers a crowd is measured by `benchmarks/explorer_crowd.py`, not here."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from starlette.testclient import TestClient

from ffkv.explorer import create_app, pages
from ffkv.explorer.app import MAX_IN_FLIGHT, MODEL_WAIT_S, RETRY_AFTER_MS
from support.browser import live_server

LOCAL = "http://127.0.0.1:8000"


def wait_until(condition, what: str, seconds: float = 60) -> None:
    """Poll `condition` until it holds; fail naming `what` after `seconds` (a bound on a hang, not a speed)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.01)


def hold(monkeypatch, page: str):
    """`pages.<page>` waits for the returned Event before its work (set it on teardown, so nothing hangs)."""
    release = threading.Event()
    real = getattr(pages, page)

    def held(*args, **kwargs):
        if not release.wait(120):
            raise RuntimeError("the test never released the page")
        return real(*args, **kwargs)

    monkeypatch.setattr(pages, page, held)
    return release


@pytest.fixture
def held_layer_page(monkeypatch):
    """Layer pages wait for the returned Event before their work."""
    release = hold(monkeypatch, "layer_page")
    yield release
    release.set()


@pytest.fixture
def held_model_page(monkeypatch):
    """Memory pages as JSON (model work) wait for the returned Event before their work."""
    release = hold(monkeypatch, "memory_json")
    yield release
    release.set()


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text[-300:]
    assert r.headers["retry-after"] == "1"
    assert RETRY_AFTER_MS[0] <= int(r.headers["retry-after-ms"]) < RETRY_AFTER_MS[1]
    assert "content-security-policy" in r.headers  # the security headers, as on every answer
    if r.request.url.path.endswith(".json"):
        assert r.json() == {"status": 503, "error": r.json()["error"]} and "try again" in r.json()["error"]
    else:
        assert 'id="error-message"' in r.text and "try again" in r.text


def test_a_full_explorer_refuses_at_once_and_recovers(analyzed, held_layer_page):
    run, loaded = analyzed
    app = create_app(run, loaded=loaded)
    admission = app.state.admission
    with live_server(app) as url, ThreadPoolExecutor(MAX_IN_FLIGHT) as clients:
        held = [clients.submit(httpx.get, f"{url}/layer/1", timeout=120) for _ in range(MAX_IN_FLIGHT)]
        try:
            wait_until(lambda: admission.in_flight == MAX_IN_FLIGHT, "every slot taken")
            for path in ("/", "/layer/2", "/memory/1/0", "/memory/1/0.json", "/search?q=cat", "/trace"):
                assert_refused(httpx.get(url + path, timeout=30))
            assert not any(request.done() for request in held)  # refused while every admitted page still waits
            assert httpx.get(f"{url}/files/figures/values.png", timeout=30).status_code == 200  # not counted
        finally:
            held_layer_page.set()
        assert [request.result().status_code for request in held] == [200] * MAX_IN_FLIGHT
        assert admission.in_flight == 0
        assert httpx.get(f"{url}/memory/1/0", timeout=60).status_code == 200


def test_a_client_that_leaves_gives_its_slot_back_when_its_work_ends(analyzed, held_layer_page):
    run, loaded = analyzed
    app = create_app(run, loaded=loaded)
    admission = app.state.admission
    with live_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /layer/1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            wait_until(lambda: admission.in_flight == 1, "the request admitted")
        assert admission.in_flight == 1  # gone, but its page is still being computed: the slot stays taken
        held_layer_page.set()
        wait_until(lambda: admission.in_flight == 0, "the slot given back")
        assert httpx.get(f"{url}/layer/1", timeout=60).status_code == 200


def test_a_request_waits_for_the_model_only_when_it_can_be_answered_in_time(analyzed, held_model_page):
    run, loaded = analyzed
    app = create_app(run, loaded=loaded)
    queue = app.state.model_queue

    def waiting() -> int:
        return queue.pool.statistics().tasks_waiting

    with live_server(app) as url, ThreadPoolExecutor(3) as clients:
        try:
            held = [clients.submit(httpx.get, f"{url}/memory/1/{key}.json", timeout=120) for key in (0, 1)]
            wait_until(lambda: waiting() == 1, "one request running, one waiting")  # one may always wait
            queue.seconds = MODEL_WAIT_S / 2  # a slow model: the running one, the waiting one and its own: too long
            assert_refused(httpx.get(f"{url}/memory/1/2.json", timeout=30))
            assert_refused(httpx.get(f"{url}/memory/1/2", timeout=30))
            assert httpx.get(f"{url}/layer/1", timeout=30).status_code == 200  # tables need no model
            queue.seconds = 0.01  # a fast model: this one will be answered in time, so it waits
            held.append(clients.submit(httpx.get, f"{url}/memory/1/2.json", timeout=120))
            wait_until(lambda: waiting() == 2, "a second one waiting")
            assert not any(request.done() for request in held)
        finally:
            held_model_page.set()
        assert [request.result().status_code for request in held] == [200] * 3
        assert queue.seconds > 0.01 and app.state.admission.in_flight == 0  # the time of each request is kept


def test_errors_give_their_slot_back(analyzed, monkeypatch):
    import ffkv.explorer.app as app_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    run, loaded = analyzed
    monkeypatch.setattr(pages, "search_page", broken)
    monkeypatch.setattr(app_module, "MAX_WAITING_FOR_MODEL", 0)  # any model request finds the model's queue full
    app = create_app(run, loaded=loaded)
    with TestClient(base_url=LOCAL, app=app, raise_server_exceptions=False) as c:
        for path, status in (("/search?q=cat", 500), ("/layer/99", 404), ("/layer/1?sort=nonsense", 422),
                             ("/memory/1/0", 503), ("/layer/1", 200)):
            r = c.get(path)
            assert r.status_code == status, (path, r.text[-300:])
            assert app.state.admission.in_flight == 0, path
        assert_refused(c.get("/memory/1/0.json"))  # the model's full queue refuses as a full explorer does
