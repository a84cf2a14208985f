"""Shared setup for the ratio benchmarks: a GPT-2-small-shaped model and a real corpus."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def shared_data() -> Path | None:
    """The read-only shared data folder, or None."""
    path = Path(os.environ.get("FFKV_SHARED_DATA", REPO.parent / "shared" / "data"))
    return path if path.is_dir() else None


#: name -> (layers, d, heads, d_m): GPT-2 small (124M parameters) and the paper's model
#: (Baevski & Auli 2019: 16 layers, d=1024, d_m=4096; GPT-2's vocabulary stands in for its 267k words),
#: both GPT-2 blocks (GELU); and Llama-3.1-8B (gated SiLU, 8 key-value heads, 128,256-token vocabulary).
SHAPES = {"gpt2-small": (12, 768, 12, 3072), "paper": (16, 1024, 16, 4096), "llama-8b": (32, 4096, 32, 14336)}
#: Llama-3.1-8B's vocabulary and key-value heads (grouped-query attention).
LLAMA_VOCAB, LLAMA_KV_HEADS = 128_256, 8


def gpt2_shaped(device: str = "cpu", dtype: str = "float32", shape: str = "gpt2-small", layers: int | None = None):
    """A randomly initialised GPT-2 of one of `SHAPES` with the real GPT-2 tokenizer.

    Random weights cost the same as trained ones; `layers` overrides the shape's depth.
    """
    import transformers as tf

    from ffkv.memories.view import MemoryView
    from ffkv.models.loading import DTYPES, LoadedModel
    from ffkv.models.tokenizer import HFTokenizer

    n_layer, d, heads, d_m = SHAPES[shape]
    torch.manual_seed(0)
    if shape == "llama-8b":
        # Built directly on the device in its dtype: 8B parameters never pass through float32 on the host.
        config = tf.LlamaConfig(num_hidden_layers=layers or n_layer, hidden_size=d, num_attention_heads=heads,
                                num_key_value_heads=LLAMA_KV_HEADS, intermediate_size=d_m, vocab_size=LLAMA_VOCAB,
                                max_position_embeddings=8192, hidden_act="silu", tie_word_embeddings=False)
        default = torch.get_default_dtype()
        torch.set_default_dtype(DTYPES[dtype])
        try:
            with torch.device(device):
                model = tf.LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(default)
    else:
        config = tf.GPT2Config(n_layer=layers or n_layer, n_embd=d, n_head=heads, n_inner=d_m, vocab_size=50257)
        model = tf.GPT2LMHeadModel(config).eval().to(device=device, dtype=DTYPES[dtype])
    model.requires_grad_(False)
    data = shared_data()
    if data is None or not (data / "tokenizers" / "gpt2").is_dir():
        raise SystemExit("benchmark needs ../shared/data/tokenizers/gpt2 (or FFKV_SHARED_DATA)")
    # Llama's own tokenizer is not on disk here: GPT-2's (ids < 50,257) stands in; the cost of a token is the same.
    tokenizer = HFTokenizer(tf.AutoTokenizer.from_pretrained(str(data / "tokenizers" / "gpt2")),
                            vocab_size=config.vocab_size)
    name = f"{shape}-shaped-random" + (f"-{layers}-layers" if layers else "")
    return LoadedModel(model, tokenizer, MemoryView(model), name, dtype, device)


def corpus_file(n_lines: int, repeats: int = 1, skip: int = 0) -> Path:
    """n non-empty article lines of WikiText-103 validation then test (after the first `skip`), as a
    temporary text file.

    `repeats` > 1 writes those lines that many times over, for a corpus larger than the
    two splits (about 0.5M tokens); repeated sentences tie, which the index breaks exactly.
    """
    lines = []
    for split in ("valid", "test"):
        src = shared_data() / "wikitext-103" / f"wiki.{split}.raw"
        if src.exists():
            lines += [l.strip() for l in src.read_text().splitlines() if l.strip() and not l.strip().startswith("=")]
    path = Path(tempfile.mkdtemp()) / "corpus.txt"
    path.write_text(("\n".join(lines[skip:skip + n_lines]) + "\n") * repeats)
    return path


def timed(fn) -> float:
    """Wall seconds of fn(), synchronising CUDA around it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start
