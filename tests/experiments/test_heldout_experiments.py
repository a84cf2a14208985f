"""Composition (SPEC 7) and refinement (SPEC 8) against an independent per-example recomputation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from support.experiment_runs import make_run
from ffkv.experiments import analyze
from ffkv.experiments.common import choose_position
from ffkv.store.run import RunDir
from ffkv.memories.projection import logits


#: tau of the active rule per family, by hand: GELU (gpt2, gpt_neox) and SiLU-gated (llama) coefficients go
#: negative, OPT's ReLU ones do not (active is then m_i > 0).
TAU = {"gpt2": 0.1, "gpt_neox_parallel": 0.1, "opt": 0.0, "llama": 0.1}


def brute_force(loaded, run, values_proj, resid_proj, tau):
    """Each held-out prefix alone, unpadded; s_l the RMS of every coefficient at the analysed positions;
    every active (|m_i| > tau·s_l) signed sub-update projected on its own; o from the HF logits."""
    view = loaded.view
    comp = pd.read_parquet(run / "metrics" / "composition_examples.parquet")
    examples = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    captured = []
    for (eid, pos), _ in comp.groupby(["example_id", "position"], sort=False):
        ids = [int(t) for t in examples.at[eid, "token_ids"]]
        x = torch.tensor([ids[: pos + 1]])
        with view.capture(("coefficients", "resid_mid", "ff_out", "resid_post")) as cap:
            view.forward(x, torch.ones_like(x))
        o = int(loaded.model(input_ids=x).logits[0, -1].argmax())
        captured.append((eid, o, {k: {layer: v[layer][0, -1] for layer in range(view.n_layers)} for k, v in cap.items()}))
    scale = [float(torch.stack([c["coefficients"][layer] for _, _, c in captured]).pow(2).mean().sqrt())
             for layer in range(view.n_layers)]
    rows = []
    for eid, o, cap in captured:
        for layer in range(view.n_layers):
            m = cap["coefficients"][layer]
            ff = int(logits(view, cap["ff_out"][layer], values_proj).argmax())
            post_v = int(logits(view, cap["resid_post"][layer], values_proj).argmax())
            active = torch.nonzero(m.abs() > tau * scale[layer])[:, 0]
            subs = [int(logits(view, m[i] * view.values(layer)[i], values_proj).argmax()) for i in active]
            z_mid = logits(view, cap["resid_mid"][layer], resid_proj)
            rows.append({"example_id": eid, "layer": layer, "n_active": len(active),
                         "n_positive": int((m[active] > 0).sum()), "n_negative": int((m[active] < 0).sum()),
                         "ff_top_id": ff, "ff_matches_memory": ff in subs, "resid_post_matches_memory": post_v in subs,
                         "resid_top_id": int(z_mid.argmax()), "final_id": o,
                         "f_top_id": int(logits(view, cap["ff_out"][layer], resid_proj).argmax()),
                         "confidence": float(torch.softmax(z_mid, -1)[o]),
                         "post_top_id": int(logits(view, cap["resid_post"][layer], resid_proj).argmax())})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("family,projection", [("gpt2", None), ("gpt_neox_parallel", None), ("opt", "final-norm"),
                                               ("llama", None), ("llama", "paper")])
def test_equals_brute_force(tmp_path, family, projection):
    run, loaded = make_run(tmp_path, family, n=60)
    analyze(run, only="composition,refinement", loaded=loaded, n_eval=24, projection=projection, progress=False)
    pv = "identity" if projection in (None, "paper") else projection
    pr = {None: "final-norm", "paper": "identity"}.get(projection, projection)
    expected = brute_force(loaded, run, pv, pr, TAU[family])
    comp = pd.read_parquet(run / "metrics" / "composition_examples.parquet")
    ref = pd.read_parquet(run / "metrics" / "refinement_examples.parquet").rename(columns={"ff_top_id": "f_top_id"})
    assert len(comp) == len(expected) > 0
    got = comp.merge(ref, on=["example_id", "position", "layer"])
    assert len(got) == len(expected)
    for column in ("n_active", "n_positive", "n_negative", "ff_top_id", "ff_matches_memory",
                   "resid_post_matches_memory", "resid_top_id", "f_top_id", "post_top_id", "final_id"):
        np.testing.assert_array_equal(got[column], expected[column], err_msg=column)
    np.testing.assert_allclose(got["confidence"], expected["confidence"], atol=1e-5)
    if TAU[family] == 0:
        assert (got["n_negative"] == 0).all()
    else:
        assert got["n_negative"].sum() > 0 and got["n_positive"].sum() > 0
    # Per-layer rates are the means of the per-example table.
    per_layer = pd.read_parquet(run / "metrics" / "composition.parquet")
    np.testing.assert_allclose(per_layer["composition_rate"],
                               1 - expected.groupby("layer")["ff_matches_memory"].mean().to_numpy())
    np.testing.assert_allclose(per_layer["mean_active"], expected.groupby("layer")["n_active"].mean().to_numpy())
    np.testing.assert_allclose(per_layer["mean_negative"], expected.groupby("layer")["n_negative"].mean().to_numpy())
    assert (per_layer["composition_rate_ci_low"] <= per_layer["composition_rate"]).all()
    assert (per_layer["composition_rate"] <= per_layer["composition_rate_ci_high"]).all()
    refinement = pd.read_parquet(run / "metrics" / "refinement.parquet")
    agree = (expected["resid_top_id"] == expected["final_id"]).groupby(expected["layer"]).mean()
    np.testing.assert_allclose(refinement["residual_agreement"], agree.to_numpy())
    # Figure 11: r, f and y all under the one residual projection.
    r, f, y = expected["resid_top_id"], expected["f_top_id"], expected["post_top_id"]
    kept = (y == r).groupby(expected["layer"]).mean()
    override = ((y == f) & (y != r)).groupby(expected["layer"]).mean()
    np.testing.assert_allclose(refinement["kept"], kept.to_numpy())
    np.testing.assert_allclose(refinement["override"], override.to_numpy())
    np.testing.assert_allclose(refinement["kept"] + refinement["override"] + refinement["composition"], 1.0)
    meta = RunDir(run).metric_description("refinement")
    assert meta["residual_projection"] == pr and meta["ff_out_projection"] == pr
    assert RunDir(run).metric_description("composition")["projection"] == pv
    # Both residual projections are in refinement_projections; the chosen one equals refinement.parquet.
    both = pd.read_parquet(run / "metrics" / "refinement_projections.parquet")
    assert set(both["choice"]) == {"default", "paper"}
    mine = both[both["projection"] == pr].reset_index(drop=True)
    np.testing.assert_allclose(mine["kept"], refinement["kept"])
    np.testing.assert_allclose(mine["residual_agreement"], refinement["residual_agreement"])


def test_zeroed_ff_layer_keeps_the_residual_everywhere(tmp_path):
    run, loaded = make_run(tmp_path, "gpt2", n=60)
    down = loaded.view.arch.down_proj(loaded.view.blocks[1])
    with torch.no_grad():
        down.weight.zero_()
        down.bias.zero_()
    analyze(run, only="refinement", loaded=loaded, n_eval=40, progress=False)
    per_layer = pd.read_parquet(run / "metrics" / "refinement.parquet")
    examples = pd.read_parquet(run / "metrics" / "refinement_examples.parquet")
    assert per_layer.loc[1, "kept"] == 1.0 and per_layer.loc[1, "override"] == 0.0
    assert (examples.loc[examples["layer"] == 1, "category"] == "kept").all()
    assert per_layer.loc[0, "kept"] < 1.0 or per_layer.loc[2, "kept"] < 1.0  # the others do change something


def test_last_layer_cases_and_positions(tmp_path):
    run, loaded = make_run(tmp_path, "gpt2", n=60)
    analyze(run, only="refinement", loaded=loaded, n_eval=40, progress=False)
    cases = pd.read_parquet(run / "metrics" / "refinement_last_layer.parquet")
    examples = pd.read_parquet(run / "metrics" / "refinement_examples.parquet")
    last = examples[examples["layer"] == examples["layer"].max()]
    changed = last[last["post_top_id"] != last["resid_top_id"]]
    assert len(cases) == min(50, len(changed))
    assert set(cases["example_id"]) <= set(changed["example_id"])
    assert (cases["layer_top_id"] != cases["residual_top_id"]).all()
    # One seeded position per example, a function of the example alone.
    stored = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    special = loaded.tokenizer.special_ids
    for eid, pos in last[["example_id", "position"]].itertuples(index=False):
        ids = np.asarray(stored.at[eid, "token_ids"])
        assert pos == choose_position(ids, special, 0, eid, encoder=False)
        assert pos < len(ids) - 1


def test_final_prediction_includes_the_head_bias(tmp_path):
    # GPT-J's LM head has a bias: o must be the model's own argmax, not the bias-free logit lens.
    run, loaded = make_run(tmp_path, "gptj", n=40)
    with torch.no_grad():
        loaded.view.unembedding_bias.zero_()
        loaded.view.unembedding_bias[7] = 1e4
    analyze(run, only="refinement", loaded=loaded, n_eval=20, progress=False)
    examples = pd.read_parquet(run / "metrics" / "refinement_examples.parquet")
    assert (examples["final_id"] == 7).all()
