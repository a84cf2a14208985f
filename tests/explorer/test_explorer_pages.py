"""What the explorer's pages show, on the analysed run the real pipeline wrote: the layer page's curated,
sortable, paginated table; the memory page's JSON export; the search page's highlight and chip order; the
intervention view's threshold; one numbering of layers."""

from __future__ import annotations

import re
from html import unescape

import numpy as np
import pandas as pd
import pytest
import torch
from starlette.testclient import TestClient

from ffkv.experiments.registry import key_columns
from ffkv.explorer import create_app
from ffkv.explorer.pages import CHANGE_THRESHOLD, LAYER_COLUMNS, PAGE_SIZE, highlight, trace_view
from ffkv.memories import Intervention
from ffkv.store.run import RunDir


@pytest.fixture(scope="module")
def client(analyzed):
    run, loaded = analyzed
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded), raise_server_exceptions=False) as c:
        yield c


#: Columns a run has once `ffkv explain` ran (tests/tools/test_explanation_surfaces.py sorts and filters by them).
AFTER_EXPLAIN = ("explanation", "explanation_score")

def keys_in_order(html: str, layer_number: int) -> list[int]:
    return [int(k) for k in re.findall(rf'<a href="/memory/{layer_number}/(\d+)">', html)]


def test_layer_page_has_the_curated_columns_only(client, analyzed):
    html = client.get("/layer/2").text
    headers = re.findall(r"<th[^>]*>(?:<a [^>]*>)?([^<▲▼]+?)\s*(?:[▲▼])?(?:</a>)?</th>", html)
    # The curated columns, with those the run's experiments declare (`KeyColumn`: the vocabulary class) before the
    # human label; one empty for this model (the GLU class of a model without a gate) is left out.
    run = RunDir(analyzed[0])
    declared = [c.header for c in key_columns()
                if run.has_metric(c.table) and run.read_metric(c.table)[c.column].notna().any()]
    curated = [title for c, title, _ in LAYER_COLUMNS if c not in AFTER_EXPLAIN]
    assert declared and [unescape(h) for h in headers] == curated[:-1] + declared + curated[-1:]
    for noise in ("example_id", "removed_index", "ablations_prefixes", "logsumexp", "rank</th>"):
        assert noise not in html


@pytest.mark.parametrize("sort, column", [(s, c) for c, _, s in LAYER_COLUMNS
                                          if c not in ("top_tokens", "human_label", *AFTER_EXPLAIN)])
@pytest.mark.parametrize("order", ["asc", "desc"])
def test_layer_page_sorts_by_each_column(client, analyzed, sort, column, order):
    data = client.app.state.data
    table = data.layer_keys(1)
    expected = table.sort_values([column, "key"], ascending=[order == "asc", True], na_position="last",
                                 kind="stable")["key"].tolist()
    r = client.get(f"/layer/2?sort={sort}&order={order}")
    assert r.status_code == 200
    assert keys_in_order(r.text, 2) == expected[:PAGE_SIZE]


def test_sort_by_pattern_is_the_automatic_label_and_human_labels_are_their_own_column(fresh_run):
    run, loaded = fresh_run
    auto = RunDir(run).read_metric("patterns_keys").query("layer == 0").set_index("key")["label"]
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as c:
        key = int(auto[auto != "none"].index[0])
        c.post(f"/memory/1/{key}/annotate", data={"label": "none", "annotator": "ann"})
        html = c.get("/layer/1?sort=pattern&order=asc").text
        keys = keys_in_order(html, 1)
        assert [auto[k] for k in keys] == sorted(auto[k] for k in keys)  # by the automatic label, not the human
        human = c.get("/layer/1?sort=human+label&order=asc").text
        assert keys_in_order(human, 1)[0] == key  # the one human label sorts first
        assert '<span class="label-none">none</span>' in human


def test_layer_page_is_paginated(tmp_path):
    from ffkv.explorer import pages

    assert PAGE_SIZE == 100
    # The tiny run has 40 keys per layer: one page, and page 2 is a clear 404.
    from support.runs import index_run

    run, loaded = index_run(tmp_path)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded), raise_server_exceptions=False) as c:
        html = c.get("/layer/1").text
        assert "page 1 of 1" in html and 'id="next-page"' not in html
        assert c.get("/layer/1?page=2").status_code == 404
    old = pages.PAGE_SIZE
    try:
        pages.PAGE_SIZE = 15
        with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as c:
            seen = []
            for page in (1, 2, 3):
                html = c.get(f"/layer/1?sort=key&order=asc&page={page}").text
                assert f"page {page} of 3" in html
                seen += keys_in_order(html, 1)
            assert seen == list(range(40))
            middle = c.get("/layer/1?page=2").text
            assert 'id="next-page"' in middle and 'page=3" id="last-page"' in middle and 'page=1" id="first-page"' in middle
    finally:
        pages.PAGE_SIZE = old


def test_memory_json_is_the_page_as_data(client, analyzed):
    run, loaded = analyzed
    exported = client.get("/memory/3/9.json?projection=final-norm").json()
    te = pd.read_parquet(RunDir(run).table("trigger_examples")).query("layer == 2 and key == 9") \
        .sort_values(["direction", "rank"], ascending=[False, True])  # both directions, the positive first
    assert set(te["direction"]) == {1, -1} and [e["direction"] for e in exported["trigger_examples"]] == \
        te["direction"].tolist()
    assert exported["layer"] == 2 and exported["layer_number"] == 3 and exported["url"] == "/memory/3/9"
    assert [e["example_id"] for e in exported["trigger_examples"]] == te["example_id"].tolist()
    assert [e["coefficient"] for e in exported["trigger_examples"]] == pytest.approx(te["coefficient"].tolist())
    for e in exported["trigger_examples"]:
        assert e["coefficients"][e["position"]] == pytest.approx(e["coefficient"], rel=1e-4, abs=1e-5)
    auto = RunDir(run).read_metric("patterns_keys").query("layer == 2 and key == 9").iloc[0]
    assert exported["pattern"]["label"] == auto["label"]
    view = loaded.view
    p = view.final_norm(view.values(2)[9]) @ view.unembedding.T
    assert [t["token_id"] for t in exported["value"]["top"]] == p.topk(15).indices.tolist()
    assert sum(exported["activation_histogram"]["counts"]) == exported["activation_histogram"]["positions"] > 0


def test_search_highlights_the_match_and_ranks_the_chips(client):
    html = client.get("/search?q=Born").text
    assert html.count('<mark class="hit">born</mark>') >= 1
    for row in re.findall(r"<tr><td class=\"example\">.*?</tr>", html, flags=re.S):
        strengths = [abs(float(m)) for m in re.findall(r"m=(-?[\d.]+)", row)]
        assert strengths == sorted(strengths, reverse=True)
        shown = row.split("<details>")[0]
        assert len(re.findall('class="chip"', shown)) <= 5
    assert highlight("a Cat and a cat", "cat") == [("a ", False), ("Cat", True), (" and a ", False), ("cat", True)]


def test_intervention_view_highlights_only_changes_above_the_threshold(client, analyzed):
    from ffkv.explorer.tracing import trace

    _, loaded = analyzed
    data = client.app.state.data
    ids = loaded.tokenizer.encode("she was born in")
    base = trace(loaded, ids)
    edited = trace(loaded, ids, [Intervention(2, base.layers[2].memories[0]["key"], "scale", 40.0)], target=base.target)
    view = trace_view(data, base, edited)
    cells = [(getattr(b, part), getattr(e, part), row[part])
             for b, e, row in zip(base.layers, edited.layers, view["rows"]) for part in ("before", "ff", "after")]
    cells += [(b, e, row) for b, e, row in zip(base.final, edited.final, view["final"])]
    assert any(row["changed"] for _, _, row in cells) and not all(row["changed"] for _, _, row in cells)
    for old, new, row in cells:
        assert row["changed"] == (old.token_id != new.token_id or abs(new.prob - old.prob) >= CHANGE_THRESHOLD)
    html = client.get("/trace?prompt=she+was+born+in&scale=3:%d=40" % base.layers[2].memories[0]["key"]).text
    assert "moved by at least 1 percentage points" in html and 'id="prediction"' in html
    assert np.isclose(CHANGE_THRESHOLD, 0.01)


def test_every_page_counts_layers_from_1(client):
    for url in ("/", "/layer/1", "/memory/1/0", "/trace?prompt=the+cat"):
        html = client.get(url).text
        assert 'href="/layer/0"' not in html and "/memory/0/" not in html, url
    overview = client.get("/").text
    assert 'id="numbering"' in overview and "counted from 1" in overview
    rows = re.findall(r'<tr><td class="num"><a href="/layer/(\d)">(\d)</a>', overview)
    assert rows == [("1", "1"), ("2", "2"), ("3", "3")]


@pytest.mark.parametrize("projection, reading", [("identity", "p"), ("final-norm", "p"), ("identity", "logit")])
def test_memory_page_quotes_the_chosen_projections_numbers(client, analyzed, projection, reading):
    """The top token's p (or logit) and the top-1 trigger target's rank are those of the projection on the page,
    computed here from the weights; under identity the rank is the lookup table's. Small shares keep two
    significant digits, beside the uniform 1/|V| written with the same rule."""
    from ffkv.explorer.pages import value_format
    from ffkv.presentation.style import percent

    run, loaded = analyzed
    data = client.app.state.data
    view = loaded.view
    layer, key = 1, 4
    v = view.values(layer)[key]
    z = (view.final_norm(v) if projection == "final-norm" else v) @ view.unembedding.T
    te = pd.read_parquet(RunDir(run).table("trigger_examples")).query(
        f"layer == {layer} and key == {key} and direction == 1 and rank == 0").iloc[0]
    target = int(te["next_token_id"])
    rank = 1 + int((z > z[target]).sum())  # a token's rank in a distribution counts from 1, everywhere
    memory = client.get(f"/memory/{layer + 1}/{key}?projection={projection}&shown={reading}").text
    quoted = unescape(re.search(r'id="value-numbers">(.*?)</p>', memory, flags=re.S).group(1))
    top = f"logit {value_format(float(z.max()))}" if reading == "logit" else \
        f"p = {percent(float(z.softmax(-1).max()))} (uniform: {percent(1 / data.vocab_size)})"
    assert f"the top token has {top};" in quoted
    assert f"ranks {rank}" in quoted
    if projection == "identity":
        assert rank == int(data.key_stats.loc[(layer, key), "next_token_rank"])
    exported = client.get(f"/memory/{layer + 1}/{key}.json?projection={projection}&shown={reading}").json()["value"]
    assert exported["target_rank"] == rank and (exported["projection"], exported["shown"]) == (projection, reading)
    assert exported["top_value"] == pytest.approx(float(z.max() if reading == "logit" else z.softmax(-1).max()),
                                                  rel=1e-5)
    assert client.get(f"/memory/{layer + 1}/{key}?projection=logits").status_code == 422


def test_a_memory_page_opens_in_the_models_own_projection_and_names_a_uniform_distribution(client, analyzed):
    """With no projection asked for, the value is read through the final norm (GPT-2 has one), the page says so and
    how the paper's identity differs; a distribution whose entropy is above 99% of log|V| is called
    indistinguishable from uniform, with its top token's multiple of 1/|V|, computed here from the weights."""
    from ffkv.memories.projection import UNIFORM_ENTROPY_SHARE

    _, loaded = analyzed
    view = loaded.view
    exported = client.get("/memory/2/4.json").json()["value"]
    assert exported["projection"] == "final-norm"
    page = unescape(client.get("/memory/2/4").text)
    assert '<span class="on">final norm: softmax(N(v)·Eᵀ)</span>' in page and "the paper read values with the identity" in page
    shares = {}
    for projection in ("identity", "final-norm"):
        for key in range(view.d_m):
            v = view.values(1)[key]
            z = ((view.final_norm(v) if projection == "final-norm" else v) @ view.unembedding.T).double()
            logp = z.log_softmax(-1)
            shares[(projection, key)] = float(-(logp.exp() * logp).sum() / np.log(z.numel()))
    uniform = [k for k, share in shares.items() if share > UNIFORM_ENTROPY_SHARE]
    peaked = [k for k, share in shares.items() if share < UNIFORM_ENTROPY_SHARE - 0.01]
    assert uniform and peaked  # both kinds exist in this model
    for kind, (projection, key) in (("uniform", uniform[0]), ("peaked", peaked[0])):
        html = client.get(f"/memory/2/{key}?projection={projection}").text
        assert ('id="uniform-note"' in html) == (kind == "uniform"), (projection, key)
    projection, key = uniform[0]
    html = unescape(client.get(f"/memory/2/{key}?projection={projection}").text)
    assert f"its entropy is {100 * shares[(projection, key)]:.2f}%" in html or "its entropy is 100%" in html


def test_layer_page_has_no_uniform_confidence_column(client):
    """The values' identity confidence sits at about 1/|V| for every key of a small model: the layer page and
    the overview no longer show it as a column (the memory page quotes the chosen projection's)."""
    from ffkv.explorer.pages import value_format

    assert "value confidence" not in client.get("/layer/1").text and "value confidence" not in client.get("/").text
    assert client.get("/layer/1?sort=confidence").status_code == 422
    data = client.app.state.data
    found = data.promoting("#10")["results"]
    search = client.get("/search?token=%2310").text
    shown = re.findall(r'<td class="num">([^<]+)</td><td><span class="tok">', search)
    assert shown == [value_format(r["prob"]) for r in found] and len(found) > 0


def test_overview_shows_the_figures_in_the_papers_order(client):
    names = re.findall(r'<figcaption class="small muted">([^<]+)</figcaption>', client.get("/").text)
    assert names[0] == "patterns" and len(names) == len(set(names)) >= 9
    order = ["patterns", "ablations", "values", "values_rank", "composition_active", "composition",
             "refinement_agreement", "refinement_confidence", "refinement"]
    assert [n for n in names if n in order] == order  # Figures 2, 3, 4, 5, 7, 8, 9, 10, 11


def test_negative_memories_read_right(client, analyzed):
    """A signed (GELU) model's memory page says what the memory does in each direction, draws the bars of
    negative coefficients in the legend's red, and the layer page sorts by the strength of the most negative m."""
    run, _ = analyzed
    te = pd.read_parquet(RunDir(run).table("trigger_examples")).query("layer == 1 and rank == 0")
    page = client.get("/memory/2/4").text
    assert "bottom tokens: suppressed where m &gt; 0, promoted where m &lt; 0" in page
    assert "top tokens: promoted where m &gt; 0, suppressed where m &lt; 0" in page
    assert "(suppressed)" not in page and 'id="directions"' in page
    bars = re.findall(r'<span class="bar( neg)?" style="width: [\d.]+px"></span> (-?[\d.]+)', page)
    negative = re.findall(r'<span class="bar( neg)?"', page.split('id="triggers-negative"')[1])
    assert bars and negative and all((cls == " neg") == (float(value) < 0) for cls, value in bars)
    # Strength of m < 0: -m of each key's most negative trigger example (0 when it is positive), sortable.
    strongest = te[te.direction == -1].set_index("key")["coefficient"]
    expected = (-strongest).clip(lower=0).sort_values(ascending=False, kind="stable")
    table = client.app.state.data.layer_keys(1).set_index("key")
    np.testing.assert_allclose(table.loc[strongest.index, "negative_strength"], (-strongest).clip(lower=0), rtol=1e-6)
    shown = keys_in_order(client.get("/layer/2?sort=negative%20strength&order=desc").text, 2)
    assert [table.loc[k, "negative_strength"] for k in shown[:10]] == sorted(expected.to_numpy(), reverse=True)[:10]


def test_a_positive_only_index_has_no_negative_strength_column(tmp_path):
    """An index that kept only each key's largest coefficients (`--sign positive`, a ReLU model's default) says
    nothing of m < 0: the layer page has no 'strength m < 0' column of zeros and no note about m < 0."""
    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import IndexOptions, build_index
    from support.helpers import loaded_tiny
    from support.runs import corpus_lines, sharpen

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines()) + "\n")
    loaded = sharpen(loaded_tiny("gpt2"))
    run = tmp_path / "run"
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), run, IndexOptions(top_k=3, sign="positive"),
                progress=False)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded), raise_server_exceptions=False) as c:
        assert "negative_strength" not in c.app.state.data.layer_keys(0).columns
        page = c.get("/layer/1").text
        assert "largest m" in page and "strength m &lt; 0" not in page and 'id="signed-note"' not in page
        assert c.get("/layer/1?sort=negative%20strength").status_code == 422


def test_the_histogram_note_quotes_the_strongest_trigger_with_its_sign(tmp_path):
    """A gated key whose most negative trigger example is its strongest: the note under the activation histogram
    quotes that m with its minus sign (it said m = 8.152 for a key whose strongest example had m = -8.152)."""
    from ffkv.presentation.style import number
    from support.runs import index_run

    run, loaded = index_run(tmp_path, family="llama")
    te = pd.read_parquet(RunDir(run).table("trigger_examples")).query("layer == 0")
    extremes = te.groupby("key")["coefficient"].agg(["min", "max"])
    negative = extremes[-extremes["min"] > extremes["max"]]
    assert len(negative), "the tiny gated model has a key whose strongest trigger example is negative"
    key = int(negative.index[0])
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as c:
        page = c.get(f"/memory/1/{key}").text
    assert f"The strongest trigger example (largest |m|) reaches m = {number(negative.loc[key, 'min'])}." in page
    assert number(negative.loc[key, "min"]).startswith("-")


def test_the_memory_page_names_each_labels_cut_off_and_why(analyzed):
    """Issue 43: memory 3:17 of the demo showed `semantic z 24.418` labelled shallow, the layer's cut-off 37.74 nowhere
    on the page. Now each score stands beside its cut-off, and the page says which test passed or failed and by how
    much, in agreement with the labels `ffkv analyze --only patterns` wrote, for every key of every layer."""
    import re

    from starlette.testclient import TestClient

    from ffkv.explorer import create_app
    from ffkv.explorer.pages import label_reasons
    from ffkv.store.run import RunDir

    run, loaded = analyzed
    keys = RunDir(run).read_metric("patterns_keys")
    assert {"is_shallow", "is_semantic", "semantic_cutoff"} <= set(keys.columns)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as client:
        data = client.app.state.data
        for row in keys.itertuples():
            auto = data.labels_of(int(row.layer), int(row.key))["auto"]
            why = " ".join(label_reasons(auto))
            if row.dead:
                assert why.startswith("dead")
                continue
            assert ("shallow passed" in why) == bool(row.is_shallow), (row.layer, row.key, why)
            assert ("semantic passed" in why) == bool(row.is_semantic), (row.layer, row.key, why)
        row = keys[~keys["dead"]].iloc[0]
        page = client.get(f"/memory/{int(row.layer) + 1}/{int(row.key)}").text
    cut = max(3.0, float(row.semantic_cutoff))
    assert re.search(r'id="label-why"', page) and "(cut-off 30.0%)" in page
    assert f"(cut-off {number_text(cut)})" in page and f"control cut-off {number_text(row.semantic_cutoff)}" in page


def number_text(value: float) -> str:
    from ffkv.presentation.style import number

    return number(float(value))


def test_a_boxed_tokens_leading_space_stays_outside_its_box():
    """Issue 43: where a boxed trigger token (" word") wrapped at its leading space, an empty box was left at the end
    of the line. The space is now a span of its own, the box holds the word."""
    from ffkv.explorer.pages import strip_html

    def token(text, **marks):
        return {"text": text, "m": 1.0, "shade": 0.5, "trigger": False, "next": False, "after": False, **marks}

    html = str(strip_html([token("The"), token(" word", trigger=True), token(" next", next=True), token(" rest")]))
    assert '<span class="t trig" style="--a:0.38" title="m = 1">word</span>' in html
    assert "> next</span>" not in html and ">next</span>" in html
    assert "> rest</span>" in html  # unmarked tokens keep their space
    assert html.count("<span class=\"t\"") == 4  # "The", the two split spaces, " rest"


def test_tokens_outside_the_stored_window_are_text_in_one_marked_span():
    """Where the run stored a window of coefficients around each trigger, the tokens beyond it have no coefficient:
    each run of them is one hatched span of plain text (not spans shaded as m = 0), before and after the trigger."""
    from ffkv.explorer.pages import OUTSIDE_TITLE, strip_html

    def token(text, m=1.0, **marks):
        return {"text": text, "m": m, "shade": 0.0 if m is None else m, "trigger": False, "next": False,
                "after": False, "outside": False, **marks}

    html = str(strip_html([token("A", None, outside=True), token(" <b>", None, outside=True), token(" c"),
                           token(" d", trigger=True), token(" e", next=True, after=True),
                           token(" f", None, outside=True, after=True), token("\n", None, outside=True, after=True)]))
    assert html.count('class="nm') == 2
    assert f'<span class="nm" title="{OUTSIDE_TITLE}">A &lt;b&gt;</span>' in html
    assert f'<span class="nm after" title="{OUTSIDE_TITLE}"> f↵</span>' in html
    assert html.count('title="m = 1"') == 3  # the stored ones keep their value on hover


def test_search_says_how_many_matched_and_links_every_page(client):
    data = client.app.state.data
    n = data.text_matches("e")
    html = unescape(client.get("/search?q=e").text)
    assert re.search(rf'id="hits-count"><strong>{n:,}</strong> trigger examples hold it', html)
    pages = -(-n // 50)
    if pages > 1:
        assert f"page 1 of {pages}" in html and "/search?q=e&page=2" in html
        assert client.get(f"/search?q=e&page={pages}").status_code == 200
    assert client.get(f"/search?q=e&page={pages + 1}").status_code == 404
    assert client.get("/search?q=e&page=x").status_code == 422
    for empty in ("/search?q=", "/search?q=++", "/search?token=", "/search?token=&q="):  # a form sent empty
        answer = client.get(empty)
        assert answer.status_code == 200 and 'id="text-search"' in answer.text and 'id="hits"' not in answer.text
    assert re.search(r'class="small muted at" title="fired on token \d+ of the example">on</span>', html)


def test_the_trace_form_lands_on_its_states_own_url_and_a_position_click_does_not_generate(client, analyzed):
    """The form is a GET: what it submits (empty fields, button names) lands, by a 303, on the one URL of the
    state, which shows it; Generate generates, a click on a position afterwards does not; an edited chip shows its
    coefficient as edited; with a target, each cell gives the target's probability, which in the last layer's
    output read through the final norm is the model's own (GPT-2's head has no bias)."""
    _, loaded = analyzed
    submitted = client.get("/trace?prompt=the+cat+sat&action=intervene&n_generate=20&current_position=2"
                           "&set%3A2%3A3=5&scale%3A2%3A4=&set%3A2%3A4=&target=", follow_redirects=False)
    assert submitted.status_code == 303
    assert submitted.headers["location"] == "/trace?prompt=the+cat+sat&position=2&set=2%3A3%3D5"
    page = client.get(submitted.headers["location"], follow_redirects=False)
    assert page.status_code == 200 and 'id="generation"' not in page.text
    assert re.search(r'<a href="/memory/2/3">2:3</a> <span class="small muted">[^<]*\(m=[^<]*<strong class="edited-m" '
                     r'title="as edited"> → 5</strong>', page.text)
    generated = client.get("/trace?prompt=the+cat+sat&position=2&set%3A2%3A3=5&action=generate&n_generate=3",
                           follow_redirects=False)
    assert generated.headers["location"].endswith("&generate=3")
    assert 'id="generation"' in client.get(generated.headers["location"]).text
    clicked = client.get("/trace?prompt=the+cat+sat&position=1&n_generate=3&set=2%3A3%3D5")  # a position's button
    assert 'id="generation"' not in clicked.text and "position=1" in str(clicked.url)
    target = loaded.tokenizer.token_strings([int(loaded.tokenizer.encode("the cat sat")[-1])])[0]
    html = unescape(client.get("/trace?prompt=the+cat+sat&target=" + target.replace(" ", "%20")).text)
    cells = re.findall(r'<span class="target-p small"[^>]*>.*?([\d.]+)%</span>', html)
    assert len(cells) == 3 * loaded.view.n_layers
    from ffkv.explorer.tracing import trace

    ids = loaded.tokenizer.encode("the cat sat")
    t = trace(loaded, ids, target=int(ids[-1]))
    final = float(loaded.model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)[int(ids[-1])])
    assert t.layers[-1].after.target_prob == pytest.approx(final, rel=1e-5)
