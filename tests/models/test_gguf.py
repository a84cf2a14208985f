"""Models from one GGUF file (`ffkv.models.gguf_lm`): a tiny Llama written to GGUF here, as llama.cpp's
converter writes one (its query and key rows permuted for llama.cpp's rotary layout, float32 tensors,
a byte-level BPE tokenizer in the metadata), loads back to the very same weights and tokenizer, and
indexes to the very same trigger table as the model it was written from. Broken inputs are refused
with one line.
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.memories.view import MemoryView
from ffkv.models import load_model
from ffkv.models.loading import LoadedModel

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

N_HEAD, N_HEAD_KV, D, D_M, LAYERS, CONTEXT = 4, 2, 32, 48, 2, 64
#: A few merges beyond the 256 byte tokens, so that the tokenizer is a real BPE.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 byte tokens of a byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


def _tiny_llama(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=D, intermediate_size=D_M, num_hidden_layers=LAYERS,
                                      num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV,
                                      max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      bos_token_id=vocab - 1, eos_token_id=vocab - 1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a dropped or misplaced norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for the query and key projections (its rotary layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model: torch.nn.Module, tokens: list[str], path) -> None:
    """The model in a GGUF file, as llama.cpp's `convert_hf_to_gguf.py` would write it (float32)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(D)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(D_M)
    writer.add_rope_dimension_count(D // N_HEAD)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
             "output.weight": sd["lm_head.weight"]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        names.update({
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": _permute(sd[p + "self_attn.q_proj.weight"], N_HEAD),
            f"blk.{i}.attn_k.weight": _permute(sd[p + "self_attn.k_proj.weight"], N_HEAD_KV),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        })
    for name, array in names.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the original model, its tokenizer's tokens, the GGUF file written from it)."""
    tokens = _byte_tokens() + [a + b for a, b in MERGES] + ["<|endoftext|>"]
    model = _tiny_llama(len(tokens))
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    _write_gguf(model, tokens, path)
    return model, tokens, path


def test_gguf_loads_the_written_weights_and_tokenizer(written):
    model, tokens, path = written
    loaded = load_model(str(path))
    assert type(loaded.model).__name__ == "LlamaForCausalLM" and loaded.model_id == str(path)
    assert loaded.view.n_layers == LAYERS and loaded.view.d_m == D_M and loaded.view.gated
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():  # the query and key rows back in Hugging Face's order, bit for bit
        assert torch.equal(ours[name], tensor), name
    hf = loaded.tokenizer.hf
    assert hf.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    ids = hf(" the cat in the hat", add_special_tokens=False)["input_ids"]
    # The merges apply in rank order ("Ġ t", "h e", "Ġt he", "i n"), nothing else merges.
    assert hf.convert_ids_to_tokens(ids) == ["Ġthe", "Ġ", "c", "a", "t", "Ġ", "in", "Ġthe", "Ġ", "h", "a", "t"]
    assert loaded.tokenizer.decode(ids) == " the cat in the hat"
    assert loaded.tokenizer.token_strings(ids[:2]) == [" the", " "]  # read as a byte-level BPE's word starts


def test_gguf_model_indexes_as_the_model_it_was_written_from(written, tmp_path):
    model, tokens, path = written
    corpus = tmp_path / "lines.txt"
    corpus.write_text("".join(f"the {w} in the hat {i}\n" for i, w in enumerate(["cat", "bat", "sat", "tin", "ant"] * 4)))
    spec = CorpusSpec(source=str(corpus), unit="line")
    options, batching = IndexOptions(top_k=4, control_keys=8), BatchOptions(batch_size=4)
    from_gguf = load_model(str(path))
    direct = LoadedModel(model, from_gguf.tokenizer, MemoryView(model), "direct", "float32", "cpu")
    a = build_index(from_gguf, spec, tmp_path / "gguf", options, batching, progress=False)
    b = build_index(direct, spec, tmp_path / "direct", options, batching, progress=False)
    for table in ("trigger_examples", "control_trigger_examples"):
        ta, tb = pq.read_table(a.table(table)).to_pandas(), pq.read_table(b.table(table)).to_pandas()
        assert len(ta) == len(tb) > 0
        assert ta.equals(tb), table
    assert a.manifest().model.id == str(path) and a.manifest().model.gated


def test_broken_gguf_inputs_are_refused_with_one_line(tmp_path, monkeypatch):
    with pytest.raises(FfkvError, match="no GGUF file"):
        load_model(str(tmp_path / "absent.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(FfkvError, match="cannot read .* as a GGUF model"):
        load_model(str(junk))
    plain = tmp_path / "weights.bin"
    plain.write_bytes(b"\0" * 16)
    with pytest.raises(FfkvError, match="is a file; give the model's directory"):
        load_model(str(plain))
    for package in ("gguf", "accelerate"):  # as if the package were not installed
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, package, None)
            with pytest.raises(FfkvError, match=f"needs the {package} package: pip install 'ffkv\\[gguf\\]'"):
                load_model(str(junk))

