"""Hookpoint spellings map to (FF layer, site); anything but an FF layer's input or output is refused."""

from __future__ import annotations

import pytest

from ffkv.dictionaries.hookpoints import FF_INPUT, FF_OUTPUT, ff_site, sites
from ffkv.errors import FfkvError


@pytest.mark.parametrize("hookpoint, layer, site", [
    ("layers.3.mlp", 3, "module"),                       # sparsify, Llama-style
    ("model.layers.3.mlp", 3, "module"),
    ("transformer.h.11.mlp", 11, "module"),              # GPT-2
    ("h.0.mlp", 0, "module"),                            # sparsify on GPT-2's base model
    ("gpt_neox.layers.5.mlp", 5, "module"),
    ("model.language_model.layers.7.mlp", 7, "module"),
    ("blocks.3.hook_mlp_out", 3, FF_OUTPUT),             # TransformerLens / SAELens
    ("blocks.3.ln2.hook_normalized", 3, FF_INPUT),
])
def test_common_spellings(hookpoint, layer, site):
    assert (ff_site(hookpoint).layer, ff_site(hookpoint).site) == (layer, site)


@pytest.mark.parametrize("hookpoint, words", [
    ("blocks.3.hook_resid_post", "residual stream"),
    ("layers.3", "residual stream"),
    ("blocks.3.hook_attn_out", "attention"),
    ("model.layers.3.self_attn", "attention"),
    ("blocks.3.attn.hook_z", "attention"),
    ("blocks.3.mlp.hook_post", "inside the FF layer"),
    ("layers.3.mlp.down_proj", "inside the FF layer"),
    ("blocks.3.hook_mlp_in", "before its norm"),
    ("embed", "names no FF layer"),
])
def test_other_hookpoints_are_refused_saying_ffkv_reads_ff_layers(hookpoint, words):
    with pytest.raises(FfkvError, match=words) as caught:
        ff_site(hookpoint)
    assert "ffkv reads dictionaries of FF layers" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_what_each_kind_reads_and_writes():
    assert sites("transcoder", "layers.2.mlp") == (2, FF_INPUT, FF_OUTPUT)
    assert sites("transcoder", "blocks.2.ln2.hook_normalized", "blocks.2.hook_mlp_out") == (2, FF_INPUT, FF_OUTPUT)
    assert sites("sae", "layers.2.mlp") == (2, FF_OUTPUT, FF_OUTPUT)
    assert sites("sae", "blocks.2.hook_mlp_out") == (2, FF_OUTPUT, FF_OUTPUT)
    with pytest.raises(FfkvError, match="an SAE on the FF input"):
        sites("sae", "blocks.2.ln2.hook_normalized")
    with pytest.raises(FfkvError, match="same layer"):
        sites("transcoder", "blocks.2.ln2.hook_normalized", "blocks.3.hook_mlp_out")
    with pytest.raises(FfkvError, match="a transcoder reads the FF input"):
        sites("transcoder", "blocks.2.hook_mlp_out")
