"""Local modifications (SPEC 5): every modified coefficient against a lone, unpadded recomputation."""

from __future__ import annotations

import numpy as np
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
