"""What the memory page computes with the model when it is asked for (docs/definitions.md).

- `value_tokens`: a value's top and bottom tokens under a projection the reader picks (ffkv's projection
  vocabulary, `ffkv.memories.projection.PROJECTIONS`: ``identity``, the paper's, or ``final-norm``), read as
  probabilities p = softmax(N(v_i)·Eᵀ) or as the raw logits N(v_i)·Eᵀ (`SHOWN`). One value is one (|V| x d)
  product.
- `context_coefficients`: m_i at every position of whole examples (a key's trigger
  examples), in one batched forward pass that stops after the key's layer.
"""

from __future__ import annotations

import numpy as np
import torch

from ffkv.errors import FfkvError
from ffkv.memories.projection import (PROJECTIONS, UNIFORM_ENTROPY_SHARE, entropy_share, logits,
                                     reading_projection)
from ffkv.memories.sets import Latents, MemorySet, Neurons
from ffkv.models.loading import LoadedModel
from ffkv.tools.activations import token_coefficients, token_latent_activations

#: How a value's tokens are read: their probabilities p, or the raw logits.
SHOWN = ("p", "logit")


def check_reading(projection: str, shown: str) -> None:
    """A projection of `PROJECTIONS` and a reading of `SHOWN`, or one line naming the choices."""
    if projection == "logits":  # the explorer's former third projection: now a reading of the identity one
        raise FfkvError("projection=logits is written projection=identity with shown=logit")
    if projection not in PROJECTIONS:
        raise FfkvError(f"projection must be one of {', '.join(PROJECTIONS)}, got {str(projection)[:40]!r}")
    if shown not in SHOWN:
        raise FfkvError(f"shown must be one of {', '.join(SHOWN)}, got {str(shown)[:40]!r}")


@torch.no_grad()
def default_reading(loaded: LoadedModel | None) -> str:
    """The projection a page reads a value under when none is asked for: the model's own
    (`ffkv.memories.projection.reading_projection`), the identity while no model is loaded."""
    view = getattr(loaded, "view", None)
    return reading_projection(view) if view is not None else "identity"


def value_tokens(loaded: LoadedModel, layer: int, key: int, projection: str, n: int, target: int | None = None,
                 shown: str = "p", memories: MemorySet | None = None) -> dict:
    """The n top and n bottom tokens of value v_i of a layer under `projection` (`PROJECTIONS`), read as `shown`
    (`SHOWN`: p or the logit); the value is memory `key` of `memories` (default: the model's neurons; a
    dictionary's `Latents`: its decoder row).

    Returns {"shown": "p" | "logit", "top": [(token_id, value)], "bottom": [(token_id, value)], "top_value": the
    top token's p or logit, "target_rank": `target`'s rank, 1 for the top token, as every rank of a token in a
    distribution counts (ties in its favour; None without one), "top_p": the top token's p, "entropy_share": the
    distribution's entropy over log|V|, "uniform": whether it reads as uniform (`projection.entropy_share`)},
    bottom listed from the least likely up.
    """
    check_reading(projection, shown)
    memories = memories or Neurons(loaded.view)
    z = logits(loaded.view, memories.values(layer)[key], projection)
    values = z.softmax(-1) if shown == "p" else z
    n = min(n, z.numel())
    top = torch.topk(z, n)
    bottom = torch.topk(-z, n)
    known = target is not None and 0 <= int(target) < z.numel()
    share = entropy_share(z)
    return {"shown": shown,
            "top": [(int(i), float(values[i])) for i in top.indices],
            "bottom": [(int(i), float(values[i])) for i in bottom.indices],
            "top_value": float(values[top.indices[0]]),
            "target_rank": 1 + int((z > z[int(target)]).sum()) if known else None,
            "top_p": float(z.softmax(-1)[top.indices[0]]), "entropy_share": share,
            "uniform": share > UNIFORM_ENTROPY_SHARE}


def context_coefficients(loaded: LoadedModel, layer: int, key: int, token_lists: list[list[int]],
                         batch_size: int = 16) -> list[np.ndarray]:
    """m_i of key `key` of `layer` at every position of each whole example (float32 arrays, in input order;
    `ffkv.tools.activations.token_coefficients`, the owner).

    For a causal model the value at position j is the prefix x_1..x_{j+1}'s coefficient, so the
    trigger position's value equals the stored one; an encoder sees the whole example, as the index does.
    """
    return [m[:, 0] for m in token_coefficients(loaded, layer, [key], token_lists, batch_size=batch_size)]


def latent_context(loaded: LoadedModel, latents: Latents, layer: int, key: int, token_lists: list[list[int]],
                   batch_size: int = 16) -> list[np.ndarray]:
    """a_j of latent `key` of the dictionary at `layer` at every position of each whole example (float32 arrays, in
    input order; `ffkv.tools.activations.token_latent_activations`, the owner): what a latent page shades where the
    build stored no activations."""
    from ffkv.memories.latent_keys import LatentKeys

    keys = LatentKeys({layer: latents.dictionaries[layer]}, n_control=0, seed=0, device=loaded.view.device)
    return [a[:, 0] for a in token_latent_activations(loaded, keys, layer, [key], token_lists, batch_size=batch_size)]
