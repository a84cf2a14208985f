"""Traces and interventions agree with the model computed by hand."""

from __future__ import annotations

import torch

from ffkv.explorer.tracing import trace
from ffkv.memories.projection import logits
from support.helpers import loaded_tiny

PROMPT = [5, 9, 14, 22, 30, 31]


def test_trace_matches_the_model_and_logit_lens():
    loaded = loaded_tiny("gpt2")
    t = trace(loaded, PROMPT)
    view = loaded.view
    with view.capture(("resid_mid", "resid_post", "coefficients")) as cap:
        view.forward(torch.tensor([PROMPT]))
    final = loaded.model(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    assert t.final[0].token_id == int(final.argmax())
    for layer in t.layers:
        lens = logits(view, cap["resid_post"][layer.layer][0, -1], "final-norm")
        assert layer.after.token_id == int(lens.argmax())
        m = cap["coefficients"][layer.layer][0, -1]
        best = (m.abs() * view.values(layer.layer).norm(dim=1)).argmax()
        assert layer.memories[0]["key"] == int(best)


def test_a_trace_with_no_edits_leaves_the_model_as_it_was():
    loaded = loaded_tiny("gpt2")
    off = trace(loaded, PROMPT, {(1, k): 0.0 for k in range(loaded.view.d_m)})
    assert off.final[0].prob != trace(loaded, PROMPT).final[0].prob
    assert trace(loaded, PROMPT).final[0].prob == trace(loaded, PROMPT, {}).final[0].prob


def test_scaling_a_memory_changes_its_sub_update_linearly():
    loaded = loaded_tiny("llama")  # gated FF: m = act(x·Gᵀ) ⊙ (x·Uᵀ)
    key = 3
    base = trace(loaded, PROMPT)
    edited = trace(loaded, PROMPT, {(0, key): 2.0})
    assert edited.layers[0].coefficients[key] == 2 * base.layers[0].coefficients[key]
    assert edited.edits == {(0, key): 2.0}
    for layer in edited.layers:
        assert len(layer.memories) == 8
