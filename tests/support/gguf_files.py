"""GGUF files written here, as llama.cpp's `convert_hf_to_gguf.py` writes them: a tiny Llama (its query and key
rows permuted for llama.cpp's rotary layout, float32 tensors, a byte-level BPE tokenizer in the metadata), and
optionally a chat template (tests/models/test_gguf.py, tests/tools)."""

from __future__ import annotations

import numpy as np
import torch

N_HEAD, N_HEAD_KV, D, D_M, LAYERS, CONTEXT = 4, 2, 32, 48, 2, 64
#: A plain chat template: each message as "role: content" on a line of its own.
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
#: A few merges beyond the 256 byte tokens, so that the tokenizer is a real BPE.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]


def byte_tokens() -> list[str]:
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


def tiny_llama(vocab: int) -> torch.nn.Module:
    """A tiny random Llama of `vocab` tokens (seed 0), its norms away from 1."""
    import transformers

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


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for the query and key projections (its rotary layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, tokens: list[str], path, chat_template: str | None = None) -> None:
    """The model in a GGUF file, as llama.cpp's `convert_hf_to_gguf.py` would write it (float32)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if chat_template is not None:
        writer.add_chat_template(chat_template)
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
            f"blk.{i}.attn_q.weight": permute(sd[p + "self_attn.q_proj.weight"], N_HEAD),
            f"blk.{i}.attn_k.weight": permute(sd[p + "self_attn.k_proj.weight"], N_HEAD_KV),
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


def tokens() -> list[str]:
    """The tokenizer's tokens: the 256 byte tokens, the merges' results and an end-of-text token."""
    return byte_tokens() + [a + b for a, b in MERGES] + ["<|endoftext|>"]
