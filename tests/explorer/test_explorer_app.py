"""Every page of the explorer answers; every bad request gets a clear 4xx, never a 500. URLs count layers from 1."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

import ffkv
from ffkv.explorer import create_app
from ffkv.store.annotations import read_labels


@pytest.fixture(scope="module")
def client(analyzed):
    run, loaded = analyzed
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("url, expect", [
    ("/", "Figure 2"),
    ("/layer/1", 'id="keys"'),
    ("/layer/3?sort=largest%20m&order=desc&page=1", 'id="keys"'),
    ("/layer/2?sort=pattern", "shallow"),
    ("/layer/2?sort=activation+frequency&order=asc", 'id="keys"'),
    ("/memory/2/7", 'id="triggers"'),
    ("/memory/2/7?projection=final-norm", 'id="value-bottom"'),
    ("/memory/2/7.json", '"layer_number":2'),
    ("/search", 'id="token-search"'),
    ("/search?q=paris", 'id="hits"'),
    ("/search?token=%23" + "10", 'id="promoting"'),
    ("/trace", 'id="trace-form"'),
    ("/trace?prompt=the+cat+sat", 'id="predictions"'),
    ("/trace?prompt=the+cat+sat&off=3:3&scale=2:4=10", "with interventions"),
    ("/trace?prompt=the+cat+sat&position=1&generate=3", 'id="generation"'),
    ("/files/figures/values.png", None),
])
def test_pages(client, url, expect):
    r = client.get(url)
    assert r.status_code == 200, r.text[-500:]
    if expect:
        assert expect in r.text


def test_layer_sorting(client, analyzed):
    r = client.get("/layer/1?sort=largest%20m&order=desc")
    keys = [int(k) for k in re.findall(r'<a href="/memory/1/(\d+)">', r.text)]
    largest = client.app.state.data.layer_keys(0).set_index("key")["top_coefficient"]
    shown = [float(largest[k]) for k in keys]
    assert len(keys) == 40 and shown == sorted(shown, reverse=True)


BAD = [
    ("get", "/layer/4", 404), ("get", "/layer/0", 404), ("get", "/layer/-1", 404), ("get", "/layer/abc", 404),
    ("get", "/memory/1/40", 404), ("get", "/memory/9/0", 404), ("get", "/memory/0/0", 404), ("get", "/memory/1/1e3", 404),
    ("get", "/memory/1/40.json", 404), ("get", "/memory/1/1?projection=soft", 422),
    ("get", "/layer/1?sort=nonsense", 422), ("get", "/layer/1?page=99", 404), ("get", "/layer/1?page=0", 404),
    ("get", "/layer/1?order=up", 422),
    ("get", "/search?token=not-a-token-here", 404),  # an empty search form is the search page (test_explorer_pages)
    ("get", "/trace?prompt=", 422), ("get", "/trace?prompt=+++", 422),
    ("get", "/trace?prompt=" + "a" * 60_000, 413), ("get", "/trace?prompt=" + "a" * 3000, 413),  # > model tokens
    ("get", "/trace?prompt=hi&off=1:99", 422), ("get", "/trace?prompt=hi&off=7:1", 422), ("get", "/trace?prompt=hi&off=0:1", 422),
    ("get", "/trace?prompt=hi&scale=1:1=nan", 422), ("get", "/trace?prompt=hi&scale=1:1=inf", 422),
    ("get", "/trace?prompt=hi&scale=1:1=abc", 422), ("get", "/trace?prompt=hi&off=01", 422),
    ("get", "/trace?prompt=hi&position=2", 422), ("get", "/trace?prompt=hi&generate=1000", 422),
    ("get", "/trace?prompt=hi&target=no+such+token", 404),
    ("get", "/files/%2e%2e/%2e%2e/etc/passwd", 403), ("get", "/files/..%2f..%2fetc%2fpasswd", 403),
    ("get", "/files/manifest.json", 404), ("get", "/files/explorer/explorer.duckdb", 404),
    ("get", "/files/figures/none.png", 404), ("get", "/nowhere", 404), ("delete", "/", 405),
]


@pytest.mark.parametrize("method, url, status", BAD)
def test_bad_requests_are_clear_4xx(client, method, url, status):
    r = client.request(method, url)
    assert r.status_code == status, r.text[-400:]
    if url.split("?")[0].endswith(".json"):
        assert r.json()["status"] == status and r.json()["error"]
    else:
        assert 'id="error-message"' in r.text and "Traceback" not in r.text


def test_bad_posts(client):
    big = client.post("/trace", data={"prompt": "a" * 100_000})
    assert big.status_code == 413 and "limit" in big.text
    huge = client.post("/trace", content=b"prompt=" + b"a" * 400_000,
                       headers={"content-type": "application/x-www-form-urlencoded"})
    assert huge.status_code == 413
    assert client.post("/trace", data={"prompt": ""}).status_code == 422
    assert client.post("/trace", content=b"{}", headers={"content-type": "application/json"}).status_code == 415
    assert client.post("/memory/1/1/annotate", data={"label": "deep"}).status_code == 422
    assert client.post("/memory/1/99/annotate", data={"label": "none"}).status_code == 404
    assert client.post("/memory/0/1/annotate", data={"label": "none"}).status_code == 404
    assert client.post("/memory/1/1/annotate", data={"label": "none", "description": "x" * 3000}).status_code == 413


def test_a_100kb_prompt_through_the_real_server_is_4xx(client):
    """uvicorn itself (not the app) may answer an over-long request line: still a 4xx."""
    import socket

    from support.browser import live_server

    with live_server(client.app) as url:
        port = int(url.rsplit(":", 1)[1])
        for request in (
            b"GET /trace?prompt=" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"POST /trace HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: 100007\r\nConnection: close\r\n\r\nprompt=" + b"a" * 100_000,
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(request)
                status = s.recv(64).split(b" ")[1]
            assert 400 <= int(status) < 500


def test_trace_form_post_with_interventions(client):
    r = client.post("/trace", data={"prompt": "she was born in", "off": ["1:1", "3:5"], "scale:2:3": "50",
                                    "scale:2:4": "", "action": "intervene"})
    assert r.status_code == 200 and "with interventions" in r.text
    assert 'value="3:5" checked' in r.text and 'name="scale:2:3" value="50.0"' in r.text


def test_annotation_is_saved_in_the_run(fresh_run):
    run, loaded = fresh_run
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as c:
        r = c.post("/memory/3/11/annotate", data={"label": "semantic", "description": "cities <b>", "annotator": "ada"},
                   follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/memory/3/11")
        page = c.get("/memory/3/11").text
    assert "cities &lt;b&gt;" in page and "ada" in page
    labels = read_labels(run)  # the run's tables count layers from 0: page layer 3 is layer 2
    assert labels[["layer", "key", "label", "annotator"]].values.tolist() == [[2, 11, "semantic", "ada"]]


def test_corpus_text_is_escaped(client):
    page = client.get("/search?q=loud").text  # the match highlighted, the text around it escaped
    assert '&lt;b&gt;<mark class="hit">loud</mark>&lt;/b&gt; &amp; clear' in page and "<b>loud</b>" not in page


def test_notebook_objects_render_the_same_html(analyzed):
    run, loaded = analyzed
    opened = ffkv.open_run(run, loaded)
    m = opened.memory(1, 7)  # code counts layers from 0: the page says layer 2
    html = m._repr_html_()
    assert html.startswith('<div class="ffkv-memory">') and 'id="triggers"' in html and "<style>" in html
    assert "Memory 2:7" in html and "Memory(layer=1, key=7" in repr(m)
    t = opened.trace("the cat sat", off=[(2, 3)], scale={(1, 4): 10}, set={(0, 2): -3.0})
    html = t._repr_html_()
    assert 'id="predictions"' in html and "with interventions" in html and "<input" not in html
    assert "<strong>=-3</strong>" in html and "<strong>×10</strong>" in html and "<strong>off</strong>" in html
    assert float(t.edited.layers[0].coefficients[2]) == -3.0  # set, as `ffkv intervene --set 1:2=-3` sets it
    with pytest.raises(Exception, match="named twice"):
        opened.trace("the cat sat", off=[(2, 3)], set={(2, 3): 1.0})
    with pytest.raises(Exception, match="empty"):
        opened.trace("")


@pytest.mark.parametrize("family", ["opt", "llama", "bert"])
def test_other_families(tmp_path, family):
    from support.runs import index_run

    run, loaded = index_run(tmp_path, family=family)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as c:
        for url in ("/", "/layer/2?sort=largest%20m", "/memory/3/3", "/memory/3/3?projection=identity&shown=logit", "/search?q=cat",
                    "/trace?prompt=the+cat+sat&off=3:3&scale=1:1=3&generate=2"):
            assert c.get(url).status_code == 200, (family, url)
        # An index without analyses has no automatic labels: sorting by them says so.
        r = c.get("/layer/2?sort=pattern")
        assert r.status_code == 422 and "ffkv analyze --only patterns" in r.text


def test_serve_checks_the_port_and_runs_uvicorn(analyzed, monkeypatch):
    import uvicorn

    from ffkv.errors import FfkvError
    from ffkv.explorer import serve

    run, loaded = analyzed
    with pytest.raises(FfkvError, match="port"):
        serve(run, port=70000, loaded=loaded)
    seen = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.update(
        app=self.config.app, address=sockets[0].getsockname()))
    serve(run, host="127.0.0.1", port=8123, loaded=loaded)
    assert seen["address"] == ("127.0.0.1", 8123) and seen["app"].state.data.n_layers == 3


def test_serve_on_a_taken_port_says_so_in_one_line_before_anything_else(analyzed, monkeypatch, capsys):
    """The port is bound before the app is built or its address printed: a taken port is one error naming
    --port (the issue: "exploring at http://..." was printed, then a server error)."""
    import socket

    import uvicorn

    from ffkv import cli

    run, loaded = analyzed
    monkeypatch.setattr("ffkv.explorer.app.load_run_model", lambda path: loaded)
    started = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(self))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = cli.main(["serve", str(run), "--port", str(port)])
    out, err = capsys.readouterr()
    assert code == 2 and not started and "exploring" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"port {port} on 127.0.0.1 is taken" in lines[0] and "--port" in lines[0]


def test_serve_refuses_what_is_not_a_run(tmp_path):
    from ffkv.errors import FfkvError

    with pytest.raises(FfkvError, match="not an ffkv run directory"):
        create_app(tmp_path, loaded=object())


def test_the_runs_model_is_loaded_by_its_manifest(analyzed, monkeypatch):
    import ffkv.models.loading as loading

    run, loaded = analyzed
    calls = []
    monkeypatch.setattr(loading, "load_model", lambda name, dtype="float32", device="cpu": calls.append((name, dtype)) or loaded)
    app = create_app(run)  # the model loads in the background; pages that need it wait for it
    assert app.state.data.loaded is loaded and calls == [("tiny-gpt2", "float32")]


def test_a_model_that_cannot_be_loaded_is_a_clear_503(analyzed, monkeypatch):
    import ffkv.models.loading as loading
    from ffkv.errors import FfkvError

    run, _ = analyzed

    def fail(name, dtype="float32", device="cpu"):
        raise FfkvError("no network to fetch tiny-gpt2")

    monkeypatch.setattr(loading, "load_model", fail)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run), raise_server_exceptions=False) as c:
        assert c.get("/").status_code == 200  # the overview reads tables only
        r = c.get("/memory/1/1")
        assert r.status_code == 503 and "no network to fetch tiny-gpt2" in r.text


def test_a_model_loaded_in_the_background_warms_the_first_memory_page(analyzed, monkeypatch):
    """Once the background load is done, the vocabulary's strings and the templates are ready: the first memory
    page a reader opens does not wait for them."""
    import threading

    import ffkv.models.loading as loading
    from ffkv.explorer import pages

    run, loaded = analyzed
    monkeypatch.setattr(loading, "load_model", lambda name, dtype="float32", device="cpu": loaded)
    compiled = threading.Event()
    real_warm = pages.warm
    monkeypatch.setattr(pages, "warm", lambda: (real_warm(), compiled.set()))
    app = create_app(run)
    data = app.state.data
    assert data._tokens is None
    app.state.data.model.start()
    assert compiled.wait(120)
    assert data._tokens is not None and len(data._tokens) == data.vocab_size


def test_flag_columns_say_yes_or_no_and_blank_only_when_not_computed(client):
    """Issue 43: the layer page's flag columns showed "yes" or nothing, so a "no" read as "not computed"."""
    keys = client.app.state.data.layer_keys(0)
    flags = [c for c in ("agreement", "census_eraser", "census_two_way") if c in keys]
    assert flags  # the analysed run computes all three
    page = client.get("/layer/1").text
    cells = re.findall(r"<td[^>]*>(yes|no)</td>", page)
    computed = int(keys[flags].notna().sum().sum())  # 40 keys, one page
    assert len(cells) == computed and cells.count("yes") == int(keys[flags].fillna(False).astype(bool).sum().sum())
    assert "no" in cells


LONG_ID = "1" * 60_000  # as long as the test client sends (a real server took 100,000)


@pytest.mark.parametrize("url, status", [
    ("/memory/1/1_0", 404), ("/memory/1/1_0.json", 404), ("/memory/\uff11/1", 404), ("/memory/1/\uff11", 404),
    ("/memory/1/\u00b2", 404), ("/memory/1/+1", 404), ("/memory/1/" + LONG_ID, 404), ("/memory/1/" + LONG_ID + ".json", 404),
    ("/layer/\uff11", 404), ("/layer/1_0", 404), ("/layer/1?page=\uff11", 422), ("/layer/1?page=1_0", 422),
    ("/concepts?layer=\uff11", 422), ("/search?token=%23\uff11\uff10", 404), ("/search?token=%23\u00b2", 404),
    ("/trace?prompt=hi&position=\uff11", 422), ("/trace?prompt=hi&off=1:1_0", 422),
    ("/trace?prompt=hi&scale=\uff11:1=2", 422), ("/trace?prompt=hi&off=1:" + LONG_ID[:5000], 422),
])
def test_a_number_is_read_in_ascii_digits_only_and_quoted_short(client, url, status):
    """Python's int() reads "1_0" as 10 and "１" (a fullwidth digit) as 1: /memory/1/1_0 showed memory 1:10, and
    a 100,000-digit latent id came back whole in the error. Every number a URL gives is ASCII digits, a few of them, and
    a refusal quotes at most a short prefix of it."""
    r = client.get(url)
    assert r.status_code == status, r.text[-400:]
    assert len(r.content) < 20_000 and "1" * 50 not in r.text
    if url.split("?")[0].endswith(".json"):
        assert r.json()["status"] == status and r.json()["error"]
    else:
        assert 'id="error-message"' in r.text and "Traceback" not in r.text


def test_an_edit_that_overflows_the_model_is_refused_with_its_cause(analyzed):
    """Within the bound, an edit can still overflow a model whose value is huge: the trace under it is refused with
    the cause named, not drawn from NaN."""
    import copy

    import torch

    run, loaded = analyzed
    crafted = copy.deepcopy(loaded)
    with torch.no_grad():
        value = crafted.view.values(1)[3]
        value.mul_(1e16 / value.norm())
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=crafted),
                    raise_server_exceptions=False) as c:
        assert c.get("/trace?prompt=the+cat+sat").status_code == 200  # the model alone is finite
        for url in ("/trace?prompt=the+cat+sat&set=2:3=1e4", "/trace?prompt=the+cat+sat&set=2:3=1e4&generate=3"):
            r = c.get(url)
            assert r.status_code == 422, r.text[-400:]
            assert "the edit set 2:3=10000 made the model&#39;s output NaN or infinite" in r.text
        r = c.post("/trace", data={"prompt": "the cat sat", "set:2:3": "1e4", "action": "intervene"})
        assert r.status_code == 422 and "NaN or infinite" in r.text
