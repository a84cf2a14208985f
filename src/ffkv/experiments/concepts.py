"""Concepts: values grouped by their top tokens, so that a user can pick a concept's values to promote or
suppress (Geva et al. 2022; `ffkv intervene`).

Method (single linkage on shared top tokens): T_i is the set of value v_i's `TOP` tokens with the largest
v_i·Eᵀ (identity projection, the paper's); two values are linked when |T_i ∩ T_j| >= `MIN_SHARED`; a
concept is a connected component of that graph with at least two values. Its name is its most shared
tokens: those in the most of its values' top sets. Layers count from 0 in code and in the tables.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from ffkv.errors import FfkvError
from ffkv.memories.projection import logits as project
from ffkv.models.loading import LoadedModel

#: Top tokens per value.
TOP = 10
#: Shared top tokens that link two values.
MIN_SHARED = 3
#: Tokens naming a concept.
NAME_TOKENS = 5
#: Values whose pairwise overlaps one call computes (N² counts): beyond it, ask for fewer layers.
MAX_VALUES = 65536


@torch.no_grad()
def value_top_tokens(loaded: LoadedModel, layer: int, top: int = TOP) -> np.ndarray:
    """(d_m, top) token ids: each value's top tokens of v_i·Eᵀ (identity projection), best first."""
    view = loaded.view
    out = []
    values = view.values(layer)
    for start in range(0, view.d_m, 256):
        z = project(view, values[start:start + 256], "identity")
        out.append(torch.topk(z, min(top, z.shape[-1]), dim=-1).indices.cpu().numpy())
    return np.concatenate(out).astype(np.int64)


def shared_counts(tops: np.ndarray, rows: slice | np.ndarray | None = None) -> np.ndarray:
    """|T_i ∩ T_j| for the given rows i (default all) against every j; each row of `tops` holds distinct ids."""
    t = torch.as_tensor(tops)
    part = t if rows is None else t[rows]
    # (r, top, 1, 1) == (1, 1, N, top): for each token of T_i, whether T_j holds it; summed over T_i.
    return (part[:, :, None, None] == t[None, None, :, :]).any(-1).sum(1).numpy()


def link_components(tops: np.ndarray, min_shared: int = MIN_SHARED, chunk: int = 64) -> np.ndarray:
    """Connected components of the graph linking rows that share >= `min_shared` tokens: a label per row
    (labels are the smallest row index of the component)."""
    n = len(tops)
    parent = np.arange(n)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for start in range(0, n, chunk):
        counts = shared_counts(tops, slice(start, min(n, start + chunk)))
        rows, cols = np.nonzero(counts >= min_shared)
        for a, b in zip(rows + start, cols):
            if a < b:
                ra, rb = find(int(a)), find(int(b))
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
    return np.array([find(i) for i in range(n)], dtype=np.int64)


def cluster(tops: np.ndarray, min_shared: int = MIN_SHARED) -> list[list[int]]:
    """The concepts among rows of top-token sets: components of >= 2 rows, largest first (then by first row)."""
    labels = link_components(tops, min_shared)
    groups: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        groups.setdefault(int(label), []).append(i)
    found = [g for g in groups.values() if len(g) >= 2]
    return sorted(found, key=lambda g: (-len(g), g[0]))


def concepts(loaded: LoadedModel, layers: Sequence[int] | None = None, top: int = TOP,
             min_shared: int = MIN_SHARED) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The concepts among the values of `layers` (0-based; default all), clustered together across layers.

    Returns:
        (concepts, members): concepts has one row per concept (``concept`` from 0, largest first; ``size``;
        ``tokens``: its most shared tokens as strings; ``token_ids``; ``layers``: the layers it spans);
        members one row per value in a concept (``concept``, ``layer``, ``key``, ``top_tokens``).
    """
    view = loaded.view
    layers = list(range(view.n_layers)) if layers is None else [int(x) for x in layers]
    for layer in layers:
        if not 0 <= layer < view.n_layers:
            raise FfkvError(f"layer {layer} does not exist: this model has layers 0..{view.n_layers - 1} (0-based)")
    if not 2 <= top <= 100 or not 1 <= min_shared <= top:
        raise FfkvError(f"need 2 <= top <= 100 and 1 <= min_shared <= top, got top={top}, min_shared={min_shared}")
    if len(layers) * view.d_m > MAX_VALUES:
        raise FfkvError(f"{len(layers) * view.d_m:,} values are more than {MAX_VALUES:,} to compare pairwise; "
                        "ask for fewer layers")
    tops = np.concatenate([value_top_tokens(loaded, layer, top) for layer in layers]) if layers else \
        np.zeros((0, top), np.int64)
    where = [(layer, key) for layer in layers for key in range(view.d_m)]
    tok = loaded.tokenizer
    rows, members = [], []
    for c, group in enumerate(cluster(tops, min_shared)):
        counts = Counter(int(t) for i in group for t in tops[i])
        named = [t for t, _ in counts.most_common(NAME_TOKENS)]
        rows.append({"concept": c, "size": len(group), "tokens": list(tok.token_strings(named)), "token_ids": named,
                     "layers": sorted({where[i][0] for i in group})})
        for i in group:
            members.append({"concept": c, "layer": where[i][0], "key": where[i][1],
                            "top_tokens": list(tok.token_strings([int(t) for t in tops[i]]))})
    return (pd.DataFrame(rows, columns=["concept", "size", "tokens", "token_ids", "layers"]),
            pd.DataFrame(members, columns=["concept", "layer", "key", "top_tokens"]))
