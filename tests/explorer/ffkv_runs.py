"""Small run directories for the report and explorer tests: a tiny GPT-2, a line corpus, fake analyses."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd

from ffkv.corpus import CorpusSpec
from ffkv.index.indexer import IndexOptions, build_index
from helpers import loaded_tiny

WORDS = ("the cat sat on the mat", "a part of the city", "rivers flow into the sea", "she was born in Paris",
         "the game ended in a draw", "prices rose by ten percent", "he plays the violin well",
         "the bridge was built in stone", "rain fell over the hills", "they sang <b>loud</b> & clear")


def corpus_lines(n: int = 48) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} {i}" for i in range(n)]


def sharpen(loaded, embedding: float = 20.0, values: float = 5.0):
    """Scale a tiny random model's embedding and values so that its predictions are not uniform
    and a single memory visibly moves them (a random init gives p ~ 1/|V| everywhere)."""
    import torch

    with torch.no_grad():
        loaded.model.get_input_embeddings().weight.mul_(embedding)
        for layer in range(loaded.view.n_layers):
            loaded.view.values(layer).mul_(values)
    return loaded


def index_run(folder: Path, family: str = "gpt2", top_k: int = 5):
    """Index the line corpus with a tiny model; returns (run path, loaded model)."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines()) + "\n")
    loaded = sharpen(loaded_tiny(family))
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), folder / "run", IndexOptions(top_k=top_k),
                progress=False)
    return folder / "run", loaded


def add_analyses(run: Path, n_layers: int = 3, d_m: int = 40) -> None:
    """Tables and figures shaped like those of `ffkv analyze` (the report discovers them by name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (run / "metrics").mkdir(exist_ok=True)
    (run / "figures").mkdir(exist_ok=True)
    rates = pd.DataFrame({"layer": np.arange(n_layers), "agreement_rate": np.linspace(0.0, 0.035, n_layers)})
    rates.to_parquet(run / "metrics" / "values.parquet")
    rng = np.random.default_rng(0)
    labels = rng.choice(["shallow", "semantic", "both", "none"], size=n_layers * d_m)
    pd.DataFrame({"layer": np.repeat(np.arange(n_layers), d_m), "key": np.tile(np.arange(d_m), n_layers),
                  "label": labels, "description": [f"ends with 'x{i}' <i>" for i in range(n_layers * d_m)],
                  "shallow_score": rng.random(n_layers * d_m)}).to_parquet(run / "metrics" / "patterns.parquet")
    for name, fmt in (("values", "png"), ("patterns", "svg"), ("refinement", "png")):
        fig, ax = plt.subplots(figsize=(4, 3))
        ax.bar(np.arange(n_layers), rng.random(n_layers) + 0.2, color="tab:blue")
        ax.set_title(name)
        fig.savefig(run / "figures" / f"{name}.{fmt}", dpi=60)
        plt.close(fig)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
