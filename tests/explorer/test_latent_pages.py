"""The explorer's latent pages on what the real pipeline writes: ffkv-tiny indexed with its shipped transcoder
(layer 4, 512 latents), the lookups built, pages requested through the app. A latent page's per-token activations
equal the dictionary's encoding of the FF input captured at each token; its value tokens equal the decoder row's
projection; the latent layer page sorts by every column; search finds latents; a run without a dictionary gets no
latent files; a damaged latent file is named."""

from __future__ import annotations

import contextlib
import re
import shutil
from html import unescape

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from starlette.testclient import TestClient

from ffkv.corpus import CorpusSpec
from ffkv.dictionaries import open_dictionary
from ffkv.errors import DamagedRun
from ffkv.experiments import trigger_contexts
from ffkv.experiments.lookups import build
from ffkv.explorer import create_app
from ffkv.explorer.latents import read_table
from ffkv.explorer.pages import LATENT_COLUMNS, PAGE_SIZE
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import load_model
from ffkv.models.default_corpus import default_corpus_path
from ffkv.models.tiny_lm import tiny_transcoders_path
from ffkv.store import lookups, schemas
from ffkv.store.run import RunDir
from support.runs import storing_coefficients

LAYER = 3  # the shipped transcoder's FF layer, from 0 (t4 as addresses write it)


def _run(folder, loaded, dictionary: bool, stored: bool = True):
    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=40, shuffle_seed=0)
    build_index(loaded, spec, folder, IndexOptions(top_k=4, control_keys=0), progress=False,
                dictionary=tiny_transcoders_path() if dictionary else None)
    run = RunDir(folder)
    with storing_coefficients() if stored else contextlib.nullcontext():
        build(run, run.manifest(), loaded, run.cache_dir, np.zeros(loaded.view.n_layers))
    return folder


@pytest.fixture(scope="module")
def tiny():
    return load_model("ffkv-tiny")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny):
    return _run(tmp_path_factory.mktemp("latent_pages") / "run", tiny, dictionary=True)


@pytest.fixture(scope="module")
def client(run, tiny):
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=tiny),
                    raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, tiny):
    """The same run with the lookups' own rule: ffkv-tiny's pages cost little, so no activation is stored."""
    return _run(tmp_path_factory.mktemp("latent_pages_live") / "run", tiny, dictionary=True, stored=False)


@pytest.fixture(scope="module")
def transcoder():
    return open_dictionary(tiny_transcoders_path())[LAYER]


def _latent_triggers(run) -> pd.DataFrame:
    return pd.read_parquet(run / "latent_trigger_examples.parquet")


def _examples(run) -> pd.Series:
    return pq.read_table(run / "examples.parquet").to_pandas().set_index("example_id")["token_ids"]


@torch.no_grad()
def _activations(loaded, transcoder, token_ids: list[int]) -> np.ndarray:
    """Brute force: the FF input of layer 4 captured over one whole example, encoded by the transcoder."""
    view = loaded.view
    ids = torch.tensor([token_ids])
    with view.capture(("ff_in",), layers=[LAYER]) as captured:
        view.forward(ids, torch.ones_like(ids))
    return transcoder.encode(captured["ff_in"][LAYER][0].float()).numpy()  # (tokens, latents)


def test_latent_page_shades_each_token_by_the_latents_activation(client, run, tiny, transcoder):
    # stored as float16 (three significant digits); the trigger position's is the index's own
    _check_shading(client, run, tiny, transcoder, tolerance=2e-3)


def test_a_latent_page_computes_its_activations_where_none_are_stored(live_run, tiny, transcoder):
    """ffkv-tiny's latent pages cost a forward pass of a few G multiply-adds: the build stores no activations and
    says why, and the page computes them (float32) from the model and the dictionary."""
    info = lookups.read_info(RunDir(live_run).cache_dir)["latent_trigger_coefficients"]
    assert info["file"] is None and 0 < info["page_macs"] <= trigger_contexts.LIVE_MACS
    assert "computed at its first view" in info["reason"]
    assert not (RunDir(live_run).cache_dir / lookups.LATENT_COEFFICIENTS).exists()
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(live_run, loaded=tiny),
                    raise_server_exceptions=False) as c:
        _check_shading(c, live_run, tiny, transcoder, tolerance=1e-4)


def _check_shading(client, run, tiny, transcoder, tolerance: float) -> None:
    trig, examples = _latent_triggers(run), _examples(run)
    counts = trig.groupby("key").size()
    keys = [int(k) for k in counts[counts >= 3].index[:3]]
    assert keys
    for key in keys:
        r = client.get(f"/memory/t4:{key}.json")
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["address"] == f"t4:{key}" and page["layer"] == LAYER and page["latent"] == key
        mine = trig[trig["key"] == key].sort_values("rank")
        assert [e["example_id"] for e in page["trigger_examples"]] == mine["example_id"].tolist()
        for e, row in zip(page["trigger_examples"], mine.itertuples()):
            token_ids = [int(t) for t in examples[row.example_id]]
            a = _activations(tiny, transcoder, token_ids)[:, key]
            shown = np.array(e["coefficients"], dtype=np.float64)
            first = e["first_position"]
            expected = a[first:first + len(shown)]
            np.testing.assert_allclose(shown, expected, rtol=tolerance, atol=tolerance)
            assert e["coefficient"] == pytest.approx(float(row.coefficient))
            assert float(row.coefficient) == pytest.approx(float(a[row.position]), rel=1e-4, abs=1e-5)
            assert (shown >= 0).all() and shown[row.position - first] == pytest.approx(float(row.coefficient))
        html = client.get(f"/memory/t4:{key}").text
        assert f"Latent t4:{key}" in html and 'id="triggers"' in html
        assert 'id="not-stored"' not in html  # shaded, stored or computed: no note that nothing is
        assert 'href="/layer/4" id="neurons-link"' in html and 'href="/layer/t4"' in html
        # the shading: every shown example's tokens carry their activation as a title
        titles = [float(x) for x in re.findall(r'title="m = ([-0-9.e+]+)"', html)]
        assert titles and max(titles) == pytest.approx(max(float(c) for e in page["trigger_examples"]
                                                            for c in e["coefficients"] if c is not None), rel=1e-2)


def test_a_latent_page_of_an_index_too_large_for_every_row_shades_its_strongest_examples(tmp_path, tiny, transcoder,
                                                                                         monkeypatch):
    """Where the latents' rank-0 rows alone fit `MAX_ROWS` (an 8B model's index: none of the neurons' would, here),
    the build stores each latent's strongest example's activations: they equal the dictionary's encoding at every
    token; the other examples show the trigger position's activation alone, and the page says so."""
    folder = _run(tmp_path / "run", tiny, dictionary=True, stored=False)
    trig, examples = _latent_triggers(folder), _examples(folder)
    monkeypatch.setattr(trigger_contexts, "MAX_ROWS", int((trig["rank"] == 0).sum()))
    run = RunDir(folder)
    with storing_coefficients():
        build(run, run.manifest(), tiny, run.cache_dir, np.zeros(tiny.view.n_layers))
    info = lookups.read_info(run.cache_dir)
    assert info["trigger_coefficients"]["file"] is None  # the neurons' rank 0: more rows than MAX_ROWS
    assert info["latent_trigger_coefficients"]["ranks"] == 1
    counts = trig.groupby("key").size()
    keys = [int(k) for k in counts[counts >= 3].index[:3]]
    assert keys
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(folder, loaded=tiny),
                    raise_server_exceptions=False) as c:
        for key in keys:
            page = c.get(f"/memory/t4:{key}.json").json()
            assert page["stored_ranks"] == 1
            for e in page["trigger_examples"]:
                shown, at = e["coefficients"], e["position"] - e["first_position"]
                assert shown[at] == pytest.approx(e["coefficient"])
                if e["rank"] == 0:
                    a = _activations(tiny, transcoder, [int(t) for t in examples[e["example_id"]]])[:, key]
                    np.testing.assert_allclose(np.array(shown, dtype=np.float64),
                                               a[e["first_position"]:e["first_position"] + len(shown)],
                                               rtol=2e-3, atol=2e-3)
                else:
                    assert all(m is None for j, m in enumerate(shown) if j != at)
            assert "they are stored for its strongest example;" in c.get(f"/memory/t4:{key}").text


@pytest.mark.parametrize("projection, shown", [("identity", "p"), ("identity", "logit"), ("final-norm", "p")])
def test_latent_value_tokens_are_the_decoder_rows_projection(client, tiny, transcoder, projection, shown):
    key = 7
    page = client.get(f"/memory/t4:{key}.json?projection={projection}&shown={shown}").json()
    view = tiny.view
    d = transcoder.decoder[key].float()
    with torch.no_grad():
        h = d if projection == "identity" else view.final_norm(d)
        z = h @ view.unembedding.float().T
    values = z.softmax(-1) if shown == "p" else z
    top = torch.topk(z, len(page["value"]["top"])).indices.tolist()
    bottom = torch.topk(-z, len(page["value"]["bottom"])).indices.tolist()
    assert [t["token_id"] for t in page["value"]["top"]] == top
    assert [t["token_id"] for t in page["value"]["bottom"]] == bottom
    # the page normalizes d in the dictionary's own dtype (`Latents` keeps it): final-norm agrees to 1e-3
    np.testing.assert_allclose([t[shown] for t in page["value"]["top"]], values[top].numpy(),
                               rtol=1e-4 if projection == "identity" else 1e-3)
    # the stored top tokens (the layer page's column, the token search) are the identity projection's
    if (projection, shown) == ("identity", "p"):
        stored = pd.read_parquet(client.app.state.data.folder / "latent_value_top_tokens.parquet")
        stored = stored[(stored["layer"] == LAYER) & (stored["key"] == key)].sort_values("rank")
        assert stored["token_id"].tolist() == top[:len(stored)]


def test_latent_statistics_recount_from_the_index(client, run):
    data = client.app.state.data
    table = data.latents.layer_table(LAYER).set_index("key")
    trig = _latent_triggers(run)
    counts = trig.groupby("key").size().reindex(range(512), fill_value=0)
    assert (table["n_triggers"] == counts).all()
    fired = counts[counts > 0].index
    top = trig.groupby("key")["coefficient"].max()
    np.testing.assert_allclose(table.loc[fired, "top_coefficient"], top.loc[fired], rtol=1e-6)
    assert table.loc[counts[counts == 0].index, "dead"].all()
    assert len(table) == 512 and 0 <= table["activation_frequency"].min() and table["activation_frequency"].max() <= 1


def _latents_in_order(html: str) -> list[int]:
    return [int(k) for k in re.findall(r'<a href="/memory/t4:(\d+)">t4:\d+</a>', html)]


#: Columns the latent layer page has once `ffkv explain --latents` ran (tests/explorer/test_latent_explanations.py).
AFTER_EXPLAIN = ("explanation", "explanation_score")


@pytest.mark.parametrize("column, sort", [(c, s) for c, _, s in LATENT_COLUMNS if c not in AFTER_EXPLAIN])
@pytest.mark.parametrize("order", ["asc", "desc"])
def test_latent_layer_page_sorts_by_each_column(client, column, sort, order):
    table = client.app.state.data.latents.layer_table(LAYER)
    by = "top_token" if column == "top_tokens" else column
    expected = table.sort_values([by, "key"], ascending=[order == "asc", True], na_position="last",
                                 kind="stable")["key"].tolist()
    r = client.get(f"/layer/t4?sort={sort}&order={order}")
    assert r.status_code == 200, r.text
    assert _latents_in_order(r.text) == expected[:PAGE_SIZE]
    last = client.get(f"/layer/t4?sort={sort}&order={order}&page={len(table) // PAGE_SIZE + 1}")
    assert _latents_in_order(last.text) == expected[(len(table) // PAGE_SIZE) * PAGE_SIZE:]


def test_latent_layer_page_shows_what_the_tables_hold(client, run):
    html = client.get("/layer/t4?sort=largest+a&order=desc").text
    headers = [unescape(h) for h in re.findall(r'<th[^>]*><a [^>]*>([^<▲▼]+?)\s*(?:[▲▼])?</a></th>', html)]
    assert headers == [title for c, title, _ in LATENT_COLUMNS if c not in AFTER_EXPLAIN]  # no explanations here
    strongest = int(_latent_triggers(run).sort_values(["coefficient", "key"], ascending=[False, True])["key"].iloc[0])
    assert _latents_in_order(html)[0] == strongest
    assert client.get("/layer/t4?sort=nothing").status_code == 422
    assert "ffkv explain RUN --latents" in client.get("/layer/t4?sort=explanation").text
    assert client.get("/layer/t5").status_code == 404 and "it has t4" in client.get("/layer/t5").text
    assert client.get("/layer/t4?page=99").status_code == 404


def test_latent_layer_page_jumps_to_any_page(client):
    """A layer of many latents (24,576 at 16x) is hundreds of pages: first and last links, and a page number to go
    to, which the form sends with the sort kept; the last page holds the last latents of that order."""
    n_pages = -(-512 // PAGE_SIZE)
    first = client.get("/layer/t4?sort=latent&order=asc").text
    assert 'id="first-page"' not in first and f'page={n_pages}" id="last-page"' in first
    assert re.search(rf'<input type="number" name="page" min="1" max="{n_pages}" value="1"', first)
    assert '<input type="hidden" name="sort" value="latent">' in first
    last = client.get("/layer/t4", params={"sort": "latent", "order": "asc", "page": str(n_pages)}).text
    assert _latents_in_order(last) == list(range((n_pages - 1) * PAGE_SIZE, 512))
    assert 'id="first-page"' in last and 'id="last-page"' not in last


def test_search_finds_latents_labelled_as_such(client, run):
    data = client.app.state.data
    key = 11
    token_id = int(data.latents.top_ids[LAYER][key, 0])
    html = client.get(f"/search?token=%23{token_id}").text
    assert 'id="latents-promoting"' in html and f'href="/memory/t4:{key}"' in html
    assert re.search(rf'<a href="/memory/t4:{key}">t4:{key}</a> <span class="chip">latent</span>', html)
    # text search: the latents an example triggers, beside the neurons, marked as latents
    trig = _latent_triggers(run)
    example = int(trig[trig["key"] == key].sort_values("rank")["example_id"].iloc[0])
    text = pq.read_table(run / "examples.parquet").to_pandas().set_index("example_id").at[example, "text"]
    html = client.get("/search", params={"q": text[:30]}).text
    assert re.search(rf'<a class="chip latent" href="/memory/t4:{key}"', html) or \
        "more latents" in html  # past the first chips, in the "more" list
    assert f'href="/memory/t4:{key}"' in html
    # an address is a memory
    named = client.get("/search", params={"q": f"t4:{key}"}).text
    assert f'<a href="/memory/t4:{key}">t4:{key}</a>' in named and "latent (transcoder)" in named


def test_the_trace_shows_each_layers_top_latents(client, tiny, transcoder):
    from ffkv.explorer.notebook import run_trace

    data = client.app.state.data
    prompt = "The cat sat on the mat and"
    t = run_trace(data, prompt)
    ids = list(tiny.tokenizer.encode(prompt))
    a = _activations(tiny, transcoder, ids)[t.base.position]
    target = tiny.view.unembedding[t.base.target].float()
    contribution = a * (transcoder.decoder.float() @ target).numpy()
    shown = t.base.layers[LAYER].latents
    expected = [int(k) for k in np.argsort(-contribution, kind="stable")[:5] if a[k] > 0]
    assert [x["key"] for x in shown] == expected and len(shown) > 0
    np.testing.assert_allclose([x["coefficient"] for x in shown], a[expected], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([x["contribution"] for x in shown], contribution[expected], rtol=1e-3, atol=1e-6)
    assert all(not layer.latents for layer in t.base.layers if layer.layer != LAYER)
    html = client.get("/trace", params={"prompt": prompt}).text
    assert all(f'href="/memory/t4:{k}">t4:{k}</a>' in html for k in expected)


@torch.no_grad()
def test_a_latent_edited_in_the_trace_changes_the_output_by_its_decoder_row_exactly(client, tiny, transcoder):
    """Switching a latent off in the trace gives the model with a_j·d_j taken from the layer's output (brute force:
    the dictionary's own encoding of the captured FF input, subtracted in a hook of our own); an edit of nothing
    gives the model's own predictions bit for bit; the page marks the edit and the latent's a as edited."""
    from ffkv.explorer.notebook import run_trace
    from ffkv.explorer.tracing import trace
    from ffkv.memories.interventions import Intervention

    data = client.app.state.data
    prompt = "The cat sat on the mat and"
    ids = list(tiny.tokenizer.encode(prompt))
    base = run_trace(data, prompt).base
    key = base.layers[LAYER].latents[0]["key"]
    edit = Intervention(LAYER, key, "off", kind="transcoder")
    t = run_trace(data, prompt, edits=[edit])
    assert t.edited.latent_edits == {(LAYER, key): edit} and not t.edited.edits

    a = torch.as_tensor(_activations(tiny, transcoder, ids))[:, key]  # (tokens,)
    removed = a[:, None] * transcoder.decoder[key].float()
    hook = tiny.view.arch.down_proj(tiny.view.blocks[LAYER]).register_forward_hook(
        lambda module, args, out: out - removed.to(out.dtype)[None])
    try:
        logits = tiny.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    finally:
        hook.remove()
    p = logits.softmax(-1)
    expected = p.topk(5)
    assert [x.token_id for x in t.edited.final] == expected.indices.tolist()
    np.testing.assert_allclose([x.prob for x in t.edited.final], expected.values.numpy(), rtol=1e-4, atol=1e-6)
    assert [x.token_id for x in t.edited.final] != [x.token_id for x in base.final] or \
        not np.allclose([x.prob for x in t.edited.final], [x.prob for x in base.final])
    shown = {x["key"]: x for x in t.edited.layers[LAYER].latents}
    assert shown[key]["coefficient"] == 0.0 and shown[key]["edit"] == edit
    assert {x["key"] for x in t.base.layers[LAYER].latents} >= {key}  # the base lists the latent it edits

    latents = data.latents.memories()
    nothing = trace(tiny, ids, [Intervention(LAYER, key, "scale", 1.0, kind="transcoder")], latents=latents)
    own = trace(tiny, ids, latents=latents)
    assert [(x.token_id, x.prob) for x in nothing.final] == [(x.token_id, x.prob) for x in own.final]
    assert all(n.ff == o.ff and n.after == o.after for n, o in zip(nothing.layers, own.layers))

    html = client.get("/trace", params={"prompt": prompt, "off": f"t4:{key}"})
    assert html.status_code == 200
    assert f'name="off" value="t4:{key}" checked' in html.text and "with the interventions" in html.text
    form = client.post("/trace", data={"prompt": prompt, "action": "intervene", f"scale:t4:{key}": "3"})
    assert form.status_code == 200 and f'name="scale:t4:{key}" value="3.0"' in form.text
    for bad, message in (("t4:512", "latents 0..511"), ("t3:0", "layer 3 has no dictionary"), ("s4:0", "not a sae")):
        refused = client.get("/trace", params={"prompt": prompt, "off": bad})
        assert refused.status_code == 422 and message in unescape(refused.text), bad


def test_overview_and_neuron_layer_link_the_latents(client):
    html = client.get("/").text
    assert 'id="dictionaries"' in html and '<a href="/layer/t4">t4</a>' in html
    assert 'id="latents-link"' in client.get("/layer/4").text
    assert 'id="latents-link"' not in client.get("/layer/3").text


def test_a_run_without_a_dictionary_has_no_latent_tables(tmp_path, tiny):
    run = _run(tmp_path / "run", tiny, dictionary=False)
    folder = RunDir(run).cache_dir
    assert not any((folder / name).exists() for name in (*lookups.LATENT_FILES, lookups.LATENT_COEFFICIENTS))
    info = lookups.read_info(folder)
    assert "latent_trigger_coefficients" not in info and set(info["fingerprint"]["files"]) == {"trigger_examples",
                                                                                             "examples"}
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=tiny)) as c:
        for url in ("/layer/t4", "/memory/t4:1", "/memory/t4:1.json"):
            r = c.get(url)
            assert r.status_code == 404 and "without a sparse dictionary" in r.text
        assert 'id="dictionaries"' not in c.get("/").text


def test_a_damaged_latent_file_is_named(run, tiny, tmp_path):
    copy = shutil.copytree(run, tmp_path / "run")
    folder = RunDir(copy).cache_dir
    # bytes changed in place (same size): the SHA-256 info.json records names the file
    path = folder / lookups.LATENT_COEFFICIENTS
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DamagedRun, match=re.escape(str(path))):
        create_app(copy, loaded=tiny)
    # a table without a column the pages read
    stats = folder / "latent_stats.parquet"
    pq.write_table(pq.read_table(stats).drop(["n_triggers"]), tmp_path / "stats.parquet")
    with pytest.raises(DamagedRun, match=r"stats\.parquet is damaged \(it lacks the column\(s\) n_triggers"):
        read_table(tmp_path, "stats.parquet", schemas.LATENT_STATS, {}, "rebuild it")
    pq.write_table(pa.table({"x": [1]}), stats)  # another size than recorded: stale, rebuilt on start
    assert not lookups.is_current(RunDir(copy), RunDir(copy).manifest(), folder)


def test_the_latents_activations_ride_on_the_neurons_pass_and_equal_their_own(run, tiny, monkeypatch):
    """The stored latent activations come from the neurons' pass over their trigger examples (the passenger),
    plus passes of their own for examples that pass does not read; the same values as passes of their own only, to
    one unit in the last place of the dictionary's float16 (the two passes batch the examples differently, so the
    model's float32 input to the encoder differs in its last bits, and a value near a float16 rounding boundary
    lands on either side: 1 of 74,844 on one machine here, none on another)."""
    from ffkv.experiments import latent_lookups, trigger_contexts

    from ffkv.memories.sets import Latents

    rd = RunDir(run)
    folder = rd.cache_dir
    latents = Latents.of_run(tiny.view, rd.manifest().index["dictionary"])
    assert latent_lookups.plan_activations(latents, tiny, folder) is None  # ffkv-tiny's pages compute them
    monkeypatch.setattr(trigger_contexts, "LIVE_MACS", 0.0)  # as for a model of a real size
    riders = latent_lookups.plan_activations(latents, tiny, folder)
    rows = trigger_contexts.plan(folder / "explorer.duckdb")
    texts = trigger_contexts.texts_of(folder / "explorer.duckdb")
    kept = np.unique(rows["example_id"])[::2]  # the neurons' pass reads half the examples: finish runs the rest
    half = {name: column[np.isin(rows["example_id"], kept)] for name, column in rows.items()}
    half["m_offset"] = np.concatenate([[0], np.cumsum(half["m_length"])[:-1]])  # the neurons' own flat, re-packed
    trigger_contexts.compute(tiny, half, texts, passenger=riders)
    assert 0 < len(riders.done) < len(riders.needed)
    alone = latent_lookups.trigger_coefficients(tiny, riders.latents, riders.rows, texts)
    np.testing.assert_allclose(riders.finish(tiny), alone, rtol=2**-10, atol=1e-6)
    assert riders.done >= set(riders.needed) and np.abs(alone).max() > 0


@pytest.mark.parametrize("url, status", [
    ("/memory/t\uff14:1", 404), ("/memory/t4:\uff11", 404), ("/memory/t4:1_0", 404), ("/memory/t4:1_0.json", 404),
    ("/memory/t4:+1", 404), ("/memory/t4:" + "1" * 60_000, 404), ("/memory/t4:" + "1" * 60_000 + ".json", 404),
    ("/memory/t" + "4" * 60_000 + ":1", 404), ("/layer/t\uff14", 404), ("/layer/t4_0", 404),
    ("/trace?prompt=And+God&off=t4:1_0", 422), ("/trace?prompt=And+God&scale=t\uff14:1=2", 422),
])
def test_a_latents_address_is_read_in_ascii_digits_only_and_quoted_short(client, url, status):
    """/memory/t４:1 (a fullwidth digit) and /memory/t4:1_0 showed latents 1 and 10, and a 100,000-digit latent
    id came back whole (108 kB) in the error: every number of an address is ASCII digits, a few of them, and a
    refusal quotes a short prefix of it."""
    r = client.get(url)
    assert r.status_code == status, r.text[-400:]
    assert len(r.content) < 20_000 and "1" * 50 not in r.text and "4" * 50 not in r.text
    if url.split("?")[0].endswith(".json"):
        assert r.json()["status"] == status and r.json()["error"]
    else:
        assert 'id="error-message"' in r.text and "Traceback" not in r.text


def test_an_edit_of_a_latent_past_the_bound_is_the_same_422_as_everywhere(client):
    """The explorer's bound is the one of every edit (`Intervention`): its 422 says what the command line says."""
    for url, says in (("/trace?prompt=And+God&scale=t4:1=1e308", "scale t4:1=1e+308: the factor must be finite and "
                                                                  "within ±10000"),
                      ("/trace?prompt=And+God&set=t4:1=1e30", "set t4:1=1e+30: the value must be finite and within")):
        r = client.get(url)
        assert r.status_code == 422 and says in unescape(r.text), r.text[-400:]


def test_a_latent_page_shows_its_pattern_label_and_census_line(tmp_path, tiny):
    """As a neuron's page shows its key's: the latent studies' own rows (patterns_latents_keys, census_latents_keys),
    read from what `ffkv analyze` wrote; before they ran, the page says what writes them."""
    from ffkv.experiments import analyze

    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=60, shuffle_seed=0)
    build_index(tiny, spec, tmp_path / "run", IndexOptions(top_k=4, control_keys=8), progress=False,
                dictionary=tiny_transcoders_path())
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(tmp_path / "run", loaded=tiny)) as c:
        assert 'id="no-auto-label"' in c.get("/memory/t4:3").text and 'id="census-badge"' not in c.get("/memory/t4:3").text
    analyze(tmp_path / "run", only=["patterns", "census"], n_eval=20, progress=False, loaded=tiny)
    labels = pd.read_parquet(tmp_path / "run" / "metrics" / "patterns_latents_keys.parquet").set_index(["layer", "key"])
    census = pd.read_parquet(tmp_path / "run" / "metrics" / "census_latents_keys.parquet").set_index(["layer", "key"])
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(tmp_path / "run", loaded=tiny)) as c:
        for latent in (0, 3, 100):
            html = unescape(c.get(f"/memory/t4:{latent}").text)
            label = re.search(r'<span class="label-(\w+)" id="auto-label">(\w+)</span>', html)
            assert label and label.group(2) == labels.loc[(3, latent), "label"], latent
            badge = re.search(r'id="census-badge"><strong>Census:</strong> <span class="chip label-\w+">(\w+)</span>', html)
            assert badge and badge.group(1) == census.loc[(3, latent), "class"], latent


def test_a_latent_is_annotated_as_a_neuron_is_in_its_own_labels_table(run, tiny, tmp_path):
    """A latent's page had no annotate form (its pattern label and census line were there). Its labels go to
    annotations/latent_labels.parquet, with the neurons' schema; the neurons' labels stay as they were; a latent
    outside its dictionary, or a table holding one, is refused."""
    from ffkv.store.annotations import read_labels
    from ffkv.store.state import run_state

    own = shutil.copytree(run, tmp_path / "run")
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(own, loaded=tiny),
                    raise_server_exceptions=False) as c:
        page = c.get(f"/memory/t{LAYER + 1}:7").text
        assert f'action="/memory/t{LAYER + 1}:7/annotate"' in page and 'name="label" value="semantic"' in page
        r = c.post(f"/memory/t{LAYER + 1}:7/annotate", data={"label": "shallow", "description": "ends <b>",
                                                             "annotator": "ada"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == f"/memory/t{LAYER + 1}:7#pattern"
        page = c.get(f"/memory/t{LAYER + 1}:7").text
        assert "Human (ada," in page and 'class="label-shallow">shallow' in page and "ends &lt;b&gt;" in page
        assert "Human (ada," not in c.get(f"/memory/{LAYER + 1}/7").text   # the neuron 4:7 is another memory
        assert c.post(f"/memory/t{LAYER + 1}:512/annotate", data={"label": "none"}).status_code == 404
        assert c.post(f"/memory/t{LAYER + 1}:7/annotate", data={"label": "deep"}).status_code == 422
        assert c.post(f"/memory/t{LAYER}:7/annotate", data={"label": "none"}).status_code == 404  # no dictionary
    latent = read_labels(own, "latents")
    assert latent[["layer", "key", "label", "annotator"]].values.tolist() == [[LAYER, 7, "shallow", "ada"]]
    assert read_labels(own).empty and not RunDir(own).annotations_path.exists()
    # a latent labels table holding a latent the dictionary does not have is damaged, as the neurons' would be
    bad = latent.copy()
    bad.loc[0, "key"] = 600
    pq.write_table(pa.Table.from_pandas(bad, schema=schemas.LABELS, preserve_index=False),
                   RunDir(own).labels_path("latents"))
    with pytest.raises(DamagedRun, match=r"latent_labels.parquet is damaged .*row 1: key 600 \(that layer's latents "
                                         r"are 0 to 511\)"):
        read_labels(own, "latents")
    assert any("latent_labels.parquet is damaged" in line for line in run_state(own).lines())
