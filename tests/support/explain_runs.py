"""A tiny model with one planted memory whose right explanation is known, and its run (tests/tools).

Memory `PLANTED` of layer 0 of a tiny GPT-2 (character tokenizer) fires on the character `CHAR` and nowhere
else: its key is the direction that separates the FF inputs at that character from all others, scaled so that
m is about 10 there and about 0 elsewhere. The model is registered as ``tiny-planted`` for the ffkv command
(`install`), and ``python -m support.explain_runs ARGS`` runs the command with it in a fresh process.

`planted_dictionary` is a hand-built ReLU transcoder of layer 0 whose latent `PLANTED_LATENT` is the planted
memory's key itself (so it fires on `CHAR` and is exactly 0 elsewhere), beside `N_LATENTS` - 1 latents with random
directions that fire on many characters; `planted_latent_run` indexes the corpus with it.
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
#: The dictionary's latent that fires on CHAR alone, among its latents.
PLANTED_LATENT, N_LATENTS = 3, 12


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


def planted_dictionary(loaded: LoadedModel):
    """A ReLU transcoder of layer 0 (`N_LATENTS` latents, seeded): latent `PLANTED_LATENT` is the planted key and
    bias (a_j ~ 10 on CHAR, 0 elsewhere: ReLU clips the rest), the others random unit directions with no bias."""
    from ffkv.dictionaries import Dictionary

    view = loaded.view
    g = torch.Generator().manual_seed(11)
    encoder = torch.randn(N_LATENTS, view.d_model, generator=g)
    encoder = 3 * encoder / encoder.norm(dim=1, keepdim=True)
    bias = torch.zeros(N_LATENTS)
    encoder[PLANTED_LATENT] = view.keys(0)[PLANTED].detach()
    bias[PLANTED_LATENT] = view.key_bias(0)[PLANTED].detach()
    return Dictionary(kind="transcoder", layer=0, encoder=encoder, encoder_bias=bias,
                      decoder=torch.randn(N_LATENTS, view.d_model, generator=g), decoder_bias=torch.zeros(view.d_model),
                      activation="relu")


def planted_latent_run(folder: Path, top_k: int = 10, control_keys: int = 16) -> tuple[Path, LoadedModel]:
    """Index the line corpus with the planted model and `planted_dictionary` (saved as FOLDER/planted.npz): top-10,
    both signs, `control_keys` control memories and control latents per layer."""
    from ffkv.dictionaries import save_npz

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines()) + "\n")
    loaded = planted()
    path = save_npz(planted_dictionary(loaded), folder / "planted.npz")
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), folder / "run",
                IndexOptions(top_k=top_k, control_keys=control_keys), progress=False, dictionary=path)
    return folder / "run", loaded


if __name__ == "__main__":
    from ffkv import cli

    install()
    sys.exit(cli.main(sys.argv[1:]))
