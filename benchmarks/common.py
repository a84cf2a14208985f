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
#: (Baevski & Auli 2019: 16 layers, d=1024, d_m=4096; GPT-2's vocabulary stands in for its 267k words).
SHAPES = {"gpt2-small": (12, 768, 12, 3072), "paper": (16, 1024, 16, 4096)}


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
    config = tf.GPT2Config(n_layer=layers or n_layer, n_embd=d, n_head=heads, n_inner=d_m, vocab_size=50257)
    model = tf.GPT2LMHeadModel(config).eval().to(device=device, dtype=DTYPES[dtype])
    model.requires_grad_(False)
    data = shared_data()
    if data is None or not (data / "tokenizers" / "gpt2").is_dir():
        raise SystemExit("benchmark needs ../shared/data/tokenizers/gpt2 (or FFKV_SHARED_DATA)")
    tokenizer = HFTokenizer(tf.AutoTokenizer.from_pretrained(str(data / "tokenizers" / "gpt2")))
    return LoadedModel(model, tokenizer, MemoryView(model), f"{shape}-shaped-random", dtype, device)


def corpus_file(n_lines: int, repeats: int = 1) -> Path:
    """The first n non-empty article lines of WikiText-103 validation then test, as a temporary text file.

    `repeats` > 1 writes those lines that many times over, for a corpus larger than the
    two splits (about 0.5M tokens); repeated sentences tie, which the index breaks exactly.
    """
    lines = []
    for split in ("valid", "test"):
        src = shared_data() / "wikitext-103" / f"wiki.{split}.raw"
        if src.exists():
            lines += [l.strip() for l in src.read_text().splitlines() if l.strip() and not l.strip().startswith("=")]
    path = Path(tempfile.mkdtemp()) / "corpus.txt"
    path.write_text(("\n".join(lines[:n_lines]) + "\n") * repeats)
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
