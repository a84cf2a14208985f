"""What the memory page computes with the model when it is asked for (SPEC sections 1, 3 and 6).

- `value_tokens`: a value's top and bottom tokens under a projection the reader picks:
  ``identity`` p = softmax(v_i·Eᵀ) (the paper's), ``final-norm`` p = softmax(N(v_i)·Eᵀ),
  or ``logits``, the raw v_i·Eᵀ shown as logits. One value is one (|V| x d) product.
- `context_coefficients`: m_i at every position of whole examples (a key's trigger
  examples), in one batched forward pass that stops after the key's layer.
"""

from __future__ import annotations

import numpy as np
import torch

from ffkv.batching import collate, length_batches
from ffkv.corpus import Example
from ffkv.memories.projection import logits
from ffkv.models.loading import LoadedModel

#: The projections the memory page offers: name -> (N of SPEC section 1, shown as).
VALUE_PROJECTIONS = {"identity": ("identity", "p"), "final-norm": ("final-norm", "p"), "logits": ("identity", "logit")}


@torch.no_grad()
def value_tokens(loaded: LoadedModel, layer: int, key: int, projection: str, n: int, target: int | None = None) -> dict:
    """The n top and n bottom tokens of value v_i of a layer under `projection` (a `VALUE_PROJECTIONS` name).

    Returns {"shown": "p" | "logit", "top": [(token_id, value)], "bottom": [(token_id, value)], "top_value": the
    top token's p or logit, "target_rank": `target`'s rank, 1 for the top token, as every rank of a token in a
    distribution counts (ties in its favour; None without one)},
    bottom listed from the least likely up.
    """
    norm, shown = VALUE_PROJECTIONS[projection]
    z = logits(loaded.view, loaded.view.values(layer)[key], norm)
    values = z.softmax(-1) if shown == "p" else z
    n = min(n, z.numel())
    top = torch.topk(z, n)
    bottom = torch.topk(-z, n)
    known = target is not None and 0 <= int(target) < z.numel()
    return {"shown": shown,
            "top": [(int(i), float(values[i])) for i in top.indices],
            "bottom": [(int(i), float(values[i])) for i in bottom.indices],
            "top_value": float(values[top.indices[0]]),
            "target_rank": 1 + int((z > z[int(target)]).sum()) if known else None}


@torch.no_grad()
def context_coefficients(loaded: LoadedModel, layer: int, key: int, token_lists: list[list[int]],
                         batch_size: int = 16) -> list[np.ndarray]:
    """m_i of key `key` of `layer` at every position of each whole example (float32 arrays, in input order).

    For a causal model the value at position j is the prefix x_1..x_{j+1}'s coefficient, so the
    trigger position's value equals the stored one; an encoder sees the whole example, as the index does.
    """
    view = loaded.view
    examples = [Example(i, np.asarray(t, dtype=np.int64), "") for i, t in enumerate(token_lists)]
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(examples)
    special = loaded.special_ids
    for group in length_batches([e for e in examples if len(e.token_ids)], batch_size):
        batch = collate(group, loaded.tokenizer.pad_id, special)
        with view.capture(("coefficients",), layers=[layer], stop_early=True) as cap:
            view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))
        m = cap["coefficients"][layer][..., key].float().cpu().numpy()
        for row, example_id in enumerate(batch.example_ids.tolist()):
            out[example_id] = m[row, :len(examples[example_id].token_ids)].copy()
    return out
