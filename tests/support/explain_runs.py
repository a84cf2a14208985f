"""A tiny model with one planted memory whose right explanation is known, and its run (tests/tools).

Memory `PLANTED` of layer 0 of a tiny GPT-2 (character tokenizer) fires on the character `CHAR` and nowhere
else: its key is the direction that separates the FF inputs at that character from all others, scaled so that
m is about 10 there and about 0 elsewhere. The model is registered as ``tiny-planted`` for the ffkv command
(`install`), and ``python -m support.explain_runs ARGS`` runs the command with it in a fresh process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ffkv.corpus import CorpusSpec
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import loading
from ffkv.models.loading import LoadedModel
from support.helpers import loaded_tiny
from support.runs import corpus_lines, sharpen

PLANTED, CHAR, NAME = 5, "a", "tiny-planted"


def planted() -> LoadedModel:
    """The tiny GPT-2 with memory (0, PLANTED) firing on CHAR (deterministic)."""
    base = sharpen(loaded_tiny("gpt2"))
    view, tok = base.view, base.tokenizer
    char = tok.encode(CHAR)[0]
    xs, hit = [], []
    with torch.no_grad(), view.capture(("ff_in",), layers=[0]) as cap:
        for line in corpus_lines():
            ids = tok.encode(line)
            view.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
            xs.append(cap["ff_in"][0][0])
            hit.append(torch.tensor(ids) == char)
    x, hit = torch.cat(xs), torch.cat(hit)
    d = x[hit].mean(0) - x[~hit].mean(0)
    d = d / d.norm()
    low, high = (x[hit] @ d).min(), (x[~hit] @ d).max()
    assert low > high, "the planted character is not separable at layer 0"
    mid = (low + high) / 2
    scale = 10 / (low - mid)
    with torch.no_grad():
        view.keys(0)[PLANTED] = scale * d
        view.key_bias(0)[PLANTED] = -scale * mid
    return LoadedModel(base.model, tok, view, NAME, "float32", "cpu")


def loader(name, dtype, device):
    if name == NAME:
        got = planted()
        return got.model, got.tokenizer
    return None


def install() -> None:
    if loader not in loading.LOADERS:
        loading.LOADERS.insert(0, loader)


def planted_run(folder: Path, top_k: int = 10) -> tuple[Path, LoadedModel]:
    """Index the line corpus with the planted model (top-10 both signs, the default 256 control memories)."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines()) + "\n")
    loaded = planted()
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), folder / "run", IndexOptions(top_k=top_k),
                progress=False)
    return folder / "run", loaded


if __name__ == "__main__":
    from ffkv import cli

    install()
    sys.exit(cli.main(sys.argv[1:]))
