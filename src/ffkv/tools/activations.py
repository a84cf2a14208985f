"""A memory's coefficient at every token of whole examples: what an explanation is shown and scored against.

One batched forward pass per group of examples, stopping after the layer asked for (`MemoryView.capture`); for
a causal model the value at position j is the prefix x_1..x_{j+1}'s coefficient, so a trigger position's value
equals the index's, and an encoder sees the whole example, as the index does. The random control memories
(`ffkv.memories.controls`) are computed from the same pass's FF input with the layer's own function.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ffkv.batching import collate, length_batches
from ffkv.corpus import Example
from ffkv.memories.controls import RandomKeys
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


__all__ = ["BATCH_SIZE", "token_coefficients"]
