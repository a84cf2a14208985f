"""A memory's coefficient at every token of whole examples: what an explanation is shown and scored against.

One batched forward pass per group of examples, stopping after the layer asked for (`MemoryView.capture`); for
a causal model the value at position j is the prefix x_1..x_{j+1}'s coefficient, so a trigger position's value
equals the index's, and an encoder sees the whole example, as the index does. The random control memories
(`ffkv.memories.controls`) are computed from the same pass's FF input with the layer's own function.

A sparse dictionary's latents (`token_latent_activations`) are the index's own activations
(`ffkv.memories.latent_keys.LatentKeys.coefficients`) of what their keys read in the same kind of pass (a
transcoder: the FF input after its norm; an SAE: the FF output), and so are its control latents'.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ffkv.batching import collate, length_batches
from ffkv.corpus import Example
from ffkv.memories.controls import RandomKeys
from ffkv.memories.latent_keys import LatentKeys, SparseCoefficients
from ffkv.models.loading import LoadedModel

#: Examples per forward pass.
BATCH_SIZE = 16


@torch.no_grad()
def token_coefficients(loaded: LoadedModel, layer: int, keys: Sequence[int], token_lists: Sequence[Sequence[int]],
                       control: RandomKeys | None = None, batch_size: int = BATCH_SIZE) -> list[np.ndarray]:
    """m of memories `keys` of `layer` at every position of each example: per example (in input order) a
    float32 array (positions, len(keys)). With `control`, `keys` index its control memories instead."""
    view = loaded.view
    keys_t = torch.as_tensor(list(keys), dtype=torch.long, device=view.device)
    examples = [Example(i, np.asarray(t, dtype=np.int64), "") for i, t in enumerate(token_lists)]
    out: list[np.ndarray] = [np.zeros((0, len(keys)), np.float32)] * len(examples)
    special = loaded.special_ids
    quantity = "ff_in" if control is not None else "coefficients"
    for group in length_batches([e for e in examples if len(e.token_ids)], batch_size):
        batch = collate(group, loaded.tokenizer.pad_id, special)
        with view.capture((quantity,), layers=[layer], stop_early=True) as cap:
            view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))
        t = cap[quantity][layer]
        m = control.coefficients(layer, t) if control is not None else t
        m = m.index_select(-1, keys_t).float().cpu().numpy()
        for row, example_id in enumerate(batch.example_ids.tolist()):
            out[example_id] = m[row, :len(examples[example_id].token_ids)].copy()
    return out


@torch.no_grad()
def token_latent_activations(loaded: LoadedModel, latents: LatentKeys, layer: int, keys: Sequence[int],
                             token_lists: Sequence[Sequence[int]], control: bool = False,
                             batch_size: int = BATCH_SIZE) -> list[np.ndarray]:
    """a_j of latents `keys` of the dictionary at `layer` at every position of each example: per example (in input
    order) a float32 array (positions, len(keys)). With `control`, `keys` index the layer's control latents."""
    view = loaded.view
    keys_t = torch.as_tensor(list(keys), dtype=torch.long, device=view.device)
    examples = [Example(i, np.asarray(t, dtype=np.int64), "") for i, t in enumerate(token_lists)]
    out: list[np.ndarray] = [np.zeros((0, len(keys)), np.float32)] * len(examples)
    quantity = latents.reads(layer)
    for group in length_batches([e for e in examples if len(e.token_ids)], batch_size):
        batch = collate(group, loaded.tokenizer.pad_id, loaded.special_ids)
        with view.capture((quantity,), layers=[layer], stop_early=True) as cap:
            view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))
        found = latents.coefficients(layer, cap[quantity][layer])
        a = found[1] if control else found[0]
        a = _chosen(a, keys_t.to(a.values.device if isinstance(a, SparseCoefficients) else a.device))
        a = a.float().cpu().numpy()
        for row, example_id in enumerate(batch.example_ids.tolist()):
            out[example_id] = a[row, :len(examples[example_id].token_ids)].copy()
    return out


def _chosen(a: "torch.Tensor | SparseCoefficients", keys: torch.Tensor) -> torch.Tensor:
    """The columns `keys` of activations, dense or kept sparse (a TopK dictionary's k active latents: never made
    dense over every latent)."""
    if isinstance(a, SparseCoefficients):
        hit = a.indices[..., None] == keys  # (B, T, k, n keys)
        return (a.values[..., None] * hit).sum(-2)
    return a.index_select(-1, keys)


__all__ = ["BATCH_SIZE", "token_coefficients", "token_latent_activations"]
