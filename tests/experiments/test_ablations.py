"""Local modifications (SPEC 5): every modified coefficient against a lone, unpadded recomputation."""

from __future__ import annotations

import numpy as np
import pytest
import pandas as pd
import torch

from support.experiment_runs import make_run
from ffkv.experiments import analyze
from ffkv.experiments.ablations import sample_keys


def coefficient(view, ids, layer, key):
    x = torch.tensor([list(ids)])
    with view.capture(("coefficients",), layers=[layer]) as cap:
        view.forward(x, torch.ones_like(x))
    return float(cap["coefficients"][layer][0, -1, key])


def test_ablations_equal_brute_force(tmp_path):
    run, loaded = make_run(tmp_path, "llama", n=50, top_k=4)  # llama: a BOS that must never be removed
    view, special = loaded.view, loaded.tokenizer.special_ids
    analyze(run, only="ablations", loaded=loaded, progress=False)
    got = pd.read_parquet(run / "metrics" / "ablations_prefixes.parquet")
    examples = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    trig = pd.read_parquet(run / "trigger_examples.parquet", filters=[("direction", "=", 1)])  # what the paper ablates
    chosen = sample_keys(view.n_layers, view.d_m, 10, 0)
    assert sorted(set(zip(got["layer"], got["key"]))) == sorted(chosen)
    assert len(got) == 3 * len(trig.merge(pd.DataFrame(chosen, columns=["layer", "key"])))
    for r in got.sample(n=60, random_state=0).itertuples():  # a sample keeps the suite fast
        prefix = [int(t) for t in examples.at[r.example_id, "token_ids"][: r.position + 1]]
        real = [i for i, t in enumerate(prefix) if t not in special]
        m = coefficient(view, prefix, r.layer, r.key)
        assert abs(r.coefficient - m) < 1e-5 and abs(r.stored_coefficient - m) < 1e-5
        if len(real) < 2:
            assert r.removed_index == -1 and np.isnan(r.relative_change)
            continue
        assert r.removed_index in real
        assert r.variant != "first" or r.removed_index == real[0]
        assert r.variant != "last" or r.removed_index == real[-1]
        modified = prefix[: r.removed_index] + prefix[r.removed_index + 1:]
        m2 = coefficient(view, modified, r.layer, r.key)
        assert abs(r.coefficient_modified - m2) < 1e-5
        if m > 0:
            assert abs(r.relative_change - (m2 - m) / m) < 1e-4
        else:
            assert np.isnan(r.relative_change)
    per_layer = pd.read_parquet(run / "metrics" / "ablations.parquet")
    for variant in ("first", "last", "random"):
        expect = got[got["variant"] == variant].groupby("layer")["relative_change"].mean()
        np.testing.assert_allclose(per_layer[f"mean_change_{variant}"], expect.reindex(range(view.n_layers)))
    assert (run / "figures" / "ablations.png").exists() and (run / "figures" / "ablations.svg").exists()


def test_latent_ablations_equal_brute_force_and_leave_the_neurons_tables_as_they_were(tmp_path):
    """A run indexed with a transcoder: each sampled latent's activation on its trigger prefixes and their
    modified copies equals the dictionary's encoding of the captured FF input at the prefix's last token, run
    alone; the sample is of latents that fired; the per-layer table's means and difference recount from the
    prefixes; the neurons' tables are byte-identical with and without the dictionary."""
    from ffkv.dictionaries import open_dictionary, save_sparsify
    from ffkv.experiments.ablations import VARIANTS
    from indexing.test_latents import DETECTOR_LAYER, _spec, detector_transcoder, token_local
    from indexing.test_exactness import write_corpus
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
    from support.helpers import loaded_tiny

    lines = write_corpus(tmp_path / "corpus.txt", n=40)
    assert lines
    loaded = token_local(loaded_tiny("gpt2"))  # a position's FF input is its token's alone
    d = detector_transcoder(loaded, "topk")  # latent i fires exactly where the token is PLANTED[i]
    folder = save_sparsify(d, tmp_path / "dicts" / f"h.{DETECTOR_LAYER}.mlp")
    d = open_dictionary(folder)[DETECTOR_LAYER]
    tables = {}
    for name, dictionary in (("with", folder), ("without", None)):
        build_index(loaded, _spec(tmp_path), tmp_path / name, IndexOptions(top_k=3, control_keys=0),
                    BatchOptions(batch_size=4), progress=False, dictionary=dictionary)
        analyze(tmp_path / name, only="ablations", loaded=loaded, progress=False)
        tables[name] = {t: (tmp_path / name / "metrics" / f"{t}.parquet") for t in
                        ("ablations", "ablations_prefixes", "ablations_latents", "ablations_latents_prefixes")}
    for t in ("ablations", "ablations_prefixes"):
        assert tables["with"][t].read_bytes() == tables["without"][t].read_bytes()
    assert not tables["without"]["ablations_latents"].exists()

    got = pd.read_parquet(tables["with"]["ablations_latents_prefixes"])
    fired = set(pd.read_parquet(tmp_path / "with" / "latent_trigger_examples.parquet")["key"])
    assert len(got) and set(got["key"]) <= fired and got["layer"].eq(DETECTOR_LAYER).all()
    examples = pd.read_parquet(tmp_path / "with" / "examples.parquet").set_index("example_id")
    view = loaded.view

    def activation(ids, key):
        x = torch.tensor([list(ids)])
        with torch.no_grad(), view.capture(("ff_in",), layers=[DETECTOR_LAYER]) as cap:
            view.forward(x, torch.ones_like(x))
        return float(d.encode(cap["ff_in"][DETECTOR_LAYER][0, -1:].float())[0, key])

    for r in got.sample(n=min(40, len(got)), random_state=0).itertuples():
        prefix = [int(t) for t in examples.at[r.example_id, "token_ids"][: r.position + 1]]
        a = activation(prefix, r.key)
        assert abs(r.coefficient - a) < 1e-5 and abs(r.stored_coefficient - a) < 1e-4
        if r.removed_index >= 0:
            a2 = activation(prefix[: r.removed_index] + prefix[r.removed_index + 1:], r.key)
            assert abs(r.coefficient_modified - a2) < 1e-5
    # Known answer: a detector reads its token alone, so removing any token but the last leaves a_j as it was, and
    # removing the last one (another token then ends the prefix) switches it off.
    judged = got[got["relative_change"].notna()]
    last = judged["variant"] == "last"
    assert (judged.loc[~last & (judged["removed_index"] < judged["position"]), "relative_change"].abs() < 1e-6).all()
    assert (judged.loc[last, "coefficient_modified"] == 0).mean() > 0.5
    beside = pd.read_parquet(tables["with"]["ablations_latents"])
    neurons = pd.read_parquet(tables["with"]["ablations"]).set_index("layer")
    assert list(beside["variant"]) == list(VARIANTS)
    for row in beside.itertuples():
        v = got.loc[got["variant"] == row.variant, "relative_change"].dropna()
        assert row.mean_change_latents == pytest.approx(v.mean()) and row.n_latents_prefixes == len(v)
        assert row.mean_change_neurons == neurons.at[DETECTOR_LAYER, f"mean_change_{row.variant}"]
        assert row.difference == pytest.approx(row.mean_change_latents - row.mean_change_neurons)
        assert row.ci_low <= row.difference <= row.ci_high
        if row.variant != "random":  # a random removal may take the last token too
            assert row.mean_change_latents < -0.5 if row.variant == "last" else row.mean_change_latents == 0, row


def test_each_batch_stops_at_its_deepest_layer_with_the_bits_of_a_whole_pass(tmp_path):
    """`coefficients_at_last` ends each batch after the deepest layer its rows read: its values equal, bit for bit,
    the same batches run through every layer, and the last block runs only for the batches that read it."""
    from ffkv.experiments.ablations import coefficients_at_last
    from ffkv.experiments.common import RunContext
    from ffkv.store.run import RunDir

    run, loaded = make_run(tmp_path, "llama", n=40, top_k=4)
    r = RunDir(run)
    ctx = RunContext(r, r.require_complete(), loaded, progress=False)
    view = loaded.view
    examples = pd.read_parquet(run / "examples.parquet")["token_ids"]
    rng = np.random.default_rng(0)
    long = [np.asarray(t) for t in examples if len(t) >= 6][:40]
    # short prefixes read at layer 0, whole examples at the last layer: batches by length keep most apart
    prefixes = [t[: 2 + i % 3] for i, t in enumerate(long)] + long
    last_layer = view.n_layers - 1
    layers = np.array([0] * 40 + [last_layer] * 40, dtype=np.int64)
    keys = rng.integers(0, view.d_m, size=80)
    calls = []
    hook = view.blocks[last_layer].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        got = coefficients_at_last(ctx, prefixes, layers, keys)
    finally:
        hook.remove()
    expect = np.full(80, np.nan)
    batches = list(ctx.batches(list(enumerate(prefixes))))
    for idx, batch in batches:
        with torch.no_grad(), view.capture(("coefficients",)) as cap:
            view.forward(batch.input_ids, batch.attention_mask)
        last = (batch.attention_mask.sum(-1) - 1).numpy()
        for j, i in enumerate(idx):
            expect[i] = float(cap["coefficients"][int(layers[i])][j, last[j], keys[i]])
    np.testing.assert_array_equal(got, expect)
    deep = sum(bool((layers[idx] == last_layer).any()) for idx, _ in batches)
    assert 0 < deep < len(batches) and len(calls) == deep
