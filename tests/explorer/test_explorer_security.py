"""Who gets in: the Host allow-list (DNS rebinding), cross-site posts (CSRF), the access token of a
server bound beyond loopback, security headers, and the bounded model queue; on the real analysed run."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from ffkv.explorer import create_app
from ffkv.explorer.security import HEADERS, TOKEN_COOKIE, host_name, is_loopback
from ffkv.store.annotations import read_labels

LOCAL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def client(analyzed):
    run, loaded = analyzed
    with TestClient(base_url=LOCAL, app=create_app(run, loaded=loaded), raise_server_exceptions=False) as c:
        yield c


def label(client, headers: dict, annotator: str = "tester"):
    return client.post("/memory/1/0/annotate", data={"label": "shallow", "description": "", "annotator": annotator},
                       headers=headers, follow_redirects=False)


@pytest.mark.parametrize("path", ["/", "/layer/1", "/memory/1/0", "/memory/1/0.json", "/search?token=a",
                                  "/trace", "/no/such/page", "/files/figures/nothing.png"])
def test_every_response_carries_the_security_headers(client, path):
    r = client.get(path)
    for name, value in HEADERS:
        assert r.headers.get(name.decode()) == value.decode(), (path, name)
    assert "script-src" not in r.headers["content-security-policy"]  # default-src 'none' forbids every script
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.7"])
def test_foreign_host_names_are_refused(client, host):
    r = client.get("/memory/1/0.json", headers={"host": host})
    assert r.status_code == 421 and "--allow-host" in r.text and "triggers" not in r.text


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "localhost", "[::1]:8000", "LOCALHOST"])
def test_loopback_names_are_answered(client, host):
    assert client.get("/", headers={"host": host}).status_code == 200


def test_allowed_hosts_are_answered(analyzed):
    run, loaded = analyzed
    with TestClient(base_url="http://lab-box.internal:8000", app=create_app(run, loaded=loaded,
                                                                            hosts=("lab-box.internal",))) as c:
        assert c.get("/").status_code == 200
        assert c.get("/", headers={"host": "other.internal"}).status_code == 421


@pytest.mark.parametrize("headers", [
    {"origin": "https://evil.example"},
    {"origin": "null"},
    {"origin": "http://127.0.0.1:9999"},  # another port is another origin
    {"sec-fetch-site": "cross-site"},
    {"sec-fetch-site": "same-site", "origin": "http://127.0.0.1:8000"},
])
def test_cross_site_posts_are_refused_and_save_nothing(fresh_run, headers):
    run, loaded = fresh_run
    with TestClient(base_url=LOCAL, app=create_app(run, loaded=loaded)) as c:
        r = label(c, headers, annotator="attacker")
        assert r.status_code == 403 and "cross-site" in r.text
        trace = c.post("/trace", data={"prompt": "the cat"}, headers=headers)
        assert trace.status_code == 403
    assert read_labels(run).empty


@pytest.mark.parametrize("headers", [
    {"origin": LOCAL, "sec-fetch-site": "same-origin"},  # the page's own form, in a browser
    {},  # curl or a script: not a browser, so not a CSRF vector
])
def test_same_origin_posts_are_saved(fresh_run, headers):
    run, loaded = fresh_run
    with TestClient(base_url=LOCAL, app=create_app(run, loaded=loaded)) as c:
        assert label(c, headers).status_code == 303
    saved = read_labels(run)
    assert list(saved["annotator"]) == ["tester"] and list(saved["label"]) == ["shallow"]


def test_the_access_token(analyzed):
    run, loaded = analyzed
    app = create_app(run, loaded=loaded, hosts=("*",), token="s3cret")
    with TestClient(base_url="http://some-name.lan:8000", app=app) as c:
        refused = c.get("/memory/1/0.json")
        assert refused.status_code == 401 and "token" in refused.text and "triggers" not in refused.text
        assert c.get("/", params={"token": "wrong"}).status_code == 401
        assert c.get("/", headers={"authorization": "Bearer s3cret"}).status_code == 200
        # The token in the URL once: a cookie keeps it, and the URL loses it.
        first = c.get("/layer/1", params={"token": "s3cret", "page": "1"}, follow_redirects=False)
        assert first.status_code == 303 and first.headers["location"] == "/layer/1?page=1"
        cookie = first.headers["set-cookie"]
        assert cookie.startswith(f"{TOKEN_COOKIE}=s3cret") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert c.get("/memory/1/0.json").status_code == 200  # the client keeps the cookie
        # A token does not let a cross-site post through.
        assert label(c, {"origin": "https://evil.example"}).status_code == 403


def test_serve_beyond_loopback_warns_and_requires_a_token(analyzed, monkeypatch, capsys):
    import uvicorn

    from ffkv.explorer import serve

    run, loaded = analyzed
    apps = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    serve(run, host="0.0.0.0", port=8123, loaded=loaded)
    out = capsys.readouterr().out
    assert "warning" in out and "?token=" in out
    token = out.split("?token=")[1].split()[0]
    with TestClient(base_url="http://192.0.2.10:8123", app=apps[-1]) as c:
        assert c.get("/").status_code == 401
        assert c.get("/", headers={"authorization": f"Bearer {token}"}).status_code == 200
    serve(run, host="127.0.0.1", port=8123, loaded=loaded)
    out = capsys.readouterr().out
    assert "warning" not in out and "token" not in out
    with TestClient(base_url=LOCAL, app=apps[-1]) as c:
        assert c.get("/").status_code == 200
    serve(run, host="0.0.0.0", port=8123, loaded=loaded, require_token=False)
    assert "no access token" in capsys.readouterr().out


def test_helpers():
    assert [is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "0.0.0.0",
                                     "192.168.1.2", "example.org")] == [True] * 5 + [False] * 3
    assert [host_name(h) for h in ("LocalHost:80", "[::1]:8000", "::1", "a.b")] == ["localhost", "::1", "::1", "a.b"]


def test_a_full_model_queue_is_a_503_with_retry_after(analyzed, monkeypatch):
    import ffkv.explorer.app as app_module

    run, loaded = analyzed
    monkeypatch.setattr(app_module, "MAX_WAITING_FOR_MODEL", 0)  # any model request finds the queue full
    with TestClient(base_url=LOCAL, app=create_app(run, loaded=loaded)) as c:
        r = c.get("/trace", params={"prompt": "the cat"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "busy" in r.text
        assert c.get("/memory/1/0.json").status_code == 503
        assert c.get("/layer/1").status_code == 200  # pages that read only tables do not wait for the model
        assert c.get("/trace").status_code == 200  # the empty form needs no model


def plant_in_database(run, sql: str) -> None:
    """Edit the run's explorer.duckdb as someone who sends the run would, and record its new size in info.json
    (so that the lookup tables still look current)."""
    import json

    import duckdb

    folder = run / "explorer"
    con = duckdb.connect(str(folder / "explorer.duckdb"))
    con.execute(sql)
    con.execute("CHECKPOINT")
    con.close()
    info = json.loads((folder / "info.json").read_text())
    info["files"]["explorer.duckdb"]["size"] = (folder / "explorer.duckdb").stat().st_size
    (folder / "info.json").write_text(json.dumps(info))


@pytest.mark.parametrize("sql", [
    # The audit's: the texts the search shows, with a file of the reader's appended.
    "DROP INDEX texts_id; ALTER TABLE texts RENAME TO texts_real; CREATE VIEW texts AS SELECT example_id, token_ids, "
    "text || (SELECT content FROM read_text('{secret}')) AS text FROM texts_real",
    "CREATE MACRO leak() AS (SELECT content FROM read_text('{secret}'))",
    "DROP TABLE triggers_by_example",
])
def test_a_database_that_reads_the_readers_files_is_refused(fresh_run, tmp_path, sql):
    """A run's explorer.duckdb holding a view that called read_text('/some/file') served that file through /search:
    DuckDB's read_only does not switch its file access off. Now the database is refused before any page, with one
    line naming it and the command that rebuilds it, and nothing of the file is read."""
    from ffkv.errors import DamagedRun
    from ffkv.explorer.data import ExplorerData

    run, loaded = fresh_run
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    plant_in_database(run, sql.format(secret=secret))
    with pytest.raises(DamagedRun) as refused:
        ExplorerData(run, loaded=loaded)
    line = str(refused.value)
    assert "\n" not in line and str(run / "explorer" / "explorer.duckdb") in line
    assert f"ffkv analyze {run} --only lookups" in line and "TOP-SECRET" not in line


def test_a_run_database_connection_reads_no_files(fresh_run, tmp_path):
    """Even a query ffkv itself sent could not read a file: external access is off and locked."""
    import duckdb

    from ffkv.store.database import open_database

    run, _ = fresh_run
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    con = open_database(run / "explorer" / "explorer.duckdb")
    with pytest.raises(duckdb.PermissionException):
        con.execute(f"SELECT content FROM read_text('{secret}')").fetchall()
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")
    assert con.execute("SELECT count(*) FROM triggers").fetchone()[0] > 0


def test_a_confined_connection_reads_the_files_it_names_and_no_other(fresh_run, tmp_path):
    """The connections ffkv opens to read a run's Parquet tables (the lookups' build, the report's layer summary)
    read the tables they name; any other file, or switching access back on, is refused."""
    import duckdb

    from ffkv.store.database import confine
    from ffkv.store.run import RunDir

    run = RunDir(fresh_run[0])
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    con = confine(duckdb.connect(), [run.table("trigger_examples")])
    assert con.execute(f"SELECT count(*) FROM read_parquet('{run.table('trigger_examples')}')").fetchone()[0] > 0
    for sql in (f"SELECT content FROM read_text('{secret}')", f"SELECT * FROM read_parquet('{run.table('examples')}')"):
        with pytest.raises(duckdb.PermissionException):
            con.execute(sql).fetchall()
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")
