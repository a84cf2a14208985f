"""The explorer's lookup tables that `ffkv analyze` builds agree with brute-force computations on the run."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.memories.active import ACTIVE_FRACTION

from ffkv.experiments import EXPERIMENTS
from ffkv.experiments.lookups import HISTOGRAM_BINS, activation_stats, corpus_sample, sample_batches
from ffkv.store import lookups
from ffkv.store.run import RunDir
from support.helpers import held_out_scale


def test_analyze_builds_current_lookup_tables(analyzed):
    run, _ = analyzed
    assert "lookups" in EXPERIMENTS
    rd = RunDir(run)
    assert lookups.find(rd, rd.manifest()) == rd.cache_dir
    info = lookups.read_info(rd.cache_dir)
    assert info["activation_sample"]["examples"] == len(corpus_sample(rd))


def run_held_out_scale(run, loaded) -> np.ndarray:
    """s_l by brute force (`support.helpers.held_out_scale`) on the held-out examples `analyzed_run` gave analyze
    (its corpus, n_eval, seed 0)."""
    from ffkv.experiments.common import eval_spec, select_held_out
    from support.runs import N_LINES

    held = select_held_out(loaded, eval_spec(RunDir(run).manifest(), str(run.parent / "corpus.txt"), None, N_LINES, 0), 0)
    return held_out_scale(loaded, held)


def test_activation_histogram_and_frequency_match_brute_force(analyzed):
    """The activation frequency's rule is the run's: tau·s_l with s_l of the held-out examples (the one owner,
    `heldout.active_scale`, as composition's s_l table), never of the lookups' own sample."""
    run, loaded = analyzed
    rd = RunDir(run)
    stats = pd.read_parquet(rd.cache_dir / "key_stats.parquet").set_index(["layer", "key"])
    sample = corpus_sample(rd)
    view = loaded.view
    every = {layer: [] for layer in range(view.n_layers)}
    for ids in sample:  # one example at a time: no padding at all
        with view.capture(("coefficients",)) as cap:
            view.forward(torch.tensor([ids]))
        for layer in every:
            every[layer].append(cap["coefficients"][layer][0].double())
    positions = sum(len(ids) for ids in sample)
    info = lookups.read_info(rd.cache_dir)["activation_sample"]
    assert info["positions"] == positions
    assert view.signed  # a GELU model: the signed rule, not m > 0
    s_l = run_held_out_scale(run, loaded)
    np.testing.assert_allclose(info["active_threshold"], ACTIVE_FRACTION * s_l, rtol=1e-5)
    np.testing.assert_allclose(rd.read_metric("composition_scale")["scale"], s_l, rtol=1e-5)  # one s_l per run
    assert info["threshold_source"]["seed"] == 0 and info["threshold_source"]["tau"] == ACTIVE_FRACTION
    for layer, key in [(0, 0), (1, 7), (2, 39)]:
        all_m = torch.cat(every[layer])
        sample_s_l = float(all_m.square().mean().sqrt())  # what the lookups used to use: not the run's
        assert not np.isclose(sample_s_l, s_l[layer], rtol=1e-3)
        m = all_m[:, key].numpy()
        row = stats.loc[(layer, key)]
        assert row.activation_frequency == pytest.approx((np.abs(m) > ACTIVE_FRACTION * s_l[layer]).mean(), abs=1e-6)
        assert row.activation_frequency != pytest.approx((m > 0).mean(), abs=1e-6) or (m > 0).all()
        assert np.isclose(row.activation_lo, m.min(), rtol=1e-5) and np.isclose(row.activation_hi, m.max(), rtol=1e-5)
        counts, _ = np.histogram(m, bins=HISTOGRAM_BINS, range=(float(row.activation_lo), float(row.activation_hi)))
        assert sum(row.activation_histogram) == positions
        # Bins agree up to values on an edge (float32 edges against float64 values).
        assert np.abs(np.asarray(row.activation_histogram) - counts).sum() <= 2


def test_padding_is_never_counted(analyzed):
    _, loaded = analyzed
    view = loaded.view
    examples = [[5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    every = []
    for layer in range(view.n_layers):  # brute force over the 13 real positions, each example alone
        parts = []
        for ids in examples:
            with view.capture(("coefficients",)) as cap:
                view.forward(torch.tensor([ids]))
            parts.append(cap["coefficients"][layer][0].double())
        every.append(torch.cat(parts))
    threshold = np.array([0.1 * float(m.abs().max()) + 1e-3 * layer for layer, m in enumerate(every)])  # any given
    padded = activation_stats(loaded, sample_batches(loaded, examples), threshold)  # one batch, the first padded
    assert padded["positions"] == 13
    for layer, m in enumerate(every):
        expected = (m.abs() > threshold[layer]).double().mean(0).numpy()
        np.testing.assert_allclose(padded["frequency"][layer], expected, atol=1e-6)
        assert padded["histogram"][layer].sum(-1).tolist() == [13] * view.d_m
    assert activation_stats(loaded, sample_batches(loaded, examples), None)["frequency"] is None


def test_corpus_sample_is_seeded_and_spans_the_corpus(analyzed):
    run, _ = analyzed
    rd = RunDir(run)
    a, b = corpus_sample(rd, n=10, seed=1), corpus_sample(rd, n=10, seed=1)
    assert a == b and corpus_sample(rd, n=10, seed=2) != a
    examples = pd.read_parquet(rd.table("examples"))
    assert len(corpus_sample(rd, n=10_000)) == len(examples)  # at most the whole corpus


def test_the_most_common_last_token_is_the_same_on_every_build(tmp_path):
    """common_last_token_id: the most common last token of the key's trigger prefixes, ties to the lowest id
    (DuckDB's arg_max broke ties by chance: two builds of the demo run differed in 1,296 of 6,144 keys)."""
    import duckdb

    from ffkv.experiments.lookups import trigger_summaries

    rows = [(0, 0, 7), (0, 0, 3), (0, 0, 9), (0, 1, 5), (0, 1, 2), (0, 1, 5), (1, 0, 4), (1, 0, 1)]
    db = tmp_path / "explorer.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE triggers (layer SMALLINT, key INTEGER, rank SMALLINT, direction TINYINT, "
                "coefficient REAL, next_token_id INTEGER, last_token_id INTEGER)")
    con.executemany("INSERT INTO triggers VALUES (?, ?, ?, 1, 1.0, 0, ?)",
                    [(layer, key, rank, token) for rank, (layer, key, token) in enumerate(rows)])
    con.close()
    got = [trigger_summaries(db, "triggers", {0: 2, 1: 2}, False)[1].sort_values(["layer", "key"]) for _ in range(5)]
    assert got[0][["layer", "key", "common_last_token_id"]].values.tolist() == [[0, 0, 3], [0, 1, 5], [1, 0, 1]]
    np.testing.assert_allclose(got[0]["shallow_share"], [1 / 3, 2 / 3, 0.5], rtol=1e-6)
    assert all(g.equals(got[0]) for g in got)


def test_trigger_summaries_read_the_neurons_positive_rows_and_every_latent_row(tmp_path):
    """One query for both tables: a neuron's rows of direction -1 are not its trigger examples, a latent's table has
    no direction; the top-1 row's trigger target lands at its key (-1 where a key has none)."""
    import duckdb

    from ffkv.experiments.lookups import trigger_summaries

    db = tmp_path / "explorer.duckdb"
    con = duckdb.connect(str(db))
    for table, direction in (("triggers", "direction TINYINT, "), ("latent_triggers", "")):
        con.execute(f"CREATE TABLE {table} (layer SMALLINT, key INTEGER, rank SMALLINT, {direction}"
                    "coefficient REAL, next_token_id INTEGER, last_token_id INTEGER)")
    # layer, key, rank, direction, coefficient, next token, last token
    rows = [(0, 1, 0, 1, 3.0, 11, 5), (0, 1, 1, 1, 2.0, 12, 6), (0, 1, 0, -1, -4.0, 13, 6), (0, 1, 1, -1, -3.0, 14, 6),
            (2, 0, 0, 1, 1.5, 15, 7)]
    con.executemany("INSERT INTO triggers VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    con.executemany("INSERT INTO latent_triggers VALUES (?, ?, ?, ?, ?, ?)",
                    [(0, 1, 0, 3.0, 11, 5), (0, 1, 1, 2.0, 12, 6), (0, 1, 2, 1.0, 13, 6)])
    con.close()
    top1, neurons = trigger_summaries(db, "triggers", {0: 3, 2: 2}, False)
    assert {layer: t.tolist() for layer, t in top1.items()} == {0: [-1, 11, -1], 2: [15, -1]}
    neurons = neurons.sort_values(["layer", "key"]).reset_index(drop=True)
    assert neurons[["layer", "key", "common_last_token_id", "n_triggers"]].values.tolist() == [[0, 1, 5, 2], [2, 0, 7, 1]]
    assert neurons["shallow_share"].tolist() == [0.5, 1.0] and neurons["top_coefficient"].tolist() == [3.0, 1.5]
    top1, latents = trigger_summaries(db, "latent_triggers", {0: 2}, True)  # an encoder's target: the trigger token
    assert top1[0].tolist() == [-1, 5]
    assert latents[["common_last_token_id", "n_triggers", "top_coefficient"]].values.tolist() == [[6, 3, 3.0]]
    assert latents["shallow_share"].tolist() == pytest.approx([2 / 3])
    with pytest.raises(ValueError, match="no trigger table"):
        trigger_summaries(db, "texts", {}, False)


def test_the_stored_window_never_exceeds_max_cells():
    """`trigger_contexts.window_for`: WINDOW while the rows' windows fit MAX_CELLS, else the widest window that
    does (at least MIN_BEFORE tokens before the trigger and the one after it), none beyond MAX_ROWS; the stored
    cells, at most rows x its width, never exceed MAX_CELLS (the disk bound: MAX_CELLS x 2 bytes in float16)."""
    from ffkv.experiments import trigger_contexts as tc

    before, after = tc.WINDOW
    assert tc.window_for(0) == tc.WINDOW
    assert tc.window_for(tc.MAX_CELLS // (before + after + 1)) == tc.WINDOW
    assert tc.MAX_ROWS * (tc.MIN_BEFORE + 2) <= tc.MAX_CELLS
    widths = []
    for rows in [1_000_000, 1_840_000, 2_300_000, 4_608_000, 5_000_000, tc.MAX_ROWS]:
        b, a = tc.window_for(rows)
        assert rows * (b + a + 1) <= tc.MAX_CELLS, rows
        assert tc.MIN_BEFORE <= b <= before and 1 <= a <= after, (rows, b, a)
        widths.append(b + a + 1)
    assert widths == sorted(widths, reverse=True)  # more rows, a narrower window
    assert tc.window_for(4_608_000) == (10, 2)  # SmolLM2 on 300 WikiText lines at the default top-50: 13 tokens
    assert tc.window_for(tc.MAX_ROWS + 1) is None


def test_an_index_of_more_than_max_rows_locates_its_strongest_ranks():
    """`trigger_contexts.located_ranks`: every rank while the whole table gets a window; else the most leading ranks
    whose rows do (Llama-3.1-8B's shape: 32 x 14,336 keys x 2 directions a rank, top-100, 92M rows: 6 ranks, 5.5M
    rows, in a window of 10 tokens); none where rank 0's rows alone are too many."""
    from ffkv.experiments import trigger_contexts as tc

    assert tc.located_ranks([]) == 0 and tc.located_ranks([100] * 5) == 5
    assert tc.located_ranks([tc.MAX_ROWS // 2] * 2) == 2
    assert tc.located_ranks([tc.MAX_ROWS // 2] * 2 + [1]) == 2
    per_rank = 32 * 14_336 * 2
    assert tc.located_ranks([per_rank] * 100) == 6
    assert tc.window_for(6 * per_rank) == (7, 2) and 6 * per_rank * 10 <= tc.MAX_CELLS
    assert tc.located_ranks([tc.MAX_ROWS + 1, 5]) == 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_tokens_multiply_adds_count_the_blocks_matrices(family):
    """`trigger_contexts.token_macs`: one multiply-add per weight of each block's attention projections and FF
    matrices (a tiny GPT-2's, and a gated Llama's whose query heads share key and value heads), plus a dictionary's
    encoder."""
    from ffkv.experiments.trigger_contexts import token_macs
    from support.helpers import loaded_tiny

    loaded = loaded_tiny(family)
    view = loaded.view
    d, d_m, kv = view.d_model, view.d_m, loaded.model.config.num_key_value_heads if family == "llama" else None
    attention = 4 * d * d if kv is None else 2 * d * d + 2 * d * kv * (d // loaded.model.config.num_attention_heads)
    matrices = [attention + (3 if view.gated else 2) * d * d_m] * view.n_layers
    assert token_macs(view, view.n_layers) == sum(matrices)
    assert token_macs(view, 2, latents=37) == sum(matrices[:2]) + 37 * view.d_model


def test_a_pages_multiply_adds_are_the_costliest_tenths_examples(analyzed):
    """`trigger_contexts.page_macs`: the 90th percentile over the memories of their trigger examples' tokens (both
    directions, whole examples), against the run's own tables."""
    from ffkv.experiments.trigger_contexts import page_macs

    run, _ = analyzed
    rd = RunDir(run)
    te = pd.read_parquet(run / "trigger_examples.parquet")
    lengths = pd.read_parquet(run / "examples.parquet").set_index("example_id")["token_ids"].map(len)
    te["tokens"] = te["example_id"].map(lengths)
    per_memory = te.groupby(["layer", "key"])["tokens"].sum().to_numpy(dtype=np.float64)
    assert page_macs(rd.cache_dir / "explorer.duckdb", 3.0) == pytest.approx(3.0 * np.quantile(per_memory, 0.9))


def test_a_small_models_pages_compute_their_own_coefficients(fresh_run):
    """A model whose pages cost at most `LIVE_MACS` (a tiny GPT-2's: well under 1G) gets no coefficient file: the
    lookups say why, and a memory page's per-token coefficients equal the model's, captured over each example alone."""
    from ffkv.experiments import trigger_contexts
    from ffkv.explorer.data import ExplorerData

    run, loaded = fresh_run
    rd = RunDir(run)
    (rd.cache_dir / lookups.INFO).unlink()  # built again, with the build's own rule
    data = ExplorerData(run, loaded)
    try:
        info = lookups.read_info(rd.cache_dir)["trigger_coefficients"]
        assert info["file"] is None and 0 < info["page_macs"] <= trigger_contexts.LIVE_MACS
        assert not (rd.cache_dir / lookups.COEFFICIENTS).exists()
        examples = pd.read_parquet(run / "examples.parquet").set_index("example_id")["token_ids"]
        view = loaded.view
        for layer, key in [(0, 3), (2, 11)]:
            page = data.memory(layer, key)
            assert page["window"] is None
            for group in page["triggers"]:
                for shown in group["examples"]:
                    ids = torch.tensor([list(examples[shown["example_id"]])])
                    with view.capture(("coefficients",), layers=[layer]) as cap:
                        view.forward(ids)
                    m = cap["coefficients"][layer][0, :, key].double().numpy()
                    first = shown["first"]
                    got = np.array([t["m"] for t in shown["tokens"] if not t.get("gap")], dtype=np.float64)
                    np.testing.assert_allclose(got, m[first:first + len(got)], rtol=1e-4, atol=1e-5)
    finally:
        data.close()
