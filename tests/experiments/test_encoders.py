"""Masked-LM encoders (SPEC section 9): known answers on tiny BERT and RoBERTa built from configs.

The values experiment compares each value's decoder projection with the token *at* the trigger position;
the held-out figures run at a masked position with the MLM head's prediction there; the experiments that do
not carry over are skipped and the report says which figures apply."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from support.experiment_runs import make_run
from ffkv.experiments import EXPERIMENTS, analyze
from ffkv.experiments.common import RunContext, eval_spec, mask_token_id
from ffkv.report import write_report
from ffkv.store.run import RunDir

FAMILIES = ["bert", "roberta"]


def _top_trigger_tokens(run) -> pd.DataFrame:
    """layer, key, the token at the top trigger's position and the next token, read from the run's files."""
    trig = pd.read_parquet(run / "trigger_examples.parquet")
    trig = trig[(trig["rank"] == 0) & (trig.get("direction", 1) == 1)]
    examples = pd.read_parquet(run / "examples.parquet").set_index("example_id")["token_ids"]
    at = [int(examples[e][p]) for e, p in zip(trig["example_id"], trig["position"])]
    return trig.assign(at_position=at)[["layer", "key", "at_position", "next_token_id"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_planted_values_agree_with_the_token_at_the_trigger_position(tmp_path, family):
    run, loaded = make_run(tmp_path, family, n=60, top_k=5)
    view = loaded.view
    E = view.unembedding.detach().clone()
    first = _top_trigger_tokens(run)
    layer = 1
    planted = first[first["layer"] == layer]
    with torch.no_grad():
        for key, token in zip(planted["key"], planted["at_position"]):
            view.values(layer)[int(key)] = E[int(token)]  # v_i = the decoder row of the trigger token
    assert torch.equal(view.values(layer)[int(planted["key"].iloc[0])], E[int(planted["at_position"].iloc[0])])
    # Brute force: the decoder projection v·Eᵀ (no transform, no bias) ranks the planted token first?
    En = E.double().numpy()
    hits = np.array([int(np.argmax(En @ En[t])) == t for t in planted["at_position"]])
    next_hits = np.array([int(np.argmax(En @ En[t])) == n for t, n in zip(planted["at_position"],
                                                                          planted["next_token_id"])])
    assert hits.mean() > 0.5 and hits.mean() > next_hits.mean()  # the test can tell the two targets apart
    analyze(run, only="values", loaded=loaded, progress=False)
    table = RunDir(run).read_metric("values")
    row = table[table["layer"] == layer].iloc[0]
    assert row["n_keys_with_target"] == len(planted)
    assert row["agreement_rate"] == pytest.approx(hits.mean())
    assert "token at the trigger position" in RunDir(run).metric_description("values")["target"]


@pytest.mark.parametrize("family", FAMILIES)
def test_held_out_figures_run_at_the_masked_position(tmp_path, family):
    run, loaded = make_run(tmp_path, family, n=60, top_k=5)
    analyze(run, only="refinement", loaded=loaded, n_eval=12, progress=False)
    r = RunDir(run)
    ctx = RunContext(r, r.require_complete(), loaded, progress=False, eval_spec=eval_spec(r.manifest(), n_eval=12))
    held = ctx.held_out()
    examples = r.read_metric("refinement_examples")
    examples = examples[examples["layer"] == 0].set_index("example_id")
    mask = mask_token_id(loaded.tokenizer)
    assert mask is not None
    for e, j in zip(held.examples, held.positions):
        ids = torch.as_tensor(np.asarray(e.token_ids, dtype=np.int64))
        gold = int(ids[j])
        ids[j] = mask
        with torch.no_grad():
            logits = loaded.view.model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None]).logits[0, j]
        row = examples.loc[e.example_id]
        assert int(row["position"]) == int(j)
        assert int(row["target_id"]) == gold  # the masked token, not the next one
        assert int(row["final_id"]) == int(logits.argmax())  # the MLM head's prediction at the mask


@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_report_states_which_figures_apply(tmp_path, family):
    run, loaded = make_run(tmp_path, family, n=50, top_k=5)
    done = analyze(run, loaded=loaded, n_eval=15, progress=False)
    assert list(done) == list(EXPERIMENTS)
    assert "not applicable to a masked-LM encoder" in done["ablations"]["skipped"]
    assert not (run / "metrics" / "ablations.parquet").exists()  # nothing computed for it
    for name in ("patterns", "values", "composition", "refinement"):
        assert (run / "metrics" / f"{name}.parquet").exists()
    table = RunDir(run).read_metric("encoder_applicability").set_index("experiment")
    assert not table.loc["ablations", "applies"] and table.loc["values", "applies"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert "skipped" in manifest["analyses"]["ablations"]
    html = write_report(run).read_text()
    assert "Which figures apply to this masked-LM encoder" in html
    assert "Figure 3" in html and "not computed" in html


def test_causal_models_write_no_applicability_table(tmp_path):
    run, loaded = make_run(tmp_path, "gpt2", n=30, top_k=3)
    analyze(run, only="values", loaded=loaded, progress=False)
    assert not (run / "metrics" / "encoder_applicability.parquet").exists()
