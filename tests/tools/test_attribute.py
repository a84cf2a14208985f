"""`ffkv attribute`: gradient x coefficient and integrated gradients against exact answers (a linear toy, finite
differences, completeness), the switch-off check, the Backward-Lens identity against autograd on the weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf

from ffkv.dictionaries import Dictionary
from ffkv.errors import FfkvError
from ffkv.experiments.scoring import score_examples
from ffkv.memories.interventions import Intervention, intervene, replace_ff_output
from ffkv.memories.sets import Latents
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.tools.attribute import (
    AttributeOptions,
    Target,
    attribute,
    attribution_pass,
    spearman,
    target_value,
)
from support.helpers import CharTokenizer, loaded_tiny


@dataclass
class _Example:
    example_id: int
    token_ids: np.ndarray


def corpus(n: int = 5, seed: int = 0) -> list[_Example]:
    rng = np.random.default_rng(seed)
    return [_Example(i, rng.integers(4, 97, size=int(rng.integers(3, 9))).astype(np.int64)) for i in range(n)]


def linear_toy() -> LoadedModel:
    """One GPT-2 layer without a final norm: a token's logit is linear in the coefficients."""
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_embd=16, n_layer=1, n_head=2, n_inner=40,
                                             n_positions=64)).eval()
    model.transformer.ln_f = torch.nn.Identity()
    model.requires_grad_(False)
    return LoadedModel(model, CharTokenizer(), MemoryView(model), "linear-toy", "float32", "cpu")


def _total(loaded, examples, target, edits=()) -> float:
    with torch.no_grad(), intervene(loaded.view, list(edits)):
        out = 0.0
        for e in examples:
            ids = torch.tensor(e.token_ids)[None]
            out += float(target_value(loaded.model(input_ids=ids).logits.double(), ids, torch.ones_like(ids), target))
    return out


def test_on_a_linear_toy_attribution_is_the_switch_off_effect_exactly():
    loaded, examples = linear_toy(), corpus()
    target = Target(token=11, measure="logit")
    result = attribute(loaded, lambda: iter(examples), target, AttributeOptions(steps=4, check=40, batch_size=2))
    table = result.memories
    assert table.exact_off_effect.notna().all()  # every memory checked
    exact = table.exact_off_effect.to_numpy()
    for method in ("grad_x_coef", "integrated_gradients"):
        np.testing.assert_allclose(table[method], exact, rtol=1e-4, atol=1e-5)
        assert list(np.argsort(-table[method].to_numpy(), kind="stable")) == \
            list(np.argsort(-exact, kind="stable"))
    assert result.summary["spearman_grad_x_coef"] == pytest.approx(1.0)
    assert result.summary["spearman_integrated_gradients"] == pytest.approx(1.0)
    # The exact effect is the intervene path's, recomputed here one memory at a time.
    for key in (0, 17, 39):
        want = _total(loaded, examples, target) - _total(loaded, examples, target, [Intervention(0, key, "off")])
        assert exact[key] == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_grad_x_coef_is_the_derivative_of_scaling_each_memory(family):
    """Σ_p m_i·∂T/∂m_i = d/dε T(m_i·(1+ε)) at 0: central differences through `intervene`, in float64 (Llama's
    RMSNorm and rotary tables compute in float32 even in a float64 model: too coarse for differences)."""
    loaded = loaded_tiny(family)
    loaded.model.double()
    examples = corpus(3)
    target = Target()  # the loss
    sums = attribution_pass(loaded, iter(examples), target, AttributeOptions(steps=0, batch_size=3))
    eps = 2.0 ** -14  # 1 ± eps exact in float32, the precision of an intervention's factor
    for layer, key in [(0, 3), (1, 20), (2, 39)]:
        up = _total(loaded, examples, target, [Intervention(layer, key, "scale", 1 + eps)])
        down = _total(loaded, examples, target, [Intervention(layer, key, "scale", 1 - eps)])
        assert sums.grad_x_coef[layer, key] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)
    assert sums.target == pytest.approx(_total(loaded, examples, target), rel=1e-9)


def test_integrated_gradients_are_complete_per_layer():
    loaded = loaded_tiny("gpt2")
    loaded.model.double()
    result = attribute(loaded, lambda: iter(corpus(4)), Target(token=9), AttributeOptions(steps=32, check=0))
    assert result.summary["completeness_max_relative_error"] < 1e-3
    for row in result.summary["completeness"]:
        layer_sum = result.memories[result.memories.layer == row["layer"]].integrated_gradients.sum()
        assert layer_sum == pytest.approx(row["sum_integrated"])


@pytest.mark.parametrize("family", ["gpt2", "llama", "opt"])
def test_value_gradients_follow_the_backward_lens_identity(family):
    """∂T/∂V from Σ_p m ⊗ ∂T/∂FF(x) equals autograd's gradient of the second FF matrix's weight."""
    loaded = loaded_tiny(family)
    examples = corpus(4)
    target = Target()
    sums = attribution_pass(loaded, iter(examples), target, AttributeOptions(steps=0, batch_size=2))
    view = loaded.view
    downs = [view.arch.down_proj(b) for b in view.blocks]
    for d in downs:
        d.weight.requires_grad_(True)
        d.weight.grad = None
    try:
        with torch.enable_grad():
            for e in examples:  # one example at a time: no padding, a different summation order
                ids = torch.tensor(e.token_ids)[None]
                target_value(loaded.model(input_ids=ids).logits, ids, torch.ones_like(ids), target).backward()
        for layer, d in enumerate(downs):
            want = d.weight.grad if view.arch.conv1d else d.weight.grad.T  # as V: (d_m, d)
            got = sums.value_grads[layer]
            assert float((got - want).norm() / want.norm()) < 1e-5
    finally:
        for d in downs:
            d.weight.requires_grad_(False)
            d.weight.grad = None


def test_the_loss_target_is_the_scored_loss():
    """T for the loss is Σ examples n·mean NLL of `ffkv.experiments.scoring` (the other owner of the loss)."""
    loaded, examples = loaded_tiny("gpt2"), corpus(5)
    sums = attribution_pass(loaded, iter(examples), Target(), AttributeOptions(steps=0, batch_size=2))
    scores = score_examples(loaded, [e.token_ids for e in examples])
    assert sums.target == pytest.approx(float((scores.nll * scores.n_predicted).sum()), rel=1e-5)
    assert sums.n_positions == int(scores.n_predicted.sum())


def test_last_position_targets_read_one_position_per_example():
    loaded, examples = loaded_tiny("gpt2"), corpus(4)
    target = Target(token=5, positions="last")
    sums = attribution_pass(loaded, iter(examples), target, AttributeOptions(steps=0, batch_size=4))
    want = 0.0
    with torch.no_grad():
        for e in examples:
            logits = loaded.model(input_ids=torch.tensor(e.token_ids)[None]).logits[0, -1]
            want += float(torch.log_softmax(logits, -1)[5])
    assert sums.target == pytest.approx(want, rel=1e-5)
    assert sums.n_positions == len(examples)


def test_written_tables_and_text(tmp_path):
    loaded = loaded_tiny("gpt2")
    result = attribute(loaded, lambda: iter(corpus(3)), Target(), AttributeOptions(steps=2, check=6, lens_top=4))
    paths = result.write(tmp_path / "out")
    assert sorted(p.name for p in paths) == ["attribute.json", "attribute_lens.parquet", "attribute_memories.parquet"]
    table = pd.read_parquet(tmp_path / "out" / "attribute_memories.parquet")
    assert len(table) == loaded.view.n_layers * loaded.view.d_m and table.exact_off_effect.notna().sum() == 6
    lens = pd.read_parquet(tmp_path / "out" / "attribute_lens.parquet")
    assert len(lens) == 4 and all(len(t) == 10 for t in lens.tokens)
    assert "rank correlation" in result.to_text()


def test_refusals():
    with pytest.raises(FfkvError, match="encoder"):
        attribute(loaded_tiny("bert"), lambda: iter(corpus(2)), Target())
    with pytest.raises(FfkvError, match="does not exist"):
        attribute(loaded_tiny("gpt2"), lambda: iter(corpus(2)), Target(token=500))
    with pytest.raises(FfkvError, match="no example"):
        attribute(loaded_tiny("gpt2"), lambda: iter([]), Target(), AttributeOptions(check=0))


def test_spearman():
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 25, 100])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2, 3]), np.array([3.0, 2, 1])) == pytest.approx(-1.0)
    assert np.isnan(spearman(np.array([1.0]), np.array([2.0])))


# ---------------------------------------------------------------------------- latents
def _dictionary(view, layer, kind, n=10, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    d = view.d_model
    return Dictionary(kind=kind, layer=layer, encoder=torch.randn(n, d, generator=g),
                      encoder_bias=torch.randn(n, generator=g), decoder=torch.randn(n, d, generator=g) / 4,
                      decoder_bias=torch.randn(d, generator=g), activation="topk", k=4,
                      input_bias=torch.randn(d, generator=g) if kind == "sae" else None).to(dtype=dtype)


def test_on_a_linear_toy_a_latents_attribution_is_its_switch_off_effect_exactly():
    """T (a logit, no final norm, one layer) is linear in the FF output, and switching latent j off subtracts
    a_j·dec_j from it: gradient × activation is then the exact effect, latent by latent."""
    loaded, examples = linear_toy(), corpus()
    latents = Latents(loaded.view, {0: _dictionary(loaded.view, 0, "transcoder")})
    result = attribute(loaded, lambda: iter(examples), Target(token=11, measure="logit"),
                       AttributeOptions(steps=0, check=10, batch_size=2), latents=latents)
    table = result.latents
    assert list(table.address) == [str(latents.ref(0, j)) for j in range(10)]
    assert table.exact_off_effect.notna().all() and (table.grad_x_act.abs() > 1e-3).sum() >= 5
    np.testing.assert_allclose(table.grad_x_act, table.exact_off_effect, rtol=1e-4, atol=1e-5)
    assert result.summary["latents"]["spearman_grad_x_act"] == pytest.approx(1.0)
    assert loaded.view.latents is None  # attached for the check only
    for j in (0, 4):  # the exact effect is the intervene path's, recomputed here
        want = _total(loaded, examples, Target(token=11, measure="logit"))
        latents.attach()
        try:
            want -= _total(loaded, examples, Target(token=11, measure="logit"),
                           [Intervention(0, j, "off", kind="transcoder")])
        finally:
            loaded.view.latents = None
        assert table.exact_off_effect[j] == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("layer,kind", [(1, "transcoder"), (2, "sae")])
def test_grad_x_act_is_the_derivative_of_scaling_each_latent(layer, kind):
    """Σ_p a_j·(dec_j · ∂T/∂FF(x)) = d/dε T(a_j·(1+ε)) at 0, by central differences through `intervene` (float64
    model and dictionary), for a transcoder reading the FF input and an SAE reading the FF output."""
    loaded = loaded_tiny("gpt2")
    loaded.model.double()
    examples = corpus(3)
    latents = Latents(loaded.view, {layer: _dictionary(loaded.view, layer, kind, seed=layer, dtype=torch.float64)})
    sums = attribution_pass(loaded, iter(examples), Target(), AttributeOptions(steps=0, batch_size=3), latents=latents)
    eps = 2.0 ** -14
    latents.attach()
    try:
        for j in (0, 3, 7):
            up = _total(loaded, examples, Target(), [Intervention(layer, j, "scale", 1 + eps, kind)])
            down = _total(loaded, examples, Target(), [Intervention(layer, j, "scale", 1 - eps, kind)])
            assert sums.latent_grad_x_act[layer][j] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)
    finally:
        loaded.view.latents = None


def test_decoder_gradients_are_autograds():
    """∂T/∂dec from Σ_p a ⊗ ∂T/∂FF(x) equals autograd's gradient of a decoder spliced in as FF(x) + a·(D − D₀)."""
    loaded, examples = loaded_tiny("gpt2"), corpus(4)
    view, layer = loaded.view, 1
    d = _dictionary(view, layer, "transcoder")
    latents = Latents(view, {layer: d})
    sums = attribution_pass(loaded, iter(examples), Target(), AttributeOptions(steps=0, batch_size=2), latents=latents)
    decoder = d.decoder.clone().requires_grad_(True)
    with torch.enable_grad(), replace_ff_output(view, {layer: lambda x, out: out + d.encode(x) @ (decoder - d.decoder)}):
        for e in examples:  # one example at a time: no padding
            ids = torch.tensor(e.token_ids)[None]
            target_value(loaded.model(input_ids=ids).logits, ids, torch.ones_like(ids), Target()).backward()
    got = sums.latent_value_grads[layer]
    assert float((got - decoder.grad).norm() / decoder.grad.norm()) < 1e-5


def test_latent_tables_written_and_read_aloud(tmp_path):
    loaded = loaded_tiny("gpt2")
    latents = Latents(loaded.view, {1: _dictionary(loaded.view, 1, "transcoder"),
                                    2: _dictionary(loaded.view, 2, "sae", seed=2)})
    result = attribute(loaded, lambda: iter(corpus(3)), Target(), AttributeOptions(steps=0, check=4, lens_top=3),
                       latents=latents)
    names = sorted(p.name for p in result.write(tmp_path / "out"))
    assert names == ["attribute.json", "attribute_latent_lens.parquet", "attribute_latents.parquet",
                     "attribute_lens.parquet", "attribute_memories.parquet"]
    table = pd.read_parquet(tmp_path / "out" / "attribute_latents.parquet")
    assert len(table) == 20 and table.exact_off_effect.notna().sum() == 4
    assert set(table.address) == {str(latents.ref(l, j)) for l in (1, 2) for j in range(10)}
    lens = pd.read_parquet(tmp_path / "out" / "attribute_latent_lens.parquet")
    assert len(lens) == 3 and all(len(t) == 10 for t in lens.tokens)
    text = result.to_text()
    assert "top latents" in text and str(latents.ref(int(lens.layer[0]), int(lens.latent[0]))) in text
    other = loaded_tiny("gpt2")
    with pytest.raises(FfkvError, match="another model"):
        attribute(other, lambda: iter(corpus(2)), Target(), latents=latents)
