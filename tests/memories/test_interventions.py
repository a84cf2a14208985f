"""Interventions on coefficients: the FF output equals Σ m'_i·v_i + b_V computed by hand, and leaving
the block restores the model exactly."""

from __future__ import annotations

import pytest
import torch

from ffkv.errors import FfkvError
from ffkv.memories import Intervention, intervene
from support.helpers import loaded_tiny

PROMPT = torch.tensor([[5, 9, 14, 22, 30, 31]])


def _capture(view, edits=()):
    with intervene(view, edits):
        with view.capture(("coefficients", "ff_out")) as cap:
            view.forward(PROMPT)
    return cap


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_off_scale_and_set_rewrite_the_coefficients(family):
    view = loaded_tiny(family).view
    base = _capture(view)
    edits = [Intervention(1, 3, "off"), Intervention(1, 5, "scale", 2.5), Intervention(1, 7, "set", 4.0)]
    cap = _capture(view, edits)
    m = base["coefficients"][1].clone()
    m[..., 3] = 0
    m[..., 5] *= 2.5
    m[..., 7] = 4.0
    torch.testing.assert_close(cap["coefficients"][1], m)
    expected = m @ view.values(1)
    if view.value_bias(1) is not None:
        expected = expected + view.value_bias(1)
    torch.testing.assert_close(cap["ff_out"][1], expected, rtol=1e-5, atol=1e-5)
    # Layers without edits are untouched only below the edited one; the model itself is restored after.
    torch.testing.assert_close(cap["coefficients"][0], base["coefficients"][0])
    again = _capture(view)
    for layer in range(view.n_layers):
        assert torch.equal(again["ff_out"][layer], base["ff_out"][layer])


def test_switching_off_every_memory_leaves_only_the_bias():
    view = loaded_tiny("gpt2").view
    cap = _capture(view, [Intervention(1, k, "off") for k in range(view.d_m)])
    torch.testing.assert_close(cap["ff_out"][1][0], view.value_bias(1).expand(PROMPT.shape[1], -1))


def test_scaled_is_off_at_zero_and_bad_memories_are_refused():
    assert Intervention.scaled(0, 1, 0.0) == Intervention(0, 1, "off")
    assert Intervention.scaled(0, 1, 3.0).factor == 3.0 and Intervention(0, 1, "set", 2.0).factor is None
    view = loaded_tiny("gpt2").view
    with pytest.raises(FfkvError, match="does not exist"):
        with intervene(view, [Intervention(9, 0)]):
            pass
    with pytest.raises(FfkvError, match="unknown intervention"):
        Intervention(0, 0, "double")


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_replace_ff_output_splices_a_layer_and_leaves_no_hook(family):
    from ffkv.memories.interventions import replace_ff_output

    loaded = loaded_tiny(family)
    view, model = loaded.view, loaded.model
    ids = torch.tensor([[5, 9, 14, 20, 7, 30]])
    with torch.no_grad():
        base = model(input_ids=ids).logits
        with replace_ff_output(view, {1: lambda x, y: y}):
            same = model(input_ids=ids).logits
        torch.testing.assert_close(same, base, rtol=0, atol=0)
        seen = {}

        def zero(x, y):
            seen["x"], seen["y"] = x, y
            return torch.zeros_like(y)

        with replace_ff_output(view, {1: zero}), view.capture(("ff_in", "resid_mid", "resid_post"), layers=[1]) as cap:
            changed = model(input_ids=ids).logits
        # the replacement got the FF input and output, and what reaches the residual stream is what it returned
        torch.testing.assert_close(seen["x"].reshape(cap["ff_in"][1].shape), cap["ff_in"][1])
        assert not torch.equal(changed, base)
        if not view.parallel:
            torch.testing.assert_close(cap["resid_post"][1] - cap["resid_mid"][1],
                                       torch.zeros_like(cap["resid_mid"][1]), rtol=0, atol=1e-6)
        torch.testing.assert_close(model(input_ids=ids).logits, base, rtol=0, atol=0)  # the hooks are gone
    with pytest.raises(FfkvError, match="does not exist"):
        with replace_ff_output(view, {view.n_layers: zero}):
            pass


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("edits", [[Intervention(0, 3, "off"), Intervention(1, 2, "off"), Intervention(1, 6, "off")],
                                   [Intervention(1, 3, "off"), Intervention(1, 5, "scale", 2.5),
                                    Intervention(1, 7, "set", 4.0)]])
def test_in_place_rewrites_the_same_bits(family, edits):
    """in_place (the scoring pass's) writes the very values of the copy, signed zeros of m_i·0 included, and every
    layer's output is bit for bit the same."""
    view = loaded_tiny(family).view

    def run(in_place):
        with intervene(view, edits, in_place=in_place), view.capture(("coefficients", "ff_out")) as cap:
            view.forward(PROMPT)
        return cap

    copy, inplace = run(False), run(True)
    for name in ("coefficients", "ff_out"):
        for layer in copy[name]:
            a, b = copy[name][layer], inplace[name][layer]
            assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))
