"""Known answers for the controls of issue 28 (SPEC section 3, Controls): a planted dead key is dead everywhere,
a planted massive activation does not move the active rule, and the chance levels are what a brute force over the
same examples gives.

Planted model: a GELU GPT-2 (width 64, 2 layers) whose layer 0 sees exactly wte[x] + wpe[j] (its attention writes
nothing), every embedding row with zero mean and a zero in dimension `MASSIVE_DIM`:

- key 0 of layer 0 has no weights and bias -10: gelu(-10) is about -8e-23 at every position, never active: dead;
- with `massive`, wpe[0] carries 1,000 in dimension `MASSIVE_DIM`, which every key of layer 0 reads with weight
  50: after the block's LayerNorm the first position's coefficients are about 1,000 times the others', while every
  other position's are exactly those of the model without it (its dimension `MASSIVE_DIM` is 0 after the norm).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf

from ffkv.experiments import analyze
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.store.run import RunDir
from support.experiment_runs import make_run
from support.helpers import CharTokenizer
from support.tiny_models import VOCAB

D, MASSIVE_DIM = 64, 63


def planted(massive: bool) -> LoadedModel:
    config = tf.GPT2Config(n_embd=D, n_layer=2, n_head=2, n_inner=48, n_positions=64, vocab_size=VOCAB,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
        for table, scale in ((wte, 1.0), (wpe, 0.3)):
            table.copy_(torch.randn(table.shape, generator=g) * scale)
            table[:, MASSIVE_DIM] = 0.0
            table[:, :MASSIVE_DIM] -= table[:, :MASSIVE_DIM].mean(1, keepdim=True)  # LayerNorm keeps dim 63 at 0
        block = model.transformer.h[0]
        block.attn.c_proj.weight.zero_()
        block.attn.c_proj.bias.zero_()
        view = MemoryView(model)
        K, b = view.keys(0), view.key_bias(0)
        K[0].zero_()
        b[0] = -10.0
        if massive:
            wpe[0, MASSIVE_DIM] = 1000.0
            wpe[0, :MASSIVE_DIM] = 0.0
            K[1:, MASSIVE_DIM] = 50.0
    model.requires_grad_(False)
    return LoadedModel(model, CharTokenizer(), MemoryView(model), f"tiny-gpt2-planted-{massive}", "float32", "cpu")


def analysed(folder, massive: bool):
    run, loaded = make_run(folder, "gpt2", n=160, loaded=planted(massive), top_k=8)
    analyze(run, only="patterns,composition,census", loaded=loaded, n_eval=160, progress=False)
    return RunDir(run), loaded


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted-controls")
    return analysed(root / "plain", False), analysed(root / "massive", True)


def test_the_planted_position_carries_massive_coefficients(both):
    (_, plain), (_, massive) = both
    ids = torch.tensor([CharTokenizer().encode("the cat sat")])
    got = {}
    for name, loaded in (("plain", plain), ("massive", massive)):
        with loaded.view.capture(("coefficients",), layers=[0]) as cap:
            loaded.view.forward(ids)
        got[name] = cap["coefficients"][0][0]
    first, rest = got["massive"][0, 1:].abs(), got["massive"][1:, 1:].abs()
    assert float(first.pow(2).mean().sqrt()) > 500 * float(rest.pow(2).mean().sqrt())
    torch.testing.assert_close(got["massive"][1:], got["plain"][1:])  # every other position as without it


def test_a_massive_activation_is_named_and_leaves_the_active_rule_alone(both):
    (plain, _), (massive, _) = both
    scale = massive.read_metric("composition_scale").set_index("layer")
    scale_plain = plain.read_metric("composition_scale").set_index("layer")
    named = massive.read_metric("composition_massive")
    first = named[named["layer"] == 0]
    assert len(first) and (first["position"] == 0).all() and (first["times_median"] > 100).all()
    assert not len(plain.read_metric("composition_massive"))
    # Without the rule, s_l of layer 0 would be set by the first positions (hundreds of times larger).
    assert scale.loc[0, "scale_all_positions"] > 20 * scale.loc[0, "scale"]
    assert scale.loc[0, "scale"] == pytest.approx(scale_plain.loc[0, "scale"], rel=0.1)
    # Active shares, census classes and Figure 8 of layer 0 as without the massive position.
    comp, comp_plain = (run.read_metric("composition").set_index("layer") for run in (massive, plain))
    assert comp.loc[0, "share_active"] == pytest.approx(comp_plain.loc[0, "share_active"], rel=0.1)
    assert abs(comp.loc[0, "composition_rate"] - comp_plain.loc[0, "composition_rate"]) <= 0.05
    census, census_plain = (run.read_metric("census").query("layer == 0").set_index("key")["class"]
                            for run in (massive, plain))
    assert (census == census_plain).mean() >= 0.95


def test_a_planted_dead_key_is_dead_everywhere_and_left_out_of_figure_2(both):
    (plain, _), _ = both
    keys = plain.read_metric("patterns_keys").set_index(["layer", "key"])
    assert keys.loc[(0, 0), "label"] == "dead" and keys.loc[(0, 0), "dead"]
    assert "never active" in keys.loc[(0, 0), "description"]
    assert not keys.drop(index=(0, 0))["dead"].any()
    per_layer = plain.read_metric("patterns").set_index("layer")
    assert per_layer.loc[0, "n_dead"] == 1 and per_layer.loc[0, "n_keys"] == 47
    shares = per_layer.loc[0, ["keys_shallow", "keys_semantic", "keys_both", "keys_none"]]
    assert shares.sum() == pytest.approx(1.0)  # over the live keys: the dead one is in none of them
    census = plain.read_metric("census").set_index(["layer", "key"])
    assert census.loc[(0, 0), "class"] == "dead" and census["dead"].sum() == 1


def test_chance_levels_equal_a_brute_force_over_the_same_pairs(both):
    """Figure 8's chance event recomputed from the model alone: for each example, its active memories at its
    analysed position (each example run by itself) against its partner's FF top token."""
    (run, loaded), _ = both
    examples = run.read_metric("composition_examples")
    layer0 = examples[examples["layer"] == 0].reset_index(drop=True)
    assert (layer0["partner_example_id"] != layer0["example_id"]).mean() > 0.9
    ff_top = dict(zip(layer0["example_id"], layer0["ff_top_id"]))
    threshold = float(run.read_metric("composition").set_index("layer").loc[0, "active_threshold"])
    view = loaded.view
    values = view.values(0)
    tops, bottoms = (values @ view.unembedding.T).argmax(-1), (values @ view.unembedding.T).argmin(-1)
    texts = pd.read_parquet(run.table("examples")).set_index("example_id")["token_ids"]
    for row in layer0.itertuples():
        ids = torch.tensor([list(texts[row.example_id])])
        with view.capture(("coefficients",), layers=[0]) as cap:
            view.forward(ids)
        m = cap["coefficients"][0][0, row.position]
        active = m.abs() > threshold
        predicted = set(tops[active & (m > 0)].tolist()) | set(bottoms[active & (m < 0)].tolist())
        assert row.ff_matches_partner == (ff_top[row.partner_example_id] in predicted)
    per_layer = run.read_metric("composition").set_index("layer")
    paired = layer0[layer0["partner_example_id"] != layer0["example_id"]]
    assert per_layer.loc[0, "composition_rate_chance"] == pytest.approx(1 - paired["ff_matches_partner"].mean())


def test_the_explorer_says_the_dead_key_never_fired_and_names_the_massive_activation(both, tmp_path):
    """What a reader sees, from the tables the real pipeline wrote: the dead key's page says it never fired and
    heads its rows as inactive; the overview of the run with the planted outlier names it, the other's does not."""
    import shutil

    from starlette.testclient import TestClient

    from ffkv.explorer import create_app

    (plain, plain_loaded), (massive, massive_loaded) = both
    for name, run, loaded in (("plain", plain, plain_loaded), ("massive", massive, massive_loaded)):
        copy = RunDir(shutil.copytree(run.path, tmp_path / name))
        analyze(copy.path, only="lookups", loaded=loaded, progress=False)
        with TestClient(base_url="http://127.0.0.1:8000", app=create_app(copy.path, loaded=loaded)) as client:
            dead, live = client.get("/memory/1/0").text, client.get("/memory/1/1").text
            overview = client.get("/").text
        assert 'id="never-fired"' in dead and "None active" in dead  # planted in both models
        assert 'id="never-fired"' not in live and "None active" not in live
        assert ('<h2 id="massive">Massive activations</h2>' in overview) is (run is massive)
