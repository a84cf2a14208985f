"""Suppressed memories (SPEC section 9) against a brute-force computation on tiny random models.

Brute force: each held-out example alone through the model with every captured tensor kept; at its
seeded position, every active memory's signed sub-update m_i·v_i projected on its own, its top token
compared with the gold token, and p(resid_mid + m_i·v_i)[gold] - p(resid_mid)[gold] computed directly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from support.experiment_runs import make_run
from support.helpers import loaded_tiny
from support.runs import sharpen
from ffkv.experiments import analyze
from ffkv.experiments.common import RunContext, eval_spec, open_run
from ffkv.memories.active import active_fraction
from ffkv.memories.projection import logits
from ffkv.store.run import RunDir


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_suppressed_rate_and_delta_p_equal_brute_force(tmp_path, family):
    loaded = sharpen(loaded_tiny(family, bos=(family == "llama")))
    run, loaded = make_run(tmp_path, family, n=120, loaded=loaded)
    analyze(run, only="suppressed", loaded=loaded, n_eval=60, progress=False)
    table = RunDir(run).read_metric("suppressed").set_index("layer")
    examples = RunDir(run).read_metric("suppressed_examples")
    _, manifest, _ = open_run(run, loaded)
    ctx = RunContext(RunDir(run), manifest, loaded, eval_spec=eval_spec(manifest, None, None, 60, 0), progress=False)
    held = ctx.held_out()
    view = loaded.view
    L = view.n_layers
    captured = []
    for e, j in zip(held.examples, held.positions):
        ids = torch.as_tensor(np.asarray(e.token_ids), dtype=torch.long)[None]
        with view.capture(("coefficients", "resid_mid")) as cap:
            view.forward(ids, torch.ones_like(ids))
        final = loaded.model(input_ids=ids).logits[0, j].float()
        captured.append(([cap["coefficients"][l][0, j].float() for l in range(L)],
                         [cap["resid_mid"][l][0, j].float() for l in range(L)], final))
    tau = active_fraction(view)
    scale = [math.sqrt(sum(float(c[0][l].double().square().sum()) for c in captured) / (len(captured) * view.d_m))
             for l in range(L)]
    wrong = np.array([int(c[2].argmax()) != int(g) for c, g in zip(captured, held.targets)])
    assert wrong.sum() > 0
    n_rows = 0
    for layer in range(L):
        knows, deltas = [], []
        for (m, mid, _), g, is_wrong in zip(captured, held.targets, wrong):
            m, mid = m[layer], mid[layer]
            active = torch.nonzero(m.abs() > tau * scale[layer])[:, 0]
            hits = []
            for i in active.tolist():
                sub = m[i] * view.values(layer)[i]
                if int(logits(view, sub[None], "identity")[0].argmax()) == int(g):
                    p0 = torch.softmax(logits(view, mid[None], "final-norm")[0], -1)[g]
                    p1 = torch.softmax(logits(view, (mid + sub)[None], "final-norm")[0], -1)[g]
                    hits.append(float(p1 - p0))
            if is_wrong:
                knows.append(bool(hits))
                deltas += hits
                n_rows += bool(hits)
        row = table.loc[layer]
        assert row["n_wrong"] == wrong.sum() and row["n_correct"] == (~wrong).sum()
        assert row["suppressed_rate"] == pytest.approx(np.mean(knows))
        assert row["n_knowing_memories"] == len(deltas)
        if deltas:
            assert row["mean_delta_p"] == pytest.approx(np.mean(deltas), rel=1e-3, abs=1e-6)
        assert row["suppressed_rate_ci_low"] <= row["suppressed_rate"] <= row["suppressed_rate_ci_high"]
    assert len(examples) == min(n_rows, 200)
    assert (examples["gold_id"] != examples["prediction_id"]).all()
    assert examples["delta_p"].is_monotonic_decreasing
    assert (RunDir(run).path / "figures" / "suppressed.png").is_file()
    meta = RunDir(run).metric_description("suppressed")
    assert meta["residual_projection"] == "final-norm" and "resid_mid + m_i·v_i" in meta["delta_p"]
