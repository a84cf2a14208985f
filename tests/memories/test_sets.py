"""A layer's memories through one interface (`ffkv.memories.sets`): the model's neurons and a dictionary's latents
give keys, values and coefficients that equal their own definitions, computed here by hand."""

from __future__ import annotations

import pytest
import torch

from ffkv.dictionaries import Dictionary
from ffkv.errors import FfkvError
from ffkv.memories.address import LatentRef, MemoryRef
from ffkv.memories.sets import Latents, Neurons
from support.helpers import loaded_tiny


def _dictionary(view, layer, kind, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = view.d_model
    return Dictionary(kind=kind, layer=layer, encoder=torch.randn(n, d, generator=g),
                      encoder_bias=torch.randn(n, generator=g), decoder=torch.randn(n, d, generator=g),
                      decoder_bias=torch.randn(d, generator=g), activation="topk", k=3)


def test_neurons_and_latents_answer_the_same_questions_by_their_own_definitions():
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    dicts = {0: _dictionary(view, 0, "transcoder"), 1: _dictionary(view, 1, "sae", seed=1)}
    neurons, latents = Neurons(view), Latents(view, dicts)
    ids = torch.tensor([[3, 5, 7, 9]])
    with view.capture(("coefficients", "ff_in", "ff_out")) as cap:
        view.forward(ids, torch.ones_like(ids))
    assert neurons.layers == list(range(view.n_layers)) and latents.layers == [0, 1]
    for layer in latents.layers:
        d = dicts[layer]
        x = cap[latents.reads(layer)][layer]
        assert latents.reads(layer) == ("ff_in" if d.kind == "transcoder" else "ff_out")
        pre = x @ d.encoder.T + d.encoder_bias  # the definition, by hand
        top = pre.topk(3, dim=-1)
        expected = torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())
        assert torch.equal(latents.coefficients(layer, x), expected)
        assert torch.equal(latents.keys(layer), d.encoder) and torch.equal(latents.values(layer), d.decoder)
        assert latents.size(layer) == 12
    m = cap["coefficients"][1]
    assert neurons.coefficients(1, m) is m and neurons.reads(1) == "coefficients"
    assert torch.equal(neurons.values(1), view.values(1)) and neurons.size(1) == view.d_m
    assert neurons.ref(1, 2) == MemoryRef(1, 2) and latents.ref(1, 2) == LatentRef(1, 2, "sae")
    assert str(latents.ref(0, 11)) == "t1:11" and latents.layout.parse("s2:3") == LatentRef(1, 3, "sae")
    with pytest.raises(FfkvError, match="layer 3 has no latents here"):
        latents.values(2)
    with pytest.raises(FfkvError, match="latents 0..11"):
        latents.ref(0, 12)


def test_a_dictionary_of_another_width_is_refused():
    view = loaded_tiny("gpt2").view
    wide = Dictionary(kind="transcoder", layer=0, encoder=torch.randn(4, view.d_model + 1), encoder_bias=torch.zeros(4),
                      decoder=torch.randn(4, view.d_model + 1), decoder_bias=torch.zeros(view.d_model + 1),
                      activation="relu")
    with pytest.raises(FfkvError):
        Latents(view, {0: wide})
