"""Edits of a dictionary's latents (`ffkv.memories.interventions.intervene` with latents attached): the layer's
output becomes the reconstruction from the edited activations plus the error term. Checked against a brute force
written here: a plain forward hook that subtracts a_j·dec_j, a_j computed from a clean pass."""

from __future__ import annotations

import pytest
import torch

from ffkv.dictionaries import Dictionary
from ffkv.errors import FfkvError
from ffkv.memories.address import edit_text, parse_edit
from ffkv.memories.interventions import Intervention, intervene
from ffkv.memories.sets import Latents
from support.helpers import loaded_tiny

IDS = torch.tensor([[5, 9, 2, 7, 11, 3, 8], [4, 4, 6, 1, 12, 10, 2]])


def _dictionary(view, layer, kind, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = view.d_model
    return Dictionary(kind=kind, layer=layer, encoder=torch.randn(n, d, generator=g),
                      encoder_bias=torch.randn(n, generator=g), decoder=torch.randn(n, d, generator=g),
                      decoder_bias=torch.randn(d, generator=g), activation="topk", k=4,
                      input_bias=torch.randn(d, generator=g) if kind == "sae" else None)


@pytest.fixture(scope="module")
def attached():
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    latents = Latents(view, {1: _dictionary(view, 1, "transcoder"), 2: _dictionary(view, 2, "sae", seed=1)})
    yield loaded, latents.attach()
    view.latents = None


def _logits(loaded):
    with torch.no_grad():
        return loaded.model(input_ids=IDS).logits


def _clean(view, quantity, layer):
    with view.capture((quantity,)) as cap:
        view.forward(IDS, torch.ones_like(IDS))
    return cap[quantity][layer].detach()


@pytest.mark.parametrize("layer,kind,site", [(1, "transcoder", "ff_in"), (2, "sae", "ff_out")])
def test_switching_a_latent_off_removes_exactly_its_contribution(attached, layer, kind, site):
    loaded, latents = attached
    view, d = loaded.view, latents.dictionaries[layer]
    a = d.encode(_clean(view, site, layer))
    j = int((a > 0).sum(dim=(0, 1)).argmax())  # a latent that fires here
    assert (a[..., j] > 0).any()
    handle = loaded.model.transformer.h[layer].mlp.register_forward_hook(
        lambda module, args, out: out - a[..., j, None] * d.decoder[j])
    try:
        expected = _logits(loaded)
    finally:
        handle.remove()
    with intervene(view, [Intervention(layer, j, "off", kind=kind)]):
        got = _logits(loaded)
    clean = _logits(loaded)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got - clean).abs().max() > 1e-3  # the edit did something
    # scale by 3 and set to 2: a'_j - a_j times dec_j, by the same brute force
    for edit, new in ((Intervention(layer, j, "scale", 3.0, kind), 3 * a[..., j]),
                      (Intervention(layer, j, "set", 2.0, kind), torch.full_like(a[..., j], 2.0))):
        handle = loaded.model.transformer.h[layer].mlp.register_forward_hook(
            lambda module, args, out, new=new: out + (new - a[..., j])[..., None] * d.decoder[j])
        try:
            expected = _logits(loaded)
        finally:
            handle.remove()
        with intervene(view, [edit]):
            torch.testing.assert_close(_logits(loaded), expected, rtol=0, atol=1e-5)


def test_an_edit_of_nothing_gives_the_models_own_logits_exactly(attached):
    loaded, _ = attached
    clean = _logits(loaded)
    with intervene(loaded.view, [Intervention(1, 3, "scale", 1.0, "transcoder"),
                                 Intervention(2, 0, "scale", 1.0, "sae")]):
        assert torch.equal(_logits(loaded), clean)
    assert torch.equal(_logits(loaded), clean)  # and the hooks are gone


def test_latent_edits_are_written_and_refused_as_addresses(attached):
    loaded, latents = attached
    have = latents.layout.latents
    edit = parse_edit("off", "t2:3", 6, 50, have)
    assert edit == Intervention(1, 3, "off", kind="transcoder") and edit_text(edit) == ("off", "t2:3")
    edit = parse_edit("scale", "s3:9=2", 6, 50, have)
    assert edit == Intervention(2, 9, "scale", 2.0, "sae") and edit_text(edit) == ("scale", "s3:9=2")
    assert parse_edit("set", "2:3=1.5", 6, 50, have) == Intervention(1, 3, "set", 1.5)  # a neuron, as before
    with pytest.raises(FfkvError, match="latents 0..9"):
        parse_edit("off", "t2:10", 6, 50, have)
    with pytest.raises(FfkvError, match="--dictionary"):
        parse_edit("off", "t2:3", 6, 50)
    view = loaded.view
    view.latents = None
    try:
        with pytest.raises(FfkvError, match="dictionary attached"):
            with intervene(view, [Intervention(1, 3, "off", kind="transcoder")]):
                pass
    finally:
        latents.attach()


@pytest.mark.parametrize("layer,kind,site", [(1, "transcoder", "ff_in"), (2, "sae", "ff_out")])
def test_the_trace_shows_an_edited_latent_as_its_own_activation_edited(attached, layer, kind, site):
    """The trace lists an edited latent with a'_j: the edit applied to the activation the latent reads in the edited
    model. An SAE reads the FF output the edit replaces, so its a_j comes from the layer's own output (the brute force
    here: a clean pass, the layers before being unedited); its final predictions are the edited model's."""
    from ffkv.explorer.tracing import trace

    loaded, latents = attached
    view, d = loaded.view, latents.dictionaries[layer]
    ids = IDS[0].tolist()
    a = d.encode(_clean(view, site, layer))[0, -1]
    j = int(a.argmax())
    assert a[j] > 0
    edit = Intervention(layer, j, "scale", 3.0, kind)
    traced = trace(loaded, ids, [edit], latents=latents)
    shown = {x["key"]: x for x in traced.layers[layer].latents}
    assert shown[j]["edit"] == edit
    assert shown[j]["coefficient"] == pytest.approx(3 * float(a[j]), rel=1e-5)
    with intervene(view, [edit]), torch.no_grad():
        p = loaded.model(input_ids=IDS[:1]).logits[0, -1].float().softmax(-1)
    assert traced.final[0].token_id == int(p.argmax()) and traced.final[0].prob == pytest.approx(float(p.max()))
    assert view.latents is latents  # the attachment the trace found is left as it was
