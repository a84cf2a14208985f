"""The explorer's lookup tables that `ffkv analyze` builds agree with brute-force computations on the run."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ffkv.experiments import EXPERIMENTS
from ffkv.experiments.lookups import HISTOGRAM_BINS, activation_stats, corpus_sample, sample_batches
from ffkv.store import lookups
from ffkv.store.run import RunDir


def test_analyze_builds_current_lookup_tables(analyzed):
    run, _ = analyzed
    assert "lookups" in EXPERIMENTS
    rd = RunDir(run)
    assert lookups.find(rd, rd.manifest()) == rd.cache_dir
    info = lookups.read_info(rd.cache_dir)
    assert info["activation_sample"]["examples"] == len(corpus_sample(rd))


def test_activation_histogram_and_frequency_match_brute_force(analyzed):
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
    assert lookups.read_info(rd.cache_dir)["activation_sample"]["positions"] == positions
    for layer, key in [(0, 0), (1, 7), (2, 39)]:
        m = torch.cat(every[layer])[:, key].numpy()
        row = stats.loc[(layer, key)]
        assert row.activation_frequency == np.float32((m > 0).mean())
        assert np.isclose(row.activation_lo, m.min(), rtol=1e-5) and np.isclose(row.activation_hi, m.max(), rtol=1e-5)
        counts, _ = np.histogram(m, bins=HISTOGRAM_BINS, range=(float(row.activation_lo), float(row.activation_hi)))
        assert sum(row.activation_histogram) == positions
        # Bins agree up to values on an edge (float32 edges against float64 values).
        assert np.abs(np.asarray(row.activation_histogram) - counts).sum() <= 2


def test_padding_is_never_counted(analyzed):
    _, loaded = analyzed
    alone = activation_stats(loaded, sample_batches(loaded, [[5, 6, 7, 8]]))
    padded = activation_stats(loaded, sample_batches(loaded, [[5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12, 13]]))
    longer = activation_stats(loaded, sample_batches(loaded, [[5, 6, 7, 8, 9, 10, 11, 12, 13]]))
    assert alone["positions"] == 4 and padded["positions"] == 13
    np.testing.assert_allclose(padded["frequency"] * 13, alone["frequency"] * 4 + longer["frequency"] * 9, atol=1e-4)


def test_corpus_sample_is_seeded_and_spans_the_corpus(analyzed):
    run, _ = analyzed
    rd = RunDir(run)
    a, b = corpus_sample(rd, n=10, seed=1), corpus_sample(rd, n=10, seed=1)
    assert a == b and corpus_sample(rd, n=10, seed=2) != a
    examples = pd.read_parquet(rd.table("examples"))
    assert len(corpus_sample(rd, n=10_000)) == len(examples)  # at most the whole corpus
