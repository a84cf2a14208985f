"""Tiny indexed runs to analyse, shared by the experiment tests (a plain module: `conftest` names clash)."""

from __future__ import annotations

import random
from pathlib import Path

from ffkv.corpus import CorpusSpec
from ffkv.indexing.indexer import IndexOptions, build_index
from support.helpers import loaded_tiny

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "x", "quick", "red", "of"]


def write_corpus(path: Path, n: int = 120, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def make_run(folder: Path, family: str = "gpt2", n: int = 120, top_k: int = 8, loaded=None, split: str = "all"):
    """(run path, loaded model) of a tiny model indexed on a small random-word corpus."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(folder / "corpus.txt", n)
    loaded = loaded or loaded_tiny(family, bos=(family == "llama"), eos=(family == "bert"))
    spec = CorpusSpec(source=str(corpus), unit="line", split=split, heldout_fraction=0.25)
    build_index(loaded, spec, folder / "run", IndexOptions(top_k=top_k), progress=False)
    return folder / "run", loaded
