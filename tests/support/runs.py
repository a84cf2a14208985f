"""Run directories built by the real pipeline (index, then analyze), for the surface tests.

A tiny GPT-2 built from a config, with a character tokenizer, indexes a small line
corpus; `analyzed_run` then runs every experiment of `ffkv analyze` on it. The report,
explorer and notebook tests read what these write, never hand-made tables.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from ffkv.corpus import CorpusSpec
from ffkv.experiments import EXPERIMENTS, analyze
from ffkv.indexing.indexer import IndexOptions, build_index
from support.helpers import loaded_tiny

WORDS = ("the cat sat on the mat", "a part of the city", "rivers flow into the sea", "she was born in Paris",
         "the game ended in a draw", "prices rose by ten percent", "he plays the violin well",
         "the bridge was built in stone", "rain fell over the hills", "they sang <b>loud</b> & clear")
N_LINES = 48


def corpus_lines(n: int = N_LINES) -> list[str]:
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
    loaded = sharpen(loaded_tiny(family, bos=(family == "llama"), eos=(family == "bert")))
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), folder / "run", IndexOptions(top_k=top_k),
                progress=False)
    return folder / "run", loaded


def analyzed_run(folder: Path, family: str = "gpt2", top_k: int = 5):
    """`index_run`, then every experiment of `ffkv analyze` (held out: the same lines; membership: the corpus
    as members, other lines as non-members; an encoder skips it); (run, loaded). The explorer's lookups store the
    trigger examples' coefficients (`storing_coefficients`), as they do for a model of a real size."""
    run, loaded = index_run(folder, family, top_k)
    unseen = folder / "unseen.txt"
    unseen.write_text("\n".join(f"{line} again" for line in reversed(corpus_lines())) + "\n")
    only = [name for name in EXPERIMENTS if not (name == "membership" and loaded.view.encoder)]
    with storing_coefficients():
        analyze(run, only=only, eval_corpus=str(folder / "corpus.txt"), n_eval=N_LINES, progress=False,
                loaded=loaded, options={"membership": {"member_corpus": str(folder / "corpus.txt"),
                                                       "nonmember_corpus": str(unseen)}})
    return run, loaded


@contextlib.contextmanager
def storing_coefficients():
    """Within the block the explorer's lookups store the trigger examples' per-token coefficients whatever the
    model's size (`ffkv.experiments.trigger_contexts.LIVE_MACS` at 0): a test model's pages would compute their own,
    and the stored path is the one a model of a real size takes."""
    import pytest

    from ffkv.experiments import trigger_contexts

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trigger_contexts, "LIVE_MACS", 0.0)
        yield


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def plant_memory(loaded, layer: int, key: int, scale: float = 50.0) -> int:
    """Make memory (layer, key) of a tiny GPT-2 decide every prediction, and return the token it writes.

    Its key fires the same at every position (zero key row, bias `scale`, so m = gelu(scale) = scale) and
    its value is a large multiple of E[t] for t, the token whose embedding has the largest norm: after
    the final normalization the residual points along E[t], and E[t]·E[t] > E[j]·E[t] for every other j.
    Switched off (m = 0), the model computes what it computes with that value set to zero.
    """
    import torch

    view = loaded.view
    with torch.no_grad():
        target = int(view.unembedding.norm(dim=1).argmax())
        view.keys(layer)[key].zero_()
        view.key_bias(layer)[key] = scale
        view.values(layer)[key] = 20.0 * view.unembedding[target] / view.unembedding[target].norm()
    return target
