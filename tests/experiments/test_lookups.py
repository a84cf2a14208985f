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
    assert view.signed  # a GELU model: the signed rule, not m > 0
    for layer, key in [(0, 0), (1, 7), (2, 39)]:
        all_m = torch.cat(every[layer])
        s_l = float(all_m.square().mean().sqrt())  # the RMS of every coefficient of the layer over the sample
        m = all_m[:, key].numpy()
        row = stats.loc[(layer, key)]
        assert row.activation_frequency == pytest.approx((np.abs(m) > ACTIVE_FRACTION * s_l).mean(), abs=1e-6)
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
    padded = activation_stats(loaded, sample_batches(loaded, examples))  # one batch, the first example padded
    assert padded["positions"] == 13
    for layer in range(view.n_layers):  # brute force over the 13 real positions, each example alone
        parts = []
        for ids in examples:
            with view.capture(("coefficients",)) as cap:
                view.forward(torch.tensor([ids]))
            parts.append(cap["coefficients"][layer][0].double())
        m = torch.cat(parts)
        expected = (m.abs() > ACTIVE_FRACTION * float(m.square().mean().sqrt())).double().mean(0).numpy()
        np.testing.assert_allclose(padded["frequency"][layer], expected, atol=1e-6)
        assert padded["histogram"][layer].sum(-1).tolist() == [13] * view.d_m


def test_corpus_sample_is_seeded_and_spans_the_corpus(analyzed):
    run, _ = analyzed
    rd = RunDir(run)
    a, b = corpus_sample(rd, n=10, seed=1), corpus_sample(rd, n=10, seed=1)
    assert a == b and corpus_sample(rd, n=10, seed=2) != a
    examples = pd.read_parquet(rd.table("examples"))
    assert len(corpus_sample(rd, n=10_000)) == len(examples)  # at most the whole corpus
