"""ffkv's own LM (ffkv_lm): memory view, padding, save/load, and the embedded ffkv-tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

import ffkv.models  # noqa: F401 - registers the loaders
from ffkv.errors import FfkvError
from ffkv.memories.architectures import architecture_of
from ffkv.memories.view import MemoryView
from ffkv.models.loading import load_model
from ffkv.models.tiny_lm import (
    FfkvLMConfig,
    FfkvLMForCausalLM,
    save_tokenizer,
    tiny_path,
    train_tokenizer,
)
from support.helpers import assert_memory_view_consistent

D, D_M, LAYERS, VOCAB = 16, 40, 3, 300


def _tiny(positions="learned", seed=0):
    torch.manual_seed(seed)
    model = FfkvLMForCausalLM(FfkvLMConfig(vocab_size=VOCAB, hidden_size=D, num_layers=LAYERS, num_heads=2,
                                           intermediate_size=D_M, max_position_embeddings=32, positions=positions,
                                           dropout=0.0)).eval()
    with torch.no_grad():  # random biases, so that bias handling is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_memory_view_matches_model(positions):
    model = _tiny(positions)
    view = MemoryView(model)
    assert architecture_of(model).family.startswith("ffkv LM")
    assert (view.n_layers, view.d_m, view.d_model, view.vocab_size) == (LAYERS, D_M, D, VOCAB)
    assert not view.gated and not view.parallel and not view.encoder
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    ids, mask = _batch()
    with view.capture(("coefficients", "ff_in", "resid_mid", "ff_out", "resid_post")) as cap:
        view.forward(ids, mask)
    block_out = {}
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: block_out.__setitem__(i, o)) for i, b in enumerate(view.blocks)]
    view.forward(ids, mask)
    for h in hooks:
        h.remove()
    assert_memory_view_consistent(view, cap, activation=torch.relu)
    for layer in range(LAYERS):
        torch.testing.assert_close(cap["resid_post"][layer], block_out[layer], rtol=1e-5, atol=1e-5)
    # logits = ln_f(resid_post[L-1]) · Eᵀ
    logits = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, view.final_norm(cap["resid_post"][LAYERS - 1]) @ view.unembedding.T,
                               rtol=1e-5, atol=1e-5)


def test_padding_left_or_right_matches_unpadded():
    model = _tiny()
    ids, mask = _batch()
    alone = model(ids[1:2, :6]).logits
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[1:2, :6], alone, rtol=1e-5, atol=1e-5)
    left = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[1:2, :6]], dim=1)
    left_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    out = model(left, attention_mask=left_mask).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 3:], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(FfkvError, match="longer than"):
        model(torch.ones(1, 40, dtype=torch.long))


def test_save_load_roundtrip(tmp_path):
    model = _tiny()
    model.save_pretrained(tmp_path)
    lines = ["In the beginning God created the heaven and the earth."] * 5 + ["And the earth was without form."]
    save_tokenizer(train_tokenizer(lines, VOCAB), tmp_path)
    loaded = load_model(str(tmp_path))
    ids, mask = _batch()
    torch.testing.assert_close(loaded.model(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    tok = loaded.tokenizer
    encoded = tok.encode("the earth")
    assert encoded[0] == 1 and 1 in tok.special_ids and tok.pad_id == 0
    assert tok.decode(encoded[1:]).strip() == "the earth"
    assert loaded.view.n_layers == LAYERS


def test_generate_after_loading_with_the_auto_classes_is_the_greedy_loop(tmp_path):
    """A saved ffkv_lm (as `ffkv prune` and `ffkv train` write one) loads with transformers' Auto class and
    generates: greedy `generate` equals appending each step's argmax by hand."""
    from transformers import AutoModelForCausalLM

    _tiny().save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == "FfkvLMForCausalLM"
    ids = _batch()[0][:, :4]
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = ids
    with torch.no_grad():
        for _ in range(6):
            expected = torch.cat([expected, model(expected).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.shape == (3, 10) and torch.equal(out, expected)


@pytest.mark.skipif(not (tiny_path() / "config.json").is_file(), reason="ffkv-tiny checkpoint not built")
def test_embedded_ffkv_tiny():
    loaded = load_model("ffkv-tiny")
    info = json.loads((tiny_path() / "training.json").read_text())
    assert info["heldout_perplexity"] < info["unigram_perplexity"] / 3
    assert (tiny_path() / "README.md").is_file()
    size = sum(p.stat().st_size for p in tiny_path().iterdir())
    assert size < 20 * 2**20
    view = loaded.view
    assert view.n_layers == info["options"]["num_layers"] and view.d_m == info["options"]["intermediate_size"]
    ids = torch.tensor([loaded.tokenizer.encode("In the beginning God created the")])
    with torch.no_grad():
        top = loaded.model(ids).logits[0, -1].topk(5).indices.tolist()
    assert "heaven" in "".join(loaded.tokenizer.token_strings(top))


@pytest.mark.skipif(not (tiny_path() / "config.json").is_file(), reason="ffkv-tiny checkpoint not built")
def test_byte_tokens_read_as_their_bytes():
    """A byte-level token that holds part of a character decodes to U+FFFD alone; its string is its bytes instead,
    so that no two tokens of the vocabulary read alike and the bytes of a character spell it."""
    tok = load_model("ffkv-tiny").tokenizer
    strings = tok.token_strings(range(tok.vocab_size))
    assert len(set(strings)) == tok.vocab_size and not any("\ufffd" in s for s in strings)
    text = "café – naïve"
    pieces = tok.token_strings(tok.encode(text)[1:])  # after <s>
    assert "<0xC3><0xA9>" in "".join(pieces) and "".join(pieces).count("<0x") == 7
    spelled = "".join(pieces)
    for char in "é–ï":
        spelled = spelled.replace("".join(f"<0x{b:02X}>" for b in char.encode()), char)
    assert spelled == " " + text  # the tokenizer adds a leading space
    assert tok.token_strings(tok.encode(" the")[1:]) == [" the"]  # whole characters decode as before
