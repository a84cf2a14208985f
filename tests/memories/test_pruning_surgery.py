"""Surgery: a model with memories cut out of its weights computes what the masked model computes (SPEC 9),
for every family, saved and loaded back with the standard loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from ffkv.errors import FfkvError
from ffkv.memories.pruning import kept_keys, masked, removal_count, shrink_model
from ffkv.memories.view import MemoryView
from ffkv.models import load_model
from support.tiny_models import D, D_M, FAMILIES, LAYERS, VOCAB, tiny_model

ENCODERS = ("bert", "roberta")


def tiny_ffkv_lm(seed: int = 0) -> torch.nn.Module:
    from ffkv.models.tiny_lm import FfkvLMConfig, FfkvLMForCausalLM

    torch.manual_seed(seed)
    config = FfkvLMConfig(vocab_size=VOCAB, hidden_size=D, num_layers=LAYERS, num_heads=2, intermediate_size=D_M,
                          max_position_embeddings=64, dropout=0.0)
    model = FfkvLMForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def model_of(family: str) -> torch.nn.Module:
    return tiny_ffkv_lm() if family == "ffkv_lm" else tiny_model(family)


def hf_tokenizer():
    """A real fast tokenizer to save beside the model (built offline; the tests feed ids directly)."""
    from ffkv.models.tiny_lm import train_tokenizer

    tok = train_tokenizer(["the cat sat on the mat", "a part of the city"], vocab_size=300)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>", mask_token="<unk>")


def inputs(family: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def random_removal(d_m: int, layers: int, n: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {layer: rng.choice(d_m, size=n, replace=False) for layer in range(layers)}


@pytest.mark.parametrize("family", [*FAMILIES, "ffkv_lm"])
def test_pruned_model_has_the_masked_models_logits_after_save_and_load(family, tmp_path):
    model = model_of(family)
    view = MemoryView(model)
    ids, mask = inputs(family)
    removed = random_removal(view.d_m, view.n_layers, 13, seed=3)
    with masked(view, removed):
        expected = logits(model, ids, mask)
    original = logits(model, ids, mask)
    assert not torch.allclose(expected, original, atol=1e-4)  # the removal changes the output: the test can fail

    assert shrink_model(view, removed) == D_M - 13
    assert view.d_m == D_M - 13
    torch.testing.assert_close(logits(model, ids, mask), expected, rtol=1e-5, atol=1e-5)

    model.save_pretrained(tmp_path / "m")
    hf_tokenizer().save_pretrained(tmp_path / "m")
    auto = tf.AutoModelForMaskedLM if family in ENCODERS else tf.AutoModelForCausalLM
    if family != "ffkv_lm":
        back = auto.from_pretrained(tmp_path / "m").eval()
        torch.testing.assert_close(logits(back, ids, mask), expected, rtol=1e-5, atol=1e-5)
    loaded = load_model(str(tmp_path / "m"))  # ffkv's own loader, tokenizer included
    assert loaded.view.d_m == D_M - 13 and loaded.view.n_layers == LAYERS
    torch.testing.assert_close(logits(loaded.model, ids, mask), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_surgery_keeps_the_right_rows_and_columns(family):
    """Hand check of the cut: the kept keys' rows, gate and up alike, and the kept values, in order."""
    model = model_of(family)
    view = MemoryView(model)
    layer = 1
    removed = {l: np.array([0, 5, 39]) for l in range(view.n_layers)}
    keep = [i for i in range(D_M) if i not in (0, 5, 39)]
    before_keys, before_values = view.keys(layer).clone(), view.values(layer).clone()
    before_up = view.up(layer).clone() if view.gated else None
    shrink_model(view, removed)
    torch.testing.assert_close(view.keys(layer), before_keys[keep], rtol=0, atol=0)
    torch.testing.assert_close(view.values(layer), before_values[keep], rtol=0, atol=0)
    if before_up is not None:
        torch.testing.assert_close(view.up(layer), before_up[keep], rtol=0, atol=0)
    config_size = model.config.n_inner if family == "gpt2" else model.config.intermediate_size
    assert config_size == D_M - 3


@pytest.mark.parametrize("family", ["gpt2", "llama", "ffkv_lm"])
def test_share_zero_changes_nothing(family):
    model = model_of(family)
    view = MemoryView(model)
    ids, mask = inputs(family)
    original = logits(model, ids, mask)
    with masked(view, {}):
        assert torch.equal(logits(model, ids, mask), original)
    assert shrink_model(view, {l: [] for l in range(view.n_layers)}) == D_M
    assert torch.equal(logits(model, ids, mask), original)


def test_removal_count_rounds_to_nearest_and_keeps_one_key():
    assert [removal_count(40, s) for s in (0, 0.1, 0.3, 0.5, 0.9)] == [0, 4, 12, 20, 36]
    assert removal_count(1024, 0.3) == 307  # 307.2
    assert removal_count(10, 0.25) == 3  # 2.5 rounds up
    assert removal_count(4, 0.99) == 3  # never the whole layer
    for bad in (-0.1, 1.0, 1.5, float("nan"), "0.1", True):
        with pytest.raises(FfkvError, match=r"\[0, 1\)"):
            removal_count(40, bad)


def test_unequal_counts_and_unsupported_families_are_refused():
    view = MemoryView(tiny_model("gpt2"))
    with pytest.raises(FfkvError, match="same number of removed keys"):
        kept_keys(view, {0: [1, 2], 1: [3], 2: [4, 5]})
    with pytest.raises(FfkvError, match="0..39"):
        kept_keys(view, {l: [40] for l in range(LAYERS)})
    view.model.config.model_type = "fairseq_transformer_lm"
    with pytest.raises(FfkvError, match="cannot write a smaller"):
        shrink_model(view, {l: [1] for l in range(LAYERS)})
