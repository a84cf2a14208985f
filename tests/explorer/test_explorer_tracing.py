"""Traces and interventions agree with the model computed by hand."""

from __future__ import annotations

import torch

import copy

import pytest

from ffkv.explorer.tracing import generate, trace
from ffkv.memories import Intervention
from ffkv.memories.projection import logits
from support.helpers import loaded_tiny
from support.runs import plant_memory, sharpen

PROMPT = [5, 9, 14, 22, 30, 31]


def test_trace_matches_the_model_and_logit_lens():
    loaded = loaded_tiny("gpt2")
    t = trace(loaded, PROMPT)
    view = loaded.view
    with view.capture(("resid_mid", "resid_post", "coefficients")) as cap:
        view.forward(torch.tensor([PROMPT]))
    final = loaded.model(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    assert t.final[0].token_id == int(final.argmax())
    assert t.target == t.final[0].token_id and t.position == len(PROMPT) - 1
    for layer in t.layers:
        lens = logits(view, cap["resid_post"][layer.layer][0, -1], "final-norm")
        assert layer.after.token_id == int(lens.argmax())
        # Memories ranked by their contribution to the target: m_i · (v_i · E[target]).
        m = cap["coefficients"][layer.layer][0, -1]
        contribution = m * (view.values(layer.layer) @ view.unembedding[t.target])
        assert [mem["key"] for mem in layer.memories] == contribution.topk(8).indices.tolist()
        assert layer.memories[0]["contribution"] == pytest.approx(float(contribution.max()), rel=1e-5)
        assert [mem["key"] for mem in layer.suppressing] == [
            k for k in (-contribution).topk(3).indices.tolist() if contribution[k] < 0]


def test_any_position_and_any_target():
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    with view.capture(("coefficients", "resid_mid")) as cap:
        view.forward(torch.tensor([PROMPT]))
    t = trace(loaded, PROMPT, position=2, target=40)
    assert t.position == 2 and t.target == 40
    final = loaded.model(torch.tensor([PROMPT])).logits[0, 2].softmax(-1)
    assert t.final[0].token_id == int(final.argmax())
    for layer in t.layers:
        assert layer.before.token_id == int(logits(view, cap["resid_mid"][layer.layer][0, 2], "final-norm").argmax())
        m = cap["coefficients"][layer.layer][0, 2]
        contribution = m * (view.values(layer.layer) @ view.unembedding[40])
        assert layer.memories[0]["key"] == int(contribution.argmax())
    with pytest.raises(IndexError):
        trace(loaded, PROMPT, position=len(PROMPT))


def test_generation_with_a_memory_switched_off_on_a_hand_built_model():
    loaded = sharpen(loaded_tiny("gpt2"))
    without = copy.deepcopy(loaded)  # the same model with that memory's value zeroed: what "off" must give
    token = plant_memory(loaded, 2, 5)
    plant_memory(without, 2, 5)
    with torch.no_grad():
        without.view.values(2)[5].zero_()
    assert generate(loaded, PROMPT, 6) == [token] * 6  # the planted memory decides every prediction
    off = generate(loaded, PROMPT, 6, [Intervention(2, 5, "off")])
    assert off == generate(without, PROMPT, 6) and off != [token] * 6
    assert generate(loaded, PROMPT, 6) == [token] * 6  # leaving the block restores the model
    assert len(generate(loaded, PROMPT, 40)) == 40
    assert len(generate(loaded, PROMPT, 200)) == 62 - len(PROMPT)  # stops at the model's length (64 - 2 positions)


def test_a_trace_with_no_edits_leaves_the_model_as_it_was():
    loaded = loaded_tiny("gpt2")
    off = trace(loaded, PROMPT, [Intervention(1, k, "off") for k in range(loaded.view.d_m)])
    assert off.final[0].prob != trace(loaded, PROMPT).final[0].prob
    assert trace(loaded, PROMPT).final[0].prob == trace(loaded, PROMPT, []).final[0].prob


def test_scaling_a_memory_changes_its_sub_update_linearly():
    loaded = loaded_tiny("llama")  # gated FF: m = act(x·Gᵀ) ⊙ (x·Uᵀ)
    key = 3
    base = trace(loaded, PROMPT)
    edited = trace(loaded, PROMPT, [Intervention(0, key, "scale", 2.0)])
    assert edited.layers[0].coefficients[key] == 2 * base.layers[0].coefficients[key]
    assert edited.edits == {(0, key): Intervention(0, key, "scale", 2.0)}
    set_ = trace(loaded, PROMPT, [Intervention(0, key, "set", -1.5)], position=1)
    assert float(set_.layers[0].coefficients[key]) == -1.5  # set: m takes the value at the read position
    assert set_.layers[0].coefficients[key + 1] == trace(loaded, PROMPT, position=1).layers[0].coefficients[key + 1]
    for layer in edited.layers:
        assert len(layer.memories) == 8
