"""fairseq transformer_lm checkpoints (the paper's model format) load natively and match an independent forward pass."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

import ffkv.models  # noqa: F401 - registers the loaders
from ffkv.errors import FfkvError
from ffkv.models.fairseq_lm import FairseqDictTokenizer, moses_split
from ffkv.models.loading import load_model
from support.helpers import assert_memory_view_consistent

D, FFN, LAYERS, HEADS = 16, 40, 2, 2
CUTOFF = [16, 32, 48]  # bands of the adaptive input and softmax; vocabulary 48
WORDS = [f"w{i}" for i in range(38)] + ["well", "known"]  # 4 specials + 40 words; 4 made-up words pad to 48


def _sinusoid(n, dim, pad):
    half = dim // 2
    freq = [math.exp(-j * math.log(10000) / (half - 1)) for j in range(half)]
    table = torch.tensor([[math.sin(p * f) for f in freq] + [math.cos(p * f) for f in freq] for p in range(n)])
    table[pad] = 0
    return table


def _write_checkpoint(tmp_path, *, tied=True, old_names=False, final_norm=False, seed=0, cfg=False):
    """A tiny wiki103-style checkpoint: same parameter names and shape pattern as transformer_lm.wiki103.adaptive."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {"decoder.version": torch.tensor([3.0]), "decoder.embed_positions._float_tensor": torch.zeros(1)}
    prev = 0
    dims = []
    for b, end in enumerate(CUTOFF):
        dim = D // 4**b
        dims.append(dim)
        sd[f"decoder.embed_tokens.embeddings.{b}.0.weight"] = r(end - prev, dim)
        sd[f"decoder.embed_tokens.embeddings.{b}.1.weight"] = r(D, dim)
        prev = end
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        if old_names:
            sd[p + "self_attn.in_proj_weight"] = r(3 * D, D)
            sd[p + "self_attn.in_proj_bias"] = r(3 * D, scale=0.1)
            sd[p + "layer_norms.0.weight"] = 1 + r(D, scale=0.1)
            sd[p + "layer_norms.0.bias"] = r(D, scale=0.1)
            sd[p + "layer_norms.1.weight"] = 1 + r(D, scale=0.1)
            sd[p + "layer_norms.1.bias"] = r(D, scale=0.1)
        else:
            for name in ("q_proj", "k_proj", "v_proj"):
                sd[p + f"self_attn.{name}.weight"] = r(D, D)
                sd[p + f"self_attn.{name}.bias"] = r(D, scale=0.1)
            for name in ("self_attn_layer_norm", "final_layer_norm"):
                sd[p + f"{name}.weight"] = 1 + r(D, scale=0.1)
                sd[p + f"{name}.bias"] = r(D, scale=0.1)
        sd[p + "self_attn.out_proj.weight"] = r(D, D)
        sd[p + "self_attn.out_proj.bias"] = r(D, scale=0.1)
        sd[p + "fc1.weight"] = r(FFN, D)
        sd[p + "fc1.bias"] = r(FFN, scale=0.1)
        sd[p + "fc2.weight"] = r(D, FFN)
        sd[p + "fc2.bias"] = r(D, scale=0.1)
    if final_norm:
        sd["decoder.layer_norm.weight"] = 1 + r(D, scale=0.1)
        sd["decoder.layer_norm.bias"] = r(D, scale=0.1)
    sd["decoder.adaptive_softmax.version"] = torch.tensor([1])
    if tied:  # --tie-adaptive-weights --tie-adaptive-proj: TiedHeadModule and TiedLinear copies
        sd["decoder.adaptive_softmax.head.word_proj.weight"] = sd["decoder.embed_tokens.embeddings.0.0.weight"]
        sd["decoder.adaptive_softmax.head.class_proj.weight"] = r(len(CUTOFF) - 1, D)
        for b in range(1, len(CUTOFF)):
            sd[f"decoder.adaptive_softmax.tail.{b - 1}.0.weight"] = sd[f"decoder.embed_tokens.embeddings.{b}.1.weight"]
            sd[f"decoder.adaptive_softmax.tail.{b - 1}.2.weight"] = sd[f"decoder.embed_tokens.embeddings.{b}.0.weight"]
    else:
        sd["decoder.adaptive_softmax.head.weight"] = r(CUTOFF[0] + len(CUTOFF) - 1, D)
        for b in range(1, len(CUTOFF)):
            sd[f"decoder.adaptive_softmax.tail.{b - 1}.0.weight"] = r(dims[b], D)
            sd[f"decoder.adaptive_softmax.tail.{b - 1}.2.weight"] = r(CUTOFF[b] - CUTOFF[b - 1], dims[b])
    args = argparse.Namespace(
        arch="transformer_lm_wiki103", decoder_layers=LAYERS, decoder_embed_dim=D, decoder_ffn_embed_dim=FFN,
        decoder_attention_heads=HEADS, decoder_normalize_before=True, activation_fn="relu", adaptive_input=True,
        adaptive_input_cutoff="16,32", adaptive_softmax_cutoff="16,32", tie_adaptive_weights=tied,
        tie_adaptive_proj=tied, no_decoder_final_norm=not final_norm, max_target_positions=64,
    )
    # Older checkpoints keep an argparse Namespace in 'args'; newer ones a config with a 'model' part, a plain
    # dict or (fairseq 0.10-0.11) an omegaconf DictConfig, pickled with omegaconf's own classes.
    if cfg == "omegaconf":
        from omegaconf import OmegaConf

        cfg = OmegaConf.create({"model": vars(args), "task": {"tokens_per_sample": 64}})
    torch.save({"cfg": cfg if not isinstance(cfg, bool) else {"model": vars(args)}, "model": sd} if cfg
               else {"args": args, "model": sd}, tmp_path / "model.pt")
    (tmp_path / "dict.txt").write_text("".join(f"{w} {1000 - i}\n" for i, w in enumerate(WORDS)))
    return sd


def _reference_log_probs(sd, ids, final_norm=False):
    """The wiki103 transformer_lm forward pass written out with plain tensor ops (one sequence, no padding)."""
    def band(w):
        for b, end in enumerate(CUTOFF):
            if w < end:
                return b, w - (CUTOFF[b - 1] if b else 0)

    rows = []
    for w in ids:
        b, j = band(w)
        rows.append(sd[f"decoder.embed_tokens.embeddings.{b}.1.weight"] @ sd[f"decoder.embed_tokens.embeddings.{b}.0.weight"][j])
    x = math.sqrt(D) * torch.stack(rows) + _sinusoid(len(ids) + 2, D, 1)[2 : 2 + len(ids)]
    t = len(ids)
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        if p + "self_attn.in_proj_weight" in sd:
            wq, wk, wv = sd[p + "self_attn.in_proj_weight"].chunk(3)
            bq, bk, bv = sd[p + "self_attn.in_proj_bias"].chunk(3)
            ln1 = (sd[p + "layer_norms.0.weight"], sd[p + "layer_norms.0.bias"])
            ln2 = (sd[p + "layer_norms.1.weight"], sd[p + "layer_norms.1.bias"])
        else:
            wq, wk, wv = (sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
            bq, bk, bv = (sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
            ln1 = (sd[p + "self_attn_layer_norm.weight"], sd[p + "self_attn_layer_norm.bias"])
            ln2 = (sd[p + "final_layer_norm.weight"], sd[p + "final_layer_norm.bias"])
        h = F.layer_norm(x, (D,), *ln1)
        q, k, v = h @ wq.T + bq, h @ wk.T + bk, h @ wv.T + bv
        heads = []
        hd = D // HEADS
        for a in range(HEADS):
            s = slice(a * hd, (a + 1) * hd)
            scores = (q[:, s] * hd**-0.5) @ k[:, s].T
            scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
            heads.append(scores.softmax(-1) @ v[:, s])
        x = x + torch.cat(heads, -1) @ sd[p + "self_attn.out_proj.weight"].T + sd[p + "self_attn.out_proj.bias"]
        h = F.layer_norm(x, (D,), *ln2)
        x = x + torch.relu(h @ sd[p + "fc1.weight"].T + sd[p + "fc1.bias"]) @ sd[p + "fc2.weight"].T + sd[p + "fc2.bias"]
    if final_norm:
        x = F.layer_norm(x, (D,), sd["decoder.layer_norm.weight"], sd["decoder.layer_norm.bias"])
    if "decoder.adaptive_softmax.head.weight" in sd:
        head = x @ sd["decoder.adaptive_softmax.head.weight"].T
        tails = [x @ sd[f"decoder.adaptive_softmax.tail.{b}.0.weight"].T @ sd[f"decoder.adaptive_softmax.tail.{b}.2.weight"].T
                 for b in range(2)]
    else:
        head = torch.cat([x @ sd["decoder.adaptive_softmax.head.word_proj.weight"].T,
                          x @ sd["decoder.adaptive_softmax.head.class_proj.weight"].T], -1)
        tails = [x @ sd[f"decoder.adaptive_softmax.tail.{b}.0.weight"] @ sd[f"decoder.adaptive_softmax.tail.{b}.2.weight"].T
                 for b in range(2)]
    head = head.log_softmax(-1)
    out = [head[:, : CUTOFF[0]]] + [tails[b].log_softmax(-1) + head[:, CUTOFF[0] + b, None] for b in range(2)]
    return torch.cat(out, -1), x


@pytest.mark.parametrize("tied,old_names,final_norm", [(True, False, False), (False, True, True)])
def test_logits_match_independent_reference(tmp_path, tied, old_names, final_norm):
    sd = _write_checkpoint(tmp_path, tied=tied, old_names=old_names, final_norm=final_norm)
    loaded = load_model(str(tmp_path))
    model, view = loaded.model, loaded.view
    assert model.config.model_type == "fairseq_transformer_lm"
    assert (view.n_layers, view.d_m, view.d_model, view.vocab_size) == (LAYERS, FFN, D, 48)
    ids = [2, 5, 17, 40, 33, 7, 47, 20]
    expect, features = _reference_log_probs(sd, ids, final_norm=final_norm)
    got = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(len(ids)), rtol=1e-5, atol=1e-5)
    # The effective E: within-band logits are E·h; the head rows are the head word matrix.
    E = view.unembedding
    assert E.shape == (48, D)
    band = features @ E[CUTOFF[1]:].T
    torch.testing.assert_close(band.log_softmax(-1), got[:, CUTOFF[1]:].log_softmax(-1), rtol=1e-4, atol=1e-4)
    shared = model.decoder.output_layer.tail[0][2].weight is model.decoder.embed_tokens.embeddings[1][0].weight
    assert shared == tied  # fairseq's tied parameters are one tensor in memory, untied ones are not
    if tied:  # tied: the effective rows are the adaptive-input embeddings of the words
        emb = sd["decoder.embed_tokens.embeddings.1.1.weight"] @ sd["decoder.embed_tokens.embeddings.1.0.weight"].T
        torch.testing.assert_close(E[16:32], emb.T)


def test_right_padding_and_memory_view(tmp_path):
    _write_checkpoint(tmp_path, cfg=True)
    loaded = load_model(str(tmp_path))
    view = loaded.view
    ids = torch.tensor([[2, 5, 17, 40, 33, 7], [2, 9, 30, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with view.capture(("coefficients", "ff_in", "resid_mid", "ff_out", "resid_post")) as cap:
        view.forward(ids, mask)
    alone = loaded.model(ids[1:, :3]).logits
    torch.testing.assert_close(loaded.model(ids, mask).logits[1:, :3], alone, rtol=1e-5, atol=1e-5)
    assert_memory_view_consistent(view, cap, activation=torch.relu)
    # resid_post of a layer is the next layer's input; the last one feeds the output layer.
    out = loaded.model.decoder(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(cap["resid_post"][LAYERS - 1], out)
    from ffkv.memories.projection import logits

    torch.testing.assert_close(logits(view, out, "identity"), loaded.model(ids, mask).logits)


def test_an_omegaconf_config_is_read_without_omegaconf(tmp_path):
    """A newer fairseq checkpoint pickles its config with omegaconf's classes: it is read as inert stand-ins
    (nothing of omegaconf runs), giving the same model as the argparse.Namespace of the paper's checkpoint."""
    pytest.importorskip("omegaconf")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _write_checkpoint(tmp_path / "a", cfg="omegaconf")
    _write_checkpoint(tmp_path / "b")
    import torch.serialization as ts

    assert "omegaconf.dictconfig.DictConfig" in ts.get_unsafe_globals_in_checkpoint(str(tmp_path / "a" / "model.pt"))
    new, old = load_model(str(tmp_path / "a")), load_model(str(tmp_path / "b"))
    assert new.model.config.num_heads == HEADS and new.model.config.max_positions == 64  # from the config, not defaults
    ids = torch.tensor([[2, 5, 17, 40, 33, 7]])
    torch.testing.assert_close(new.model(ids).logits, old.model(ids).logits, rtol=0, atol=0)


def test_dictionary_tokenizer(tmp_path):
    _write_checkpoint(tmp_path)
    tok = load_model(str(tmp_path)).tokenizer
    # Every word of a word-level vocabulary starts a word: it reads with its leading space (one display for all).
    assert tok.vocab_size == 48 and tok.token_strings([0, 1, 2, 3, 44, 47]) == [
        " <s>", " <pad>", " </s>", " <unk>", " madeupword0000", " madeupword0003"]
    # eos first (fairseq's begin-of-sentence), dictionary ids from 4, unknown words -> <unk>.
    assert tok.encode("w0 w1 nope") == [2, 4, 5, 3]
    # Moses-style splitting only for words outside the dictionary: WikiText text is left as it is.
    assert tok.words("well-known w3") == ["well", "@-@", "known", "w3"]
    assert tok.decode(tok.encode("w0 w1")) == "</s> w0 w1"
    assert tok.special_ids == frozenset({0, 1, 2})


def test_moses_split_wikitext_conventions():
    assert moses_split("1,000.5") == ["1", "@,@", "000", "@.@", "5"]
    assert moses_split("(Paris),") == ["(", "Paris", ")", ","]
    assert moses_split("don't") == ["do", "n't"]
    assert moses_split("John's") == ["John", "'s"]
    assert moses_split("@-@") == ["@-@"]


def test_dict_parsing_and_errors(tmp_path):
    (tmp_path / "dict.txt").write_text("a 5\nb 3 #fairseq:overwrite\n")
    tok = FairseqDictTokenizer.from_file(tmp_path / "dict.txt")
    assert tok.symbols == ["<s>", "<pad>", "</s>", "<unk>", "a", "b"]
    torch.save({"model": {"decoder.embed_tokens.weight": torch.zeros(6, 4)}}, tmp_path / "model.pt")
    with pytest.raises(FfkvError, match="not a fairseq transformer_lm"):
        load_model(str(tmp_path))


def test_long_inputs_extend_the_sinusoidal_table(tmp_path):
    sd = _write_checkpoint(tmp_path)
    loaded = load_model(str(tmp_path))
    ids = [2] + [4 + (i * 5) % 44 for i in range(80)]  # longer than max_target_positions=64
    expect, _ = _reference_log_probs(sd, ids)
    torch.testing.assert_close(loaded.model(torch.tensor([ids])).logits[0], expect, rtol=1e-4, atol=1e-4)
