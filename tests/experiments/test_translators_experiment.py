"""The translators experiment on tiny runs: KL-to-final against a one-example-at-a-time brute force, the three
projections side by side from the experiments' own code, the translators saved with what they were fitted on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from support.experiment_runs import make_run
from ffkv.experiments import analyze
from ffkv.experiments.common import RunContext, eval_spec, open_run
from ffkv.memories.translators import Translators
from ffkv.presentation.tables import table_view
from ffkv.report import write_report
from ffkv.store.run import RunDir


def _brute_kl(loaded, held, translators) -> dict[str, np.ndarray]:
    """Per projection, (L,) mean over examples of each example's mean KL over its positions: one example at a
    time, no padding, float64, the projections written out by hand."""
    view = loaded.view
    E = view.unembedding.double()
    L = view.n_layers
    out = {name: np.zeros((len(held.examples), L)) for name in ("identity", "final-norm", "translator")}
    for i, e in enumerate(held.examples):
        ids = torch.as_tensor(np.asarray(e.token_ids, dtype=np.int64))[None]
        with view.capture(("resid_mid", "head_in")) as cap:
            view.forward(ids, torch.ones_like(ids), with_head=True)
        final = view.final_logits(cap["head_in"][-1][0]).double()
        logp = torch.log_softmax(final, -1)
        for layer in range(L):
            h = cap["resid_mid"][layer][0]
            a, b = translators.weight[layer].double(), translators.bias[layer].double()
            zs = {"identity": h.double() @ E.T, "final-norm": view.final_norm(h).double() @ E.T,
                  "translator": view.final_norm((h.double() @ a.T + b).float()).double() @ E.T}
            for name, z in zs.items():
                logq = torch.log_softmax(z, -1)
                out[name][i, layer] = float((logp.exp() * (logp - logq)).sum(-1).mean())
    return {name: v.mean(0) for name, v in out.items()}


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_translators_experiment(tmp_path, family):
    run, loaded = make_run(tmp_path, family, n=60, top_k=5)
    done = analyze(run, only="translators,refinement", loaded=loaded, n_eval=15, progress=False)
    assert list(done) == ["translators", "refinement"]
    r = RunDir(run)
    saved = Translators.load(run / "translators" / "translators.npz")
    assert saved.weight.shape == (loaded.view.n_layers, loaded.view.d_model, loaded.view.d_model)
    assert saved.info["fitted_on"]["n_examples"] == len(pd.read_parquet(run / "examples.parquet"))
    assert saved.info["final_norm_after_translator"] is True
    assert json.loads((run / "translators" / "translators.json").read_text())["epochs"] == saved.info["epochs"]
    assert not torch.equal(saved.weight, Translators.identity(loaded.view.n_layers, loaded.view.d_model).weight)

    # KL-to-final against the brute force, every projection and layer.
    manifest = r.require_complete()
    ctx = RunContext(r, manifest, loaded, progress=False, eval_spec=eval_spec(manifest, n_eval=15))
    brute = _brute_kl(loaded, ctx.held_out(), saved)
    kl = r.read_metric("translators")
    for name, expected in brute.items():
        got = kl[kl["projection"] == name].sort_values("layer")["kl"].to_numpy()
        np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-5)
    assert (kl["kl_ci_low"] <= kl["kl"]).all() and (kl["kl"] <= kl["kl_ci_high"]).all()
    assert "kl (95% CI)" in [c.title for c in table_view(kl).columns]  # the interval reads in its value's cell
    assert set(kl["n_examples"]) == {15}

    # Side by side: the identity and final-norm rows are refinement's own numbers (one code path).
    spaces = r.read_metric("translators_spaces")
    assert set(spaces["projection"]) == {"identity", "final-norm", "translator"}
    both = r.read_metric("refinement_projections")
    for name in ("identity", "final-norm"):
        mine = spaces[spaces["projection"] == name].sort_values("layer")
        theirs = both[both["projection"] == name].sort_values("layer")
        for column in ("residual_agreement", "mean_confidence", "kept", "override", "composition"):
            np.testing.assert_allclose(mine[column].to_numpy(), theirs[column].to_numpy())
    findings = r.read_metric("translators_findings")
    assert {"Figure 4", "Figure 9"} <= set(findings["figure"])
    assert findings["changes_under_translator"].dtype == bool
    for fmt in ("png", "svg"):
        assert (run / "figures" / f"translators_kl.{fmt}").stat().st_size > 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["analyses"]["translators"]["file"] == "translators/translators.npz"
    html = write_report(run).read_text()
    assert "Projection spaces: fitted per-layer translators" in html and "changes under translator" in html
    # Every table and column is documented (docs/run-directory.md), as tests/store/test_docs.py checks for the rest.
    docs = (Path(__file__).resolve().parents[2] / "docs" / "run-directory.md").read_text()
    sections = re.split(r"^### metrics/(\w+)\.parquet\s*$", docs, flags=re.M)
    documented = {name: body.split("\n## ")[0] for name, body in zip(sections[1::2], sections[2::2])}
    for name in ("translators", "translators_spaces", "translators_findings") + (
            ("encoder_applicability",) if family == "bert" else ()):
        for column in r.read_metric(name).columns:
            assert f"`{column}`" in documented[name], (name, column)


def test_translators_are_not_run_by_default(tmp_path):
    run, loaded = make_run(tmp_path, "gpt2", n=30, top_k=3)
    done = analyze(run, only=None, loaded=loaded, n_eval=5, progress=False)
    assert "translators" not in done and not (run / "translators").exists()
