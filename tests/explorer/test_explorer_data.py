"""The explorer's lookup tables and queries agree with brute-force computations on the run."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.explorer.data import ExplorerData
from ffkv.explorer.validation import BadRequest
from ffkv.memories.projection import logits


@pytest.fixture(scope="module")
def data(analyzed):
    run, loaded = analyzed
    d = ExplorerData(run, loaded)
    yield d
    d.close()


def test_value_lookups_match_a_direct_projection(data, analyzed):
    run, loaded = analyzed
    te = pd.read_parquet(run / "trigger_examples.parquet")
    for layer, key in [(0, 0), (1, 7), (2, 39)]:
        p = logits(loaded.view, loaded.view.values(layer)[key], "identity").softmax(-1)
        top = p.topk(10)
        assert data.top_ids[layer, key].tolist() == top.indices.tolist()
        np.testing.assert_allclose(data.top_probs[layer, key], top.values.numpy(), rtol=1e-5)
        stats = data.key_stats.loc[(layer, key)]
        nxt = int(te[(te.layer == layer) & (te.key == key) & (te["rank"] == 0) & (te.direction == 1)].next_token_id.iloc[0])
        assert bool(stats.agreement) == (nxt == int(top.indices[0]))
        if nxt >= 0:
            assert int(stats.next_token_rank) == 1 + int((p > p[nxt]).sum())
        assert stats.confidence == pytest.approx(float(top.values[0]), rel=1e-5)
        assert 0 <= stats.activation_frequency <= 1
        assert 0 < stats.shallow_share <= 1


def test_memory_page_data(data, analyzed):
    run, loaded = analyzed
    m = data.memory(1, 7)  # layer index 1 (the page's layer 2)
    te = pd.read_parquet(run / "trigger_examples.parquet")
    rows = te[(te.layer == 1) & (te.key == 7) & (te.direction == 1)].sort_values("rank")
    assert [e["example_id"] for e in m["examples"]] == rows.example_id.tolist()
    negative = te[(te.layer == 1) & (te.key == 7) & (te.direction == -1)].sort_values("rank")
    assert [g["direction"] for g in m["triggers"]] == [1, -1]  # the page shows the most negative ones too
    assert [e["example_id"] for e in m["triggers"][1]["examples"]] == negative.example_id.tolist()
    ex = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    view = loaded.view
    for e, stored in zip(m["examples"], rows.coefficient):
        ids = list(ex.at[e["example_id"], "token_ids"])
        assert "".join(t["text"] for t in e["tokens"]) == loaded.tokenizer.decode(ids)
        assert [t["trigger"] for t in e["tokens"]].index(True) == e["position"]
        assert e["last"] == loaded.tokenizer.token_strings([ids[e["position"]]])[0]
        # Per-token coefficients over the whole example, brute force: one forward pass of this example alone.
        with view.capture(("coefficients",)) as cap:
            view.forward(torch.tensor([ids]))
        # Stored by the build as float16 (three significant digits); the trigger position's is the index's own.
        np.testing.assert_allclose([t["m"] for t in e["tokens"]], cap["coefficients"][1][0, :, 7].numpy(),
                                   rtol=1e-3, atol=1e-4)
        assert e["tokens"][e["position"]]["m"] == float(stored)
    assert m["auto"]["label"] in ("shallow", "semantic", "both", "none")  # from metrics/patterns_keys.parquet
    keys = pd.read_parquet(run / "metrics" / "patterns_keys.parquet").set_index(["layer", "key"])
    assert m["auto"]["label"] == keys.at[(1, 7), "label"] and m["auto"]["description"] == keys.at[(1, 7), "description"]
    assert len(m["value"]["top"]) == len(m["value"]["bottom"]) == 15


@pytest.mark.parametrize("projection, reading", [("identity", "p"), ("final-norm", "p"), ("identity", "logit"),
                                                 ("final-norm", "logit")])
def test_value_tokens_under_each_projection(data, analyzed, projection, reading):
    _, loaded = analyzed
    v = loaded.view.values(2)[5]
    z = (loaded.view.final_norm(v) if projection == "final-norm" else v) @ loaded.view.unembedding.T
    shown = z if reading == "logit" else z.softmax(-1)
    m = data.memory(2, 5, projection, shown=reading)
    top, bottom = m["value"]["top"], m["value"]["bottom"]
    assert [t["token_id"] for t in top] == z.topk(15).indices.tolist()
    assert [t["token_id"] for t in bottom] == (-z).topk(15).indices.tolist()
    np.testing.assert_allclose([t["value"] for t in top], shown[z.topk(15).indices].detach().numpy(), rtol=1e-5)
    assert m["value"]["shown"] == reading and m["projection"] == projection
    # The projection vocabulary is ffkv's everywhere: the former "logits" projection is a reading now.
    for bad, why in ((dict(projection="logits"), "shown=logit"), (dict(projection="lens"), "identity, final-norm"),
                     (dict(shown="prob"), "p, logit")):
        with pytest.raises(BadRequest, match=why):
            data.memory(2, 5, **bad)


def test_unknown_layer_key_and_token_are_4xx(data):
    for layer, key in [(4, 0), (0, 0), (-1, 0), (1, 40), ("x", 0), (1, "1.5")]:  # as pages write them: layers from 1
        with pytest.raises(BadRequest) as err:
            data.check(layer, key)
        assert 400 <= err.value.status < 500
    with pytest.raises(BadRequest):
        data.memory(3, 0)  # layer indices are 0 to 2
    with pytest.raises(BadRequest, match="projection"):
        data.memory(0, 0, "softmax")
    with pytest.raises(BadRequest, match="not a token"):
        data.promoting("no such token")
    with pytest.raises(BadRequest, match="not in the vocabulary"):
        data.promoting("#100000")


def test_promoting_ranks_exactly(data, analyzed):
    _, loaded = analyzed
    token_id = int(data.top_ids[2, 5, 0])
    found = data.promoting(loaded.tokenizer.token_strings([token_id])[0])
    assert found["results"][0]["rank"] == 0
    ranks = [r["rank"] for r in found["results"] if r["rank"] is not None]
    assert ranks == sorted(ranks)
    assert any((r["layer"], r["key"]) == (2, 5) for r in found["results"])
    # Past the top-token table: keys by p_i(token), computed from the weights.
    extra = [r for r in found["results"] if r["rank"] is None]
    for r in extra[:3]:
        p = logits(loaded.view, loaded.view.values(r["layer"])[r["key"]], "identity").softmax(-1)
        assert r["prob"] == pytest.approx(float(p[token_id]), rel=1e-4)


def test_text_search(data, analyzed):
    run, _ = analyzed
    hits = data.text_search("PARIS")
    assert hits and all("paris" in h["text"].lower() for h in hits)
    assert all(h["memories"] for h in hits)
    te = pd.read_parquet(run / "trigger_examples.parquet")
    for h in hits:  # every memory the example triggers, strongest |m| first
        mine = te[te.example_id == h["example_id"]]
        assert h["n_memories"] == len(mine)
        strengths = [abs(m["coefficient"]) for m in h["memories"]]
        assert strengths == sorted(strengths, reverse=True)
        assert strengths[0] == pytest.approx(float(mine.coefficient.abs().max()))
    assert data.text_search("100%") == []  # % is literal, not a wildcard
    with pytest.raises(BadRequest):
        data.text_search("  ")


def test_text_search_counts_every_match_pages_through_them_and_names_the_token_each_memory_fired_on(data, analyzed):
    """Every example holding the text, counted and reached page by page (none twice), each memory's chip with the
    position and token of its trigger row, read from the run's own tables."""
    run, loaded = analyzed
    ex = pd.read_parquet(run / "examples.parquet")
    te = pd.read_parquet(run / "trigger_examples.parquet")
    text = "e"
    expected = sorted(int(i) for i, t in zip(ex.example_id, ex.text) if text in t.lower())
    assert data.text_matches(text) == len(expected) > 7
    pages = [data.text_search(text, limit=7, page=n) for n in range(1, -(-len(expected) // 7) + 2)]
    assert [h["example_id"] for page in pages for h in page] == expected and pages[-1] == []
    tokens = dict(zip(ex.example_id, ex.token_ids))
    for h in pages[0]:
        rows = te[te.example_id == h["example_id"]].set_index(["layer", "key", "direction", "rank"])
        for m in h["memories"]:
            row = rows.loc[(m["layer"], m["key"], m["direction"], m["rank"])]
            assert m["position"] == int(row["position"])
            assert m["token"] == data.token(int(tokens[h["example_id"]][int(row["position"])]))


def test_promoting_counts_and_pages_through_every_memory_ranking_the_token(data):
    token_id = int(np.bincount(data.top_ids[..., 0].ravel()).argmax())  # the most common top token
    ranked = int((data.top_ids == token_id).sum())
    first = data.promoting(f"#{token_id}", limit=5)
    assert first["n_ranked"] == ranked and first["n_top"] == int((data.top_ids[..., 0] == token_id).sum())
    assert first["n_pages"] == -(-ranked // 5) > 1
    seen = [(r["layer"], r["key"]) for n in range(1, first["n_pages"] + 1)
            for r in data.promoting(f"#{token_id}", limit=5, page=n)["results"] if r["rank"] is not None]
    assert len(seen) == ranked == len(set(seen))
    with pytest.raises(BadRequest):
        data.promoting(f"#{token_id}", limit=5, page=first["n_pages"] + 1)


def test_cache_is_reused_and_rebuilt_when_the_index_changes(analyzed, tmp_path):
    import shutil

    run, loaded = analyzed
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    db = copy / "explorer" / "explorer.duckdb"  # built by `ffkv analyze`
    # A copy keeps mtimes (copy2), so the cache is valid and reused as it is.
    before = db.stat().st_mtime_ns
    ExplorerData(copy, loaded).close()
    assert db.stat().st_mtime_ns == before
    os.utime(copy / "trigger_examples.parquet", ns=(1, 1))
    ExplorerData(copy, loaded).close()
    assert db.stat().st_mtime_ns != before


def test_stored_trigger_coefficients_are_read_not_computed(analyzed, monkeypatch):
    """The build stores every trigger example's per-token coefficients: a memory page runs no forward pass for
    them, and they equal a live computation (to float16's precision)."""
    from ffkv.explorer import live
    from ffkv.store import lookups

    run, loaded = analyzed
    info = lookups.read_info(run / "explorer")["trigger_coefficients"]
    te = pd.read_parquet(run / "trigger_examples.parquet")
    ex = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    assert info["file"] == lookups.COEFFICIENTS and info["dtype"] == "float16"
    assert info["cells"] == sum(len(ex.at[e, "token_ids"]) for e in te.example_id)  # every row, whole example
    assert info["bytes"] == (run / "explorer" / lookups.COEFFICIENTS).stat().st_size
    calls = []
    monkeypatch.setattr(live, "context_coefficients", lambda *a, **k: calls.append(a[1:3]))
    d = ExplorerData(run, loaded)
    try:
        for layer, key in [(0, 3), (2, 11)]:
            m = d.memory(layer, key)
            for group in m["triggers"]:
                ids = [list(ex.at[e["example_id"], "token_ids"]) for e in group["examples"]]
                for e, token_ids in zip(group["examples"], ids):
                    with loaded.view.capture(("coefficients",), layers=[layer]) as cap:
                        loaded.view.forward(torch.tensor([token_ids]))
                    np.testing.assert_allclose([t["m"] for t in e["tokens"]],
                                               cap["coefficients"][layer][0, :, key].numpy(), rtol=2e-3, atol=1e-4)
        assert calls == []
    finally:
        d.close()


def test_a_memorys_context_coefficients_are_computed_once(analyzed, monkeypatch):
    """Without stored coefficients (an index too large to store them), a page computes them, once per key."""
    from ffkv.explorer import data as data_module
    from ffkv.explorer import live

    run, loaded = analyzed
    calls = []
    real = live.context_coefficients
    monkeypatch.setattr(live, "context_coefficients", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    monkeypatch.setattr(data_module, "CONTEXT_CACHE", 2)
    d = ExplorerData(run, loaded)
    d.coefficients = None
    try:
        first = d.memory(1, 3, "identity")
        again = d.memory(1, 3, "final-norm", shown="logit")  # another reading: the same coefficients, no second pass
        assert calls == [(1, 3)]
        assert [[t["m"] for t in e["tokens"]] for e in first["examples"]] == \
            [[t["m"] for t in e["tokens"]] for e in again["examples"]]
        d.memory(1, 4), d.memory(1, 5)  # two more keys push (1, 3) out of a cache of two
        d.memory(1, 3)
        assert calls == [(1, 3), (1, 4), (1, 5), (1, 3)]
    finally:
        d.close()


def test_the_explorer_says_why_it_builds_its_lookup_tables(tmp_path, capsys):
    """`ffkv serve` on a run without current lookup tables builds them and says why: never analysed, analysed
    without them, or built once and since gone."""
    import shutil

    from ffkv.experiments import analyze
    from ffkv.store.run import RunDir
    from support.runs import index_run

    run, loaded = index_run(tmp_path / "a")
    ExplorerData(run, loaded, progress=True).close()
    assert "ffkv serve: this run was not analysed; building" in capsys.readouterr().out
    shutil.rmtree(run / "explorer")
    analyze(run, only="values", loaded=loaded, progress=False)
    assert "lookups" not in RunDir(run).manifest().analyses
    ExplorerData(run, loaded, progress=True).close()
    assert "ffkv serve: its analyses did not build the lookup tables; building" in capsys.readouterr().out
    analyze(run, only="lookups", loaded=loaded, progress=False)
    shutil.rmtree(run / "explorer")
    ExplorerData(run, loaded, progress=True).close()
    assert "ffkv serve: its lookup tables are missing or out of date" in capsys.readouterr().out


def rebuilt_as_for_a_real_model(run, loaded, monkeypatch):
    """The run's lookups built again, storing coefficients as for a model whose pages cost more than `LIVE_MACS`, and
    opened: (ExplorerData, info.json's trigger_coefficients, the (layer, key) of every page that ran the model)."""
    from ffkv.experiments import trigger_contexts
    from ffkv.explorer import live
    from ffkv.store import lookups

    monkeypatch.setattr(trigger_contexts, "LIVE_MACS", 0.0)
    (run / "explorer" / lookups.INFO).unlink()
    calls = []
    monkeypatch.setattr(live, "context_coefficients", lambda *a, **k: calls.append(a[1:3]))
    d = ExplorerData(run, loaded)
    return d, lookups.read_info(run / "explorer")["trigger_coefficients"], calls


def stored_cells(rows: pd.DataFrame, examples: pd.DataFrame, before: int, after: int) -> int:
    """The coefficients stored for trigger `rows` in a window of `before` and `after` tokens around each trigger."""
    return sum(min(p + after + 1, len(examples.at[e, "token_ids"])) - max(p - before, 0)
               for e, p in zip(rows.example_id, rows.position))


def shown_tokens(loaded, examples: pd.DataFrame, m: dict):
    """Every token a memory page (`ExplorerData.memory`'s `m`) shows of its trigger examples, beside the truth: (the
    example, the token's position in it, the token, the key's coefficient there from a forward pass over the example
    alone)."""
    layer, key = m["layer"], m["key"]
    for group in m["triggers"]:
        for e in group["examples"]:
            token_ids = list(examples.at[e["example_id"], "token_ids"])
            with loaded.view.capture(("coefficients",), layers=[layer]) as cap:
                loaded.view.forward(torch.tensor([token_ids]))
            truth = cap["coefficients"][layer][0, :, key].numpy()
            for j, t in enumerate(t for t in e["tokens"] if not t.get("gap")):
                yield e, e["first"] + j, t, float(truth[e["first"] + j])


@pytest.mark.parametrize("case", ["whole examples do not fit", "the windows do not fit either"])
def test_a_window_of_coefficients_where_whole_examples_do_not_fit(fresh_run, monkeypatch, case):
    """Issue 44: on SmolLM2 the index's whole trigger examples held more than MAX_CELLS coefficients, so none were
    stored and each first view of a memory page ran the model (median 28 s). Now the build stores a window around
    each trigger, narrowed where the rows' windows would not fit either (SmolLM2 at the default top-50): within it
    the page's coefficients equal a brute-force forward pass (to float16's precision), the file holds at most
    MAX_CELLS values, and no model runs; outside it no token is shaded, and the page marks those tokens and says
    why."""
    from ffkv.experiments import trigger_contexts
    from ffkv.explorer import pages
    from ffkv.store import lookups

    run, loaded = fresh_run
    te = pd.read_parquet(run / "trigger_examples.parquet")
    ex = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    whole = sum(len(ex.at[e, "token_ids"]) for e in te.example_id)
    if case == "whole examples do not fit":
        window, max_cells, (before, after) = (2, 1), whole - 1, (2, 1)
    else:  # room for 6 tokens a row, not WINDOW's 10: cut in its proportions, the token after the trigger kept
        window, max_cells, (before, after) = (6, 3), 6 * len(te), (4, 1)
    assert max_cells < whole
    monkeypatch.setattr(trigger_contexts, "WINDOW", window)
    monkeypatch.setattr(trigger_contexts, "MAX_CELLS", max_cells)
    assert trigger_contexts.window_for(len(te)) == (before, after)
    d, info, calls = rebuilt_as_for_a_real_model(run, loaded, monkeypatch)
    try:
        assert info["file"] == lookups.COEFFICIENTS and info["window"] == [before, after]
        assert info["cells"] == stored_cells(te, ex, before, after) <= max_cells and info["max_cells"] == max_cells
        outside = 0
        for layer, key in [(0, 3), (2, 11)]:
            m = d.memory(layer, key)
            assert m["window"] == [before, after]
            for e, at, t, truth in shown_tokens(loaded, ex, m):
                if e["position"] - before <= at <= e["position"] + after:
                    assert t["m"] == pytest.approx(truth, rel=2e-3, abs=1e-4), (layer, key, at)
                    assert not t["outside"]
                else:
                    assert t["m"] is None and t["outside"]
                    outside += 1
            html = pages.memory_page(d, layer + 1, key)
            assert f"this run stores m for {before} tokens before each trigger and {after} after it" in html
            assert html.count('<span class="nm') >= 1
        assert outside > 0
        assert calls == []  # no forward pass for a page
    finally:
        d.close()


@pytest.mark.parametrize("case", ["whole examples", "windows"])
def test_an_index_too_large_for_every_row_stores_its_strongest_ranks(fresh_run, monkeypatch, case):
    """Issue 44, item 5: an index of more than MAX_ROWS rows (an 8B model's: 92M) stored no coefficients, so each
    first view ran the model over the memory's 200 examples (minutes on a CPU). Now the build stores them for the
    strongest ranks of every memory that fit (here 2 of 5, in each direction): there the page's coefficients equal a
    brute-force forward pass (to float16's precision); below them only the trigger position's, the index's own;
    the file holds exactly the located rows' cells, the page says which examples are shaded, and no model runs."""
    from ffkv.experiments import trigger_contexts
    from ffkv.explorer import pages
    from ffkv.store import lookups

    run, loaded = fresh_run
    te = pd.read_parquet(run / "trigger_examples.parquet")
    ex = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    strong = te[te["rank"] < 2]
    assert 0 < len(strong) < len(te)
    monkeypatch.setattr(trigger_contexts, "MAX_ROWS", len(strong))
    if case == "windows":  # the strongest rows' whole examples do not fit: the narrowest window, (2, 1)
        monkeypatch.setattr(trigger_contexts, "MAX_CELLS", len(strong) * (trigger_contexts.MIN_BEFORE + 2))
    before, after = (2, 1) if case == "windows" else (10**9, 10**9)
    assert trigger_contexts.located_ranks(te.groupby("rank").size().sort_index().tolist()) == 2
    d, info, calls = rebuilt_as_for_a_real_model(run, loaded, monkeypatch)
    try:
        assert info["file"] == lookups.COEFFICIENTS and info["ranks"] == 2
        assert info["window"] == ([before, after] if case == "windows" else None)
        assert info["cells"] == stored_cells(strong, ex, before, after) <= trigger_contexts.MAX_CELLS
        shaded = bare = 0
        for layer, key in [(0, 3), (2, 11)]:
            m = d.memory(layer, key)
            assert m["stored_ranks"] == 2
            for e, at, t, truth in shown_tokens(loaded, ex, m):
                p = e["position"]
                if at == p:  # the index's own coefficient, whatever the rank
                    assert t["m"] == e["coefficient"] and not t["outside"]
                elif e["rank"] < 2 and p - before <= at <= p + after:
                    assert t["m"] == pytest.approx(truth, rel=2e-3, abs=1e-4), (layer, key, at)
                    assert not t["outside"]
                    shaded += 1
                else:
                    assert t["m"] is None and t["outside"], (e["rank"], at)
                    bare += e["rank"] >= 2
            html = pages.memory_page(d, layer + 1, key)
            assert "they are stored for the 2 strongest examples of each direction" in html
            assert pages.memory_json(d, layer + 1, key)["stored_ranks"] == 2
        assert shaded > 0 and bare > 0
        assert calls == []  # no forward pass for a page
    finally:
        d.close()


def test_a_run_that_stores_whole_examples_marks_no_token(data):
    """Where the build stored whole examples (the demo, this run), every shown token has its coefficient: no token
    is marked as outside a window, and the page says nothing of one."""
    from ffkv.explorer import pages

    m = data.memory(1, 3)
    assert m["window"] is None
    assert not any(t.get("outside") for g in m["triggers"] for e in g["examples"] for t in e["tokens"])
    html = pages.memory_page(data, 2, 3)
    assert "window-note" not in html and '<span class="nm' not in html


def _damaged_copy(analyzed, tmp_path):
    import shutil

    from ffkv.store import lookups

    run, loaded = analyzed
    copy = tmp_path / "run"
    shutil.copytree(run, copy)  # copy2 keeps mtimes: the tables stay current
    return copy, loaded, copy / "explorer" / lookups.COEFFICIENTS


def test_damaged_stored_coefficients_are_refused_by_name(analyzed, tmp_path):
    """A coefficient file of the recorded size whose bytes were changed in place is refused, naming the file and
    the command that rewrites it; a page never shades tokens by coefficients other than those written."""
    from ffkv.errors import DamagedRun

    copy, loaded, path = _damaged_copy(analyzed, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-8:] = bytes(8 * [0x3C])  # four float16 values become 1.0586: the same size
    path.write_bytes(bytes(raw))
    with pytest.raises(DamagedRun) as caught:
        ExplorerData(copy, loaded)
    message = str(caught.value)
    assert str(path) in message and "SHA-256" in message and f"ffkv analyze {copy} --only lookups" in message


def test_a_coefficient_file_that_is_not_the_described_array_is_refused(analyzed, tmp_path):
    """A coefficient file whose recorded size and hash agree (another build's, or info.json rewritten) but which
    is not the array info.json describes (its dtype and length) is refused, naming it."""
    from ffkv.errors import DamagedRun
    from ffkv.store import atomic, integrity, lookups

    copy, loaded, path = _damaged_copy(analyzed, tmp_path)
    np.save(path, np.load(path).astype(np.float32), allow_pickle=False)  # the same values, another dtype
    info = lookups.read_info(copy / "explorer")
    info["files"][lookups.COEFFICIENTS] = integrity.describe_file(path, "lookups")
    atomic.write_json(copy / "explorer" / lookups.INFO, info)
    with pytest.raises(DamagedRun) as caught:
        ExplorerData(copy, loaded)
    message = str(caught.value)
    assert str(path) in message and "dtype float32" in message and "float16 values" in message


def test_a_long_example_is_shown_around_its_trigger(data, monkeypatch):
    """A page shows SHOWN_BEFORE tokens before the trigger and SHOWN_AFTER after it, a mark for the rest (a WikiText
    line of hundreds of tokens made a SmolLM2 memory page 0.5-0.74 MB); its JSON says where the tokens start."""
    from ffkv.explorer import data as data_module
    from ffkv.explorer.pages import memory_json

    monkeypatch.setattr(data_module, "SHOWN_BEFORE", 3)
    monkeypatch.setattr(data_module, "SHOWN_AFTER", 1)
    examples = [e for g in data.memory(1, 3)["triggers"] for e in g["examples"]]
    lengths = {int(e): len(ids) for e, ids in zip(*(data.triggers(1, 3)[c] for c in ("example_id", "token_ids")))}
    assert any(e["tokens"][0].get("gap") for e in examples)
    for e in examples:
        shown = [t for t in e["tokens"] if not t.get("gap")]
        assert shown[e["position"] - e["first"]]["trigger"]
        if lengths[e["example_id"]] > 5:  # cut to 3 before the trigger and 1 after it
            assert len(shown) <= 5 and e["first"] == max(0, e["position"] - 3)
        else:  # a short example is shown whole
            assert len(shown) == lengths[e["example_id"]] and e["first"] == 0
    exported = memory_json(data, 2, 3)["trigger_examples"]
    for e in exported:
        assert len(e["tokens"]) == len(e["coefficients"]) <= 5
        assert e["coefficients"][e["position"] - e["first_position"]] == pytest.approx(e["coefficient"], rel=1e-4)
