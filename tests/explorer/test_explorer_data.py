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
        nxt = int(te[(te.layer == layer) & (te.key == key) & (te["rank"] == 0)].next_token_id.iloc[0])
        assert bool(stats.agreement) == (nxt == int(top.indices[0]))
        if nxt >= 0:
            assert int(stats.next_token_rank) == int((p > p[nxt]).sum())
        assert stats.confidence == pytest.approx(float(top.values[0]), rel=1e-5)
        assert 0 <= stats.activation_frequency <= 1
        assert 0 < stats.shallow_share <= 1


def test_memory_page_data(data, analyzed):
    run, loaded = analyzed
    m = data.memory(1, 7)
    te = pd.read_parquet(run / "trigger_examples.parquet")
    rows = te[(te.layer == 1) & (te.key == 7)].sort_values("rank")
    assert [e["example_id"] for e in m["examples"]] == rows.example_id.tolist()
    ex = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    first = m["examples"][0]
    ids = list(ex.at[first["example_id"], "token_ids"])
    assert first["last"] == loaded.tokenizer.token_strings([ids[first["position"]]])[0]
    assert "".join(first["prefix"]) + first["last"] + "".join(first["rest"]) == loaded.tokenizer.decode(ids)
    assert m["auto"]["label"] in ("shallow", "semantic", "both", "none")  # from metrics/patterns_keys.parquet
    keys = pd.read_parquet(run / "metrics" / "patterns_keys.parquet").set_index(["layer", "key"])
    assert m["auto"]["label"] == keys.at[(1, 7), "label"] and m["auto"]["description"] == keys.at[(1, 7), "description"]
    assert len(m["value_top"]) == 10


def test_unknown_layer_key_and_token_are_4xx(data):
    for layer, key in [(3, 0), (-1, 0), (0, 40), ("x", 0), (0, "1.5")]:
        with pytest.raises(BadRequest) as err:
            data.memory(layer, key)
        assert 400 <= err.value.status < 500
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


def test_text_search(data):
    hits = data.text_search("PARIS")
    assert hits and all("paris" in h["text"].lower() for h in hits)
    assert all(h["memories"] for h in hits)
    assert data.text_search("100%") == []  # % is literal, not a wildcard
    with pytest.raises(BadRequest):
        data.text_search("  ")


def test_cache_is_reused_and_rebuilt_when_the_index_changes(analyzed, tmp_path):
    import shutil

    run, loaded = analyzed
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    db = copy / "explorer" / "explorer.duckdb"
    # A copy keeps mtimes (copy2), so the cache is valid and reused as it is.
    before = db.stat().st_mtime_ns
    ExplorerData(copy, loaded).close()
    assert db.stat().st_mtime_ns == before
    os.utime(copy / "trigger_examples.parquet", ns=(1, 1))
    ExplorerData(copy, loaded).close()
    assert db.stat().st_mtime_ns != before


def test_activation_frequency_counts_only_real_tokens(analyzed):
    from ffkv.explorer.lookups import activation_frequency

    _, loaded = analyzed
    a = activation_frequency(loaded, [[5, 6, 7, 8]])
    b = activation_frequency(loaded, [[5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11][:4]], batch_size=1)
    np.testing.assert_allclose(a, b, atol=1e-6)
    view = loaded.view
    with view.capture(("coefficients",)) as cap:
        view.forward(torch.tensor([[5, 6, 7, 8]]))
    np.testing.assert_allclose(a[1], (cap["coefficients"][1][0] > 0).float().mean(0).numpy(), atol=1e-6)
