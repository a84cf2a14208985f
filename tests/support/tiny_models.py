"""Tiny randomly initialised models, one per supported family, built from configs offline."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 97
D = 16
D_M = 40
LAYERS = 3


def _configs() -> dict[str, tuple[type, object]]:
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    return {
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_embd=D, n_layer=LAYERS, n_head=2, n_inner=D_M, n_positions=64, **common)),
        "gpt_neo": (tf.GPTNeoForCausalLM, tf.GPTNeoConfig(hidden_size=D, num_layers=LAYERS, num_heads=2, intermediate_size=D_M,
                                                          attention_types=[[["global", "local"], 1], [["global"], 1]],
                                                          window_size=4, max_position_embeddings=64, **common)),
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2,
                                                             intermediate_size=D_M, use_parallel_residual=False,
                                                             max_position_embeddings=64, **common)),
        "gpt_neox_parallel": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2,
                                                                      intermediate_size=D_M, use_parallel_residual=True,
                                                                      max_position_embeddings=64, **common)),
        "gptj": (tf.GPTJForCausalLM, tf.GPTJConfig(n_embd=D, n_layer=LAYERS, n_head=2, n_inner=D_M, rotary_dim=4, n_positions=64, **common)),
        "opt": (tf.OPTForCausalLM, tf.OPTConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, ffn_dim=D_M,
                                                word_embed_proj_dim=D, max_position_embeddings=64, **common)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                                      intermediate_size=D_M, max_position_embeddings=64, **common)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                                            intermediate_size=D_M, max_position_embeddings=64, **common)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                                      intermediate_size=D_M, max_position_embeddings=64, **common)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=D_M,
                                                   max_position_embeddings=64, **common)),
        "roberta": (tf.RobertaForMaskedLM, tf.RobertaConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=2,
                                                            intermediate_size=D_M, max_position_embeddings=70, pad_token_id=1, **common)),
    }


FAMILIES = tuple(_configs())


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 model of the family, randomly initialised with a fixed seed, in eval mode."""
    cls, config = _configs()[family]
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Random biases, so that bias handling is exercised (HF initialises them to zero).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model
