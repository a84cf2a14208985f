"""A latent's page shows its explanation and simulation score as a neuron's page shows its own (issue 46).

Built by the real pipeline: the planted model indexed with its hand-built transcoder of layer 0 (t1; support.
explain_runs), neurons and latents explained by the loopback server's rule (with every control latent, so a control
latent shares each explained latent's index, and a neuron of layer 1 shares it too), scored, the explorer's lookups
built. Each page is read against the stored tables: the latent's own row, never its control's nor the neuron's with
the same layer and key. A run whose latents were not explained shows nothing new; a hostile explanations table is
named as damaged (wrong types) or its rows for latents the run lacks are left out.
"""

from __future__ import annotations

import re
from html import unescape

import numpy as np
import pandas as pd
import pytest
from markupsafe import escape
from starlette.testclient import TestClient

from ffkv.errors import DamagedRun
from ffkv.experiments.lookups import build
from ffkv.explorer import create_app
from ffkv.explorer.data import ExplorerData
from ffkv.explorer.pages import latent_json, latent_layer_page, latent_page, layer_page, memory_json, memory_page
from ffkv.memories.address import LatentRef
from ffkv.store.run import RunDir
from ffkv.tools.explain import explain
from ffkv.tools.llm_backends import ServerBackend
from ffkv.tools.score import score
from support.chat_server import ChatServer
from support.explain_runs import N_LATENTS, PLANTED, PLANTED_LATENT, planted_latent_run
from support.runs import copy_run

EXPLAINED = (PLANTED_LATENT, 0, 1, 2)
UNEXPLAINED = 5
#: A neuron of layer 1 with the same index as each explained latent (t1:j beside 1:j).
NEURONS = [(0, PLANTED), *((0, j) for j in EXPLAINED if j != PLANTED)]
CONTROLS = 16  # every control latent of the run (planted_latent_run's control_keys)
quiet = dict(progress=False, say=lambda line: None)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    run, loaded = planted_latent_run(tmp_path_factory.mktemp("latent_explanations"), control_keys=CONTROLS)
    with ChatServer() as server:
        backend = ServerBackend(server.url, "rule", concurrency=4, timeout=10.0, retries=1, backoff=0.01)
        explain(run, backend, memories=NEURONS, controls=2, loaded=loaded, **quiet)
        explain(run, backend, memories=[LatentRef(0, j, "transcoder") for j in EXPLAINED], controls=CONTROLS,
                loaded=loaded, **quiet)
        score(run, backend, loaded=loaded, **quiet)
    rd = RunDir(run)
    build(rd, rd.manifest(), loaded, rd.cache_dir, np.zeros(loaded.view.n_layers))
    return run, loaded


@pytest.fixture(scope="module")
def client(scored):
    run, loaded = scored
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded),
                    raise_server_exceptions=False) as c:
        yield c


def stored(run, kind: str, key: int) -> list[dict]:
    """The explanations the tables hold of one memory of layer 0 (`kind`: memory, latent, latent_control), each
    with its own and shuffled scores, read straight from the Parquet files."""
    rows = pd.read_parquet(run / "metrics" / "explanations.parquet")
    scores = pd.read_parquet(run / "metrics" / "explanation_scores.parquet")
    out = []
    for r in rows[(rows["kind"] == kind) & (rows["layer"] == 0) & (rows["key"] == key)].itertuples():
        mine = scores[(scores["kind"] == kind) & (scores["layer"] == 0) & (scores["key"] == key)
                      & (scores["direction"] == r.direction) & (scores["explainer"] == r.explainer)]
        by = mine.set_index("baseline")
        out.append({"direction": int(r.direction), "explanation": r.explanation, "explainer": r.explainer,
                    "score": float(by.at["own", "score"]),
                    "shuffled_score": float(by.at["shuffled", "score"]) if "shuffled" in by.index else None,
                    "simulator": by.at["own", "simulator"]})
    return out


def _plain(x: dict) -> tuple:
    return (x["explanation"], x["score"], x["shuffled_score"])


def test_a_latent_page_shows_exactly_its_own_stored_explanation_and_score(client, scored):
    run, _ = scored
    for j in EXPLAINED:
        expected = stored(run, "latent", j)
        assert len(expected) == 1 and expected[0]["shuffled_score"] is not None
        got = client.get(f"/memory/t1:{j}.json").json()["explanations"]
        assert got == expected  # exactly the stored row and scores, nothing else
        # its control latent (same index) and the neuron 1:j are explained too, and are not what the page shows
        control, neuron = stored(run, "latent_control", j), stored(run, "memory", j)
        assert control and neuron
        assert all(_plain(x) != _plain(got[0]) for x in control + neuron)
        html = client.get(f"/memory/t1:{j}").text
        block = html.split('<div id="explanations">')[1].split("</div>")[0]
        x = expected[0]
        assert str(escape(x["explanation"])) in block and "ffkv explain --latents" in block
        assert f'score {x["score"]:.2f} (shuffled {x["shuffled_score"]:.2f}) by {x["simulator"]}' in unescape(block)
        assert block.count("<li>") == 1
        # in the same place as a neuron's: after the surface line, before the value
        assert html.index("<strong>Surface:</strong>") < html.index('id="explanations"') < html.index("<h2>Value</h2>")
    planted = client.get(f"/memory/t1:{PLANTED_LATENT}.json").json()["explanations"][0]
    assert planted["explanation"].startswith("Fires on the character") and planted["score"] > 0.99


def test_an_unexplained_latent_shows_no_explanation(client):
    assert client.get(f"/memory/t1:{UNEXPLAINED}.json").json()["explanations"] == []
    html = client.get(f"/memory/t1:{UNEXPLAINED}").text
    assert 'id="explanations"' not in html and "Fires on the character" not in html


def test_the_neurons_pages_show_their_own_explanations_unchanged(client, scored, tmp_path):
    """A neuron's page and JSON show its own stored rows (not the latent t1:j's), and every neuron page reads the
    same byte for byte as on a copy of the run whose latents were never explained."""
    run, loaded = scored
    for j in EXPLAINED:
        got = client.get(f"/memory/1/{j}.json").json()["explanations"]
        assert got == stored(run, "memory", j)
    data = client.app.state.data
    plain = ExplorerData(_without_latent_explanations(run, tmp_path), loaded)
    for j in (*EXPLAINED, UNEXPLAINED):
        for layer in (1, 2):
            assert memory_page(data, layer, j) == memory_page(plain, layer, j)
            assert memory_json(data, layer, j)["explanations"] == memory_json(plain, layer, j)["explanations"]
    assert layer_page(data, 1, sort="explanation score", order="desc") == \
        layer_page(plain, 1, sort="explanation score", order="desc")


def _without_latent_explanations(run, tmp_path):
    """A copy of `run` as `ffkv explain` and `ffkv score` on its neurons alone would leave it."""
    copy = copy_run(run, tmp_path / "neurons_only" / "run")  # the same name: pages show it
    rd = RunDir(copy)
    for name, step in (("explanations", "explain"), ("explanation_scores", "score")):
        table = rd.read_metric(name)
        rd.write_metric(name, table[~table["kind"].isin(["latent", "latent_control"])], {}, step=step)
    return copy


def test_a_run_whose_latents_were_not_explained_shows_nothing_new(scored, tmp_path):
    run, loaded = scored
    data = ExplorerData(_without_latent_explanations(run, tmp_path), loaded)
    for j in (*EXPLAINED, UNEXPLAINED):
        assert latent_json(data, f"t1:{j}")["explanations"] == []
        assert 'id="explanations"' not in latent_page(data, f"t1:{j}")
    html = latent_layer_page(data, "t1")
    assert ">explanation<" not in html and "explanation score" not in html
    assert data.explanation_search("character")  # the neurons' are still found, and they alone
    assert all(h["address"] is None for h in data.explanation_search("character"))


def _latent_rows(html: str) -> list[list[str]]:
    rows = html.split('<table id="latents">')[1].split("</table>")[0].split("<tr>")[2:]
    return [re.findall(r"<td[^>]*>(.*?)</td>", r, re.S) for r in rows]


def test_the_latent_layer_page_has_the_explanation_columns_sortable(client, scored):
    run, _ = scored
    html = client.get("/layer/t1?sort=explanation+score&order=desc").text
    header = html.split('<table id="latents">')[1].split("</tr>")[0]
    titles = [unescape(t) for t in re.findall(r'<th[^>]*><a [^>]*>([^<▲▼]+?)\s*(?:[▲▼])?</a></th>', header)]
    assert titles[:3] == ["latent", "explanation", "explanation score"]
    rows = _latent_rows(html)
    assert len(rows) == N_LATENTS
    best = {j: stored(run, "latent", j)[0] for j in EXPLAINED}
    order = sorted(EXPLAINED, key=lambda j: (-best[j]["score"], j))
    assert order[0] == PLANTED_LATENT
    for row, j in zip(rows, order):  # the explained latents first, best score first; each its own row's text
        assert f">t1:{j}<" in row[0]
        assert unescape(row[1]) == best[j]["explanation"] and row[2] == f"{best[j]['score']:.3f}"[:len(row[2])]
    assert all(row[1] == "" and row[2] == "" for row in rows[len(EXPLAINED):])  # unexplained: blank, last
    by_text = client.get("/layer/t1?sort=explanation&order=asc")
    assert by_text.status_code == 200
    texts = [unescape(r[1]) for r in _latent_rows(by_text.text)][:len(EXPLAINED)]
    assert texts == sorted(texts)


def test_search_finds_latents_by_their_explanation(client, scored):
    run, _ = scored
    data = client.app.state.data
    hits = data.explanation_search("fires character")
    latents = [h for h in hits if h["address"] is not None]
    assert sorted(h["key"] for h in latents) == sorted(EXPLAINED)  # never a control latent
    assert all(h["address"] == f"t1:{h['key']}" for h in latents)
    for h in latents:
        assert (h["explanation"], h["score"]) == (stored(run, "latent", h["key"])[0]["explanation"],
                                                  stored(run, "latent", h["key"])[0]["score"])
    html = client.get("/search", params={"q": "character"}).text
    table = html.split('<table id="explained">')[1].split("</table>")[0]
    for j in EXPLAINED:
        assert f'<a href="/memory/t1:{j}">t1:{j}</a> <span class="chip">latent</span>' in table
    assert f'<a href="/memory/1/{PLANTED}">1:{PLANTED}</a>' in table


def _rewrite(run, tmp_path, name: str, change) -> RunDir:
    copy = copy_run(run, tmp_path / "hostile")
    rd = RunDir(copy)
    step = "explain" if name == "explanations" else "score"
    rd.write_metric(name, change(rd.read_metric(name)), {"hand-written": True}, step=step)
    return rd


def test_latent_rows_for_latents_the_run_lacks_are_left_out(scored, tmp_path):
    run, loaded = scored

    def add_strangers(table):
        row = table[table["kind"] == "latent"].iloc[[0]]
        strangers = [row.assign(key=N_LATENTS), row.assign(key=-1), row.assign(layer=1), row.assign(layer=9)]
        return pd.concat([table, *(s.assign(explanation="a stranger's explanation") for s in strangers)])

    rd = _rewrite(run, tmp_path, "explanations", add_strangers)
    data = ExplorerData(rd.path, loaded)
    assert data.explanation_search("stranger's") == []
    for j in (*EXPLAINED, UNEXPLAINED, N_LATENTS - 1):
        assert "stranger" not in latent_page(data, f"t1:{j}")
    assert "stranger" not in latent_layer_page(data, "t1") and "stranger" not in layer_page(data, 2)
    assert latent_json(data, f"t1:{PLANTED_LATENT}")["explanations"] == stored(run, "latent", PLANTED_LATENT)


@pytest.mark.parametrize("name, column, spoil, fix", [
    ("explanations", "key", lambda c: c.astype(str), "ffkv explain"),
    ("explanations", "layer", lambda c: c + 0.5, "ffkv explain"),
    ("explanations", "explanation", lambda c: c.str.len(), "ffkv explain"),
    ("explanation_scores", "score", lambda c: c.astype(str), "ffkv score"),
    ("explanation_scores", "key", lambda c: c.where(c > 0), "ffkv score"),  # one missing: read back as floats
])
def test_an_explanations_table_of_wrong_types_is_named_as_damaged(scored, tmp_path, name, column, spoil, fix):
    """As a table lacking a column is (tests/tools/test_explanation_surfaces.py): named with the command that writes
    it again, never a TypeError deep inside a page."""
    run, loaded = scored
    rd = _rewrite(run, tmp_path, name, lambda table: table.assign(**{column: spoil(table[column])}))
    with pytest.raises(DamagedRun, match=rf"{name}\.parquet is damaged \(its column '{column}'.*{fix}"):
        ExplorerData(rd.path, loaded)
