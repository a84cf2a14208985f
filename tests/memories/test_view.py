"""The memory view's weights and captures agree with the model's own computation (SPEC section 1)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from ffkv.errors import FfkvError
from ffkv.memories.architectures import architecture_of
from ffkv.memories.view import MemoryView
from support.tiny_models import D, D_M, FAMILIES, LAYERS, VOCAB, tiny_model


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    return ids, mask


def _block_io(view, layer, ids, mask):
    """Block input, block output and attention output, from hooks written here independently."""
    seen = {}
    block = view.blocks[layer]
    attn = view.arch.attention(block)
    h1 = block.register_forward_pre_hook(
        lambda m, a, k: seen.__setitem__("in", a[0] if a else k["hidden_states"]), with_kwargs=True)
    h2 = block.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o[0] if isinstance(o, tuple) else o))
    h3 = attn.register_forward_hook(lambda m, a, o: seen.__setitem__("attn", o[0] if isinstance(o, tuple) else o))
    view.forward(ids, mask)
    for h in (h1, h2, h3):
        h.remove()
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_and_weights(family):
    view = MemoryView(tiny_model(family))
    assert (view.n_layers, view.d_m, view.d_model, view.vocab_size) == (LAYERS, D_M, D, VOCAB)
    assert view.keys(1).shape == view.values(1).shape == (D_M, D)
    assert view.gated == (family in ("llama", "mistral", "qwen2"))
    assert view.parallel == (family in ("gptj", "gpt_neox_parallel"))
    assert view.encoder == (family in ("bert", "roberta"))
    with pytest.raises(FfkvError, match="layer 7 does not exist"):
        view.keys(7)


@pytest.mark.parametrize("family", FAMILIES)
def test_captures_match_weights_and_residual_stream(family):
    view = MemoryView(tiny_model(family))
    ids, mask = _batch()
    with view.capture(("coefficients", "ff_in", "resid_mid", "ff_out", "resid_post")) as cap:
        view.forward(ids, mask)
    for layer in range(view.n_layers):
        m, x = cap["coefficients"][layer], cap["ff_in"][layer]
        assert m.shape == (3, 9, D_M)
        # m = f(x·Kᵀ + b_K) (gated: act(x·Gᵀ) ⊙ x·Uᵀ), recomputed here from raw parameters.
        pre = x @ view.keys(layer).T + (view.key_bias(layer) if view.key_bias(layer) is not None else 0)
        expect = view.activation(layer)(pre)
        if view.gated:
            expect = expect * (x @ view.up(layer).T)
        torch.testing.assert_close(m, expect, rtol=1e-5, atol=1e-6)
        # FF(x) = Σ_i m_i v_i + b_V
        ff = torch.einsum("btm,md->btd", m, view.values(layer))
        if view.value_bias(layer) is not None:
            ff = ff + view.value_bias(layer)
        torch.testing.assert_close(cap["ff_out"][layer], ff, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cap["resid_post"][layer], cap["resid_mid"][layer] + cap["ff_out"][layer])
        io = _block_io(view, layer, ids, mask)
        if view.encoder:
            # Post-norm: resid_mid is the attention sublayer's output; the block ends with LayerNorm(resid_post).
            torch.testing.assert_close(cap["resid_mid"][layer], io["attn"])
            torch.testing.assert_close(view.blocks[layer].output.LayerNorm(cap["resid_post"][layer]), io["out"])
        elif family == "opt" or not view.parallel:
            torch.testing.assert_close(cap["resid_mid"][layer], io["in"] + io["attn"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cap["resid_post"][layer], io["out"], rtol=1e-5, atol=1e-5)
        else:
            # Parallel blocks: resid_mid = resid_pre + attn_out, resid_post = block output.
            torch.testing.assert_close(cap["resid_mid"][layer], io["in"] + io["attn"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cap["resid_post"][layer], io["out"], rtol=1e-5, atol=1e-5)


def test_only_requested_layers_and_early_stop():
    view = MemoryView(tiny_model("gpt2"))
    ids, mask = _batch()
    calls = []
    last = view.arch.down_proj(view.blocks[2]).register_forward_pre_hook(lambda *a: calls.append(2))
    with view.capture(("coefficients",), layers=[1], stop_early=True) as cap:
        view.forward(ids, mask)
    last.remove()
    assert set(cap["coefficients"]) == {1} and set(cap) == {"coefficients"}
    assert calls == []  # layer 2 never ran
    with pytest.raises(FfkvError, match="unknown quantity"):
        with view.capture(("attention",)):
            pass


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_early_stop_skips_the_last_down_projection_and_keeps_every_coefficient(family):
    view = MemoryView(tiny_model(family))
    ids, mask = _batch()
    last = view.n_layers - 1
    with view.capture(("coefficients",)) as full:
        view.forward(ids, mask)
    ran = []
    hook = view.arch.down_proj(view.blocks[last]).register_forward_hook(lambda *a: ran.append(last))
    with view.capture(("coefficients",), stop_early=True) as early:
        view.forward(ids, mask)
    assert ran == []  # the index never reads the last layer's down-projection, so it does not run
    assert set(early["coefficients"]) == set(range(view.n_layers))
    for layer in range(view.n_layers):
        assert torch.equal(early["coefficients"][layer], full["coefficients"][layer])
    with view.capture(("coefficients", "ff_out"), stop_early=True) as out:
        view.forward(ids, mask)
    hook.remove()
    assert ran == [last]  # ff_out needs it
    assert torch.equal(out["coefficients"][last], full["coefficients"][last]) and last in out["ff_out"]


def test_sink_receives_instead_of_storing():
    view = MemoryView(tiny_model("llama"))
    got = []
    with view.capture(("coefficients", "resid_post"), sink=lambda q, l, t: got.append((q, l, tuple(t.shape)))) as cap:
        view.forward(*_batch())
    assert cap == {"coefficients": {}, "resid_post": {}}
    assert ("coefficients", 0, (3, 9, D_M)) in got and ("resid_post", 2, (3, 9, D)) in got


def test_unsupported_architecture_names_supported_ones():
    model = tf.T5ForConditionalGeneration(tf.T5Config(d_model=8, d_ff=16, num_layers=1, num_heads=1, d_kv=4, vocab_size=32))
    with pytest.raises(FfkvError, match="unsupported architecture 't5'.*GPT-2.*Llama"):
        architecture_of(model)
