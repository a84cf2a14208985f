"""A hand-built gated (Llama-style) model with planted negative memories: SPEC section 7 by hand.

In layers 1 and 2 (0-based) the gate and up projections have zero weights and chosen biases, so
every coefficient m_i = silu(b_g)·b_u_i is the same at every position; values are chosen on a
hand-set unembedding (row t of E is the unit vector e_t for t < 16, zero after), so each value's top
and bottom token and the FF output's top token are known:

layer 1: memory 0: m = +3,    v = e0 - 2·e1   (predicts 0)
         memory 1: m = -2,    v = e2 - 2·e3   (a negative memory: predicts v's bottom token, 3)
         memory 2: m = -0.05, v = e4 - 2·e5   (below 0.1 · RMS(m) = 0.057: not active)
         FF = 3·e0 - 6·e1 - 2·e2 + 4·e3 - 0.05·e4 + 0.1·e5: top token 3, which memory 1 predicts:
         no composition (the ReLU-era rule, m > 0 only, would call it one).
layer 2: memory 0: m = +1,    v = e0 + 0.9·e5 - 2·e9     (predicts 0)
         memory 1: m = -1,    v = -e1 - 0.9·e5 + 2·e10  (predicts its bottom token, 1)
         FF = e0 + e1 + 1.8·e5 - 2·e9 - 2·e10: top token 5, predicted by no active memory: composition.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf

from support.experiment_runs import make_run
from support.tiny_models import D, D_M, LAYERS, VOCAB
from ffkv.experiments import analyze
from ffkv.experiments.heldout import memory_predictions
from ffkv.memories.active import ACTIVE_FRACTION
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.store.run import RunDir
from support.helpers import CharTokenizer, replace_triggers

GATE_BIAS = 10.0
PLANTED = {1: [(0, 3.0, {0: 1.0, 1: -2.0}), (1, -2.0, {2: 1.0, 3: -2.0}), (2, -0.05, {4: 1.0, 5: -2.0})],
           2: [(0, 1.0, {0: 1.0, 5: 0.9, 9: -2.0}), (1, -1.0, {1: -1.0, 5: -0.9, 10: 2.0})]}


def planted_model() -> LoadedModel:
    config = tf.LlamaConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=D_M, max_position_embeddings=64, vocab_size=VOCAB, bos_token_id=1,
                            eos_token_id=2, mlp_bias=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    silu = GATE_BIAS * (1 / (1 + math.exp(-GATE_BIAS)))
    with torch.no_grad():
        head = torch.zeros(VOCAB, D)
        head[:D] = torch.eye(D)
        model.lm_head.weight.copy_(head)
        for layer, memories in PLANTED.items():
            mlp = model.model.layers[layer].mlp
            for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                lin.weight.zero_()
                lin.bias.zero_()
            mlp.gate_proj.bias.fill_(GATE_BIAS)
            for i, m, value in memories:
                mlp.up_proj.bias[i] = m / silu
                for j, x in value.items():
                    mlp.down_proj.weight[j, i] = x
    model.requires_grad_(False)
    return LoadedModel(model, CharTokenizer(bos=True), MemoryView(model), "tiny-llama-planted", "float32", "cpu")


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    loaded = planted_model()
    run, loaded = make_run(tmp_path_factory.mktemp("planted"), "llama", n=80, loaded=loaded)
    analyze(run, only="values,composition", loaded=loaded, n_eval=30, progress=False)
    return run, loaded


def test_a_gated_model_has_signed_coefficients():
    assert planted_model().view.signed


def test_the_negative_memory_predicts_its_values_bottom_token():
    view = planted_model().view
    m = torch.zeros(D_M)
    m[0], m[1] = 3.0, -2.0
    for projection in ("identity", "final-norm"):
        got = memory_predictions(view, 1, m, torch.tensor([0, 1]), projection)
        assert got.tolist() == [0, 3]  # memory 1's value tops at 2, bottoms at 3; m < 0 flips it


def test_active_counts_and_composition_by_hand(planted_run):
    run, _ = planted_run
    per_layer = pd.read_parquet(run / "metrics" / "composition.parquet").set_index("layer")
    examples = pd.read_parquet(run / "metrics" / "composition_examples.parquet")
    one, two = examples[examples["layer"] == 1], examples[examples["layer"] == 2]
    # Layer 1: memories 0 (+3) and 1 (-2) are active, memory 2 (-0.05 < 0.1·RMS) is not.
    rms = math.sqrt((3.0 ** 2 + 2.0 ** 2 + 0.05 ** 2) / D_M)
    assert per_layer.loc[1, "active_threshold"] == pytest.approx(ACTIVE_FRACTION * rms, rel=1e-4)
    assert (one["n_active"] == 2).all() and (one["n_positive"] == 1).all() and (one["n_negative"] == 1).all()
    assert (one["ff_top_id"] == 3).all() and one["ff_matches_memory"].all()
    assert per_layer.loc[1, "composition_rate"] == 0.0
    # Layer 2: one positive, one negative memory, and the FF output's top token (5) is neither's.
    assert (two["n_active"] == 2).all() and (two["n_negative"] == 1).all()
    assert (two["ff_top_id"] == 5).all() and not two["ff_matches_memory"].any()
    assert per_layer.loc[2, "composition_rate"] == 1.0
    n = int(per_layer.loc[2, "n_examples"])
    # The Wilson interval of n/n: (n / (n + z²), 1).
    assert per_layer.loc[2, "composition_rate_ci_low"] == pytest.approx(n / (n + 1.959963984540054 ** 2))
    assert per_layer.loc[2, "composition_rate_ci_high"] == 1.0
    # The matched token of layer 1 is memory 1's prediction.
    matches = pd.read_parquet(run / "metrics" / "composition_matches.parquet")
    got = matches[(matches["layer"] == 1) & (matches["variant"] == "ff_out")]
    assert got["token_id"].tolist() == [3]
    meta = RunDir(run).metric_description("composition")
    assert meta["active_tau"] == ACTIVE_FRACTION and "sign kept" in meta["memory_prediction"]
    assert np.isclose(meta["active_threshold"][1], ACTIVE_FRACTION * rms, rtol=1e-4)


def test_values_read_each_direction_apart(tmp_path):
    """A run indexed with both signs (the index's `direction` column): Figure 4 of the +1 rows does not move
    when the -1 rows change, and the -1 rows are compared with the top token of p(-v_i), i.e. the bottom
    token of v_i·Eᵀ, by brute force."""
    from support.experiment_runs import make_run as make
    from ffkv.memories.projection import logits

    run, loaded = make(tmp_path, "llama", n=60)
    te = pd.read_parquet(run / "trigger_examples.parquet")
    assert set(te["direction"]) == {1, -1}  # a gated model is indexed in both directions
    analyze(run, only="values", loaded=loaded, progress=False)
    before = pd.read_parquet(run / "metrics" / "values.parquet")
    # Plant agreement: the most negative trigger of every even key is followed by the value's bottom token.
    view = loaded.view
    bottoms = {layer: logits(view, view.values(layer), "identity").argmin(-1).numpy() for layer in range(view.n_layers)}
    planted = (te["direction"] == -1) & (te["rank"] == 0) & (te["key"] % 2 == 0)
    te.loc[planted, "next_token_id"] = np.array([bottoms[int(l)][int(k)] for l, k in zip(
        te.loc[planted, "layer"], te.loc[planted, "key"])], dtype=te["next_token_id"].dtype)
    replace_triggers(run, te)
    analyze(run, only="values", loaded=loaded, progress=False)
    after = pd.read_parquet(run / "metrics" / "values.parquet")
    pd.testing.assert_frame_equal(before, after)  # the +1 direction alone, untouched by the -1 rows
    negative = te[te["direction"] == -1]
    got = pd.read_parquet(run / "metrics" / "values_negative.parquet")
    view = loaded.view
    first = negative[negative["rank"] == 0]
    for layer in range(view.n_layers):
        rows = first[(first["layer"] == layer) & (first["next_token_id"] >= 0)]
        bottom = logits(view, view.values(layer), "identity").argmin(-1).numpy()
        expected = (bottom[rows["key"].to_numpy()] == rows["next_token_id"].to_numpy()).mean()
        assert got.loc[layer, "agreement_rate"] == pytest.approx(expected) and expected >= 0.4
        assert got.loc[layer, "n_keys_with_target"] == len(rows)
    assert RunDir(run).metric_description("values_negative")["direction"] == -1
    assert (run / "figures" / "values_negative.png").is_file()
