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


def gpt2_small(device: str = "cpu", dtype: str = "float32", layers: int = 12):
    """A randomly initialised GPT-2-small-shaped model (124M parameters) with the real GPT-2 tokenizer."""
    import transformers as tf

    from ffkv.memories.view import MemoryView
    from ffkv.models.loading import DTYPES, LoadedModel
    from ffkv.models.tokenizer import HFTokenizer

    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_inner=3072, vocab_size=50257)
    model = tf.GPT2LMHeadModel(config).eval().to(device=device, dtype=DTYPES[dtype])
    model.requires_grad_(False)
    data = shared_data()
    if data is None or not (data / "tokenizers" / "gpt2").is_dir():
        raise SystemExit("benchmark needs ../shared/data/tokenizers/gpt2 (or FFKV_SHARED_DATA)")
    tokenizer = HFTokenizer(tf.AutoTokenizer.from_pretrained(str(data / "tokenizers" / "gpt2")))
    return LoadedModel(model, tokenizer, MemoryView(model), "gpt2-small-shaped-random", dtype, device)


def corpus_file(n_lines: int) -> Path:
    """The first n non-empty article lines of WikiText-103 validation then test, as a temporary text file."""
    lines = []
    for split in ("valid", "test"):
        src = shared_data() / "wikitext-103" / f"wiki.{split}.raw"
        if src.exists():
            lines += [l.strip() for l in src.read_text().splitlines() if l.strip() and not l.strip().startswith("=")]
    path = Path(tempfile.mkdtemp()) / "corpus.txt"
    path.write_text("\n".join(lines[:n_lines]) + "\n")
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
