"""Concepts: values grouped by their top tokens, so that a user can pick a concept's values to promote or
suppress (Geva et al. 2022; `ffkv intervene`).

Method (single linkage on shared top tokens): T_i is the set of value v_i's `TOP` tokens with the largest
v_i·Eᵀ (identity projection, the paper's); tokens in the top sets of more than `FREQUENT` of the selection's
values and more than `FREQUENT_FLOOR` of them (stop words such as " the" or ",", which would chain everything
into one group) are left out of every T_i; two values are linked when |T_i ∩ T_j| >= `MIN_SHARED`; a concept is a connected component of
that graph with at least two values. Its name is its most shared tokens: those in the most of its values'
top sets (frequent tokens left out). Layers count from 0 in code and in the tables.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pandas as pd

from ffkv.errors import FfkvError

if TYPE_CHECKING:  # clustering top tokens that are already known (the explorer's lookup table) needs no torch
    from ffkv.models.loading import LoadedModel

#: Top tokens per value.
TOP = 10
#: Shared top tokens that link two values.
MIN_SHARED = 3
#: Tokens in more than this share of the values' top sets (and in more than `FREQUENT_FLOOR` of them) are not
#: evidence of a concept.
FREQUENT = 0.02
FREQUENT_FLOOR = 10
#: Tokens naming a concept.
NAME_TOKENS = 5
#: Values whose pairwise overlaps one call computes (N² counts): beyond it, ask for fewer layers.
MAX_VALUES = 65536


def value_top_tokens(loaded: LoadedModel, layer: int, top: int = TOP) -> np.ndarray:
    """(d_m, top) token ids: each value's top tokens of v_i·Eᵀ (identity projection), best first
    (`ffkv.memories.projection.top_tokens`)."""
    from ffkv.memories.projection import top_tokens

    return top_tokens(loaded.view, layer, None, top, "identity")[0]


def shared_pairs(tops: np.ndarray, min_shared: int = MIN_SHARED) -> tuple[np.ndarray, np.ndarray]:
    """The row pairs (a, b), a < b, whose top-token sets share at least `min_shared` ids (each row distinct ids;
    negative ids match nothing).

    Counted from each id's list of rows: the (row, id) entries sorted by id, then every two entries of one
    id, found `d` places apart for d = 1, 2, ... up to the longest list. Time and memory go with the number
    of row pairs that share an id, which `without_frequent` bounds (no list is longer than its limit), not
    with the square of the rows or the vocabulary.
    """
    tops = np.asarray(tops, dtype=np.int64)
    n = len(tops)
    rows = np.repeat(np.arange(n, dtype=np.int64), tops.shape[1] if tops.ndim == 2 else 0)
    ids = tops.ravel()
    valid = ids >= 0
    rows, ids = rows[valid], ids[valid]
    order = np.lexsort((rows, ids))  # by id, then row: within an id's list, rows ascend
    rows, ids = rows[order], ids[order]
    firsts, seconds = [], []
    for d in range(1, len(ids)):
        same = ids[d:] == ids[:-d]
        if not same.any():  # no list has more than d entries
            break
        firsts.append(rows[:-d][same])
        seconds.append(rows[d:][same])
    if not firsts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pair, count = np.unique(np.concatenate(firsts) * n + np.concatenate(seconds), return_counts=True)
    pair = pair[count >= min_shared]
    return pair // n, pair % n


def link_components(tops: np.ndarray, min_shared: int = MIN_SHARED) -> np.ndarray:
    """Connected components of the graph linking rows that share >= `min_shared` tokens: a label per row
    (labels are the smallest row index of the component; found by propagating the smallest label along
    the edges until nothing changes)."""
    a, b = shared_pairs(tops, min_shared)
    labels = np.arange(len(tops), dtype=np.int64)
    while True:
        before = labels.copy()
        np.minimum.at(labels, a, labels[b])
        np.minimum.at(labels, b, labels[a])
        labels = labels[labels]  # jump to the label's own label
        if np.array_equal(labels, before):
            return labels


def without_frequent(tops: np.ndarray, frequent: float = FREQUENT) -> np.ndarray:
    """`tops` with every token that is in more than max(`FREQUENT_FLOOR`, frequent·N) rows replaced by a distinct negative id
    (a placeholder that matches nothing)."""
    tops = np.asarray(tops, dtype=np.int64)
    if not tops.size:
        return tops.copy()
    ids, counts = np.unique(tops, return_counts=True)
    common = ids[counts > max(FREQUENT_FLOOR, frequent * len(tops))]
    out = tops.copy()
    mask = np.isin(tops, common)
    out[mask] = -1 - np.arange(int(mask.sum()))
    return out


def cluster(tops: np.ndarray, min_shared: int = MIN_SHARED, frequent: float = FREQUENT) -> list[list[int]]:
    """The concepts among rows of top-token sets (frequent tokens left out, `without_frequent`): components of
    >= 2 rows, largest first (then by first row)."""
    tops = without_frequent(tops, frequent)
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
    check_request(layers, view.n_layers, view.d_m, top, min_shared)
    tops = [value_top_tokens(loaded, layer, top) for layer in layers]
    return concepts_of_tops(tops, layers, loaded.tokenizer, min_shared)


def check_request(layers: Sequence[int], n_layers: int, d_m: int, top: int = TOP, min_shared: int = MIN_SHARED) -> None:
    """Refuse layers outside the model, settings outside their range, or more values than `MAX_VALUES`."""
    for layer in layers:
        if not 0 <= layer < n_layers:
            raise FfkvError(f"layer {layer} does not exist: this model has layers 0..{n_layers - 1} (0-based)")
    if not 2 <= top <= 100 or not 1 <= min_shared <= top:
        raise FfkvError(f"need 2 <= top <= 100 and 1 <= min_shared <= top, got top={top}, min_shared={min_shared}")
    if len(layers) * d_m > MAX_VALUES:
        raise FfkvError(f"{len(layers) * d_m:,} values are more than {MAX_VALUES:,} to compare pairwise; "
                        "ask for fewer layers")


def concepts_of_tops(tops: Sequence[np.ndarray], layers: Sequence[int], tokenizer,
                     min_shared: int = MIN_SHARED) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`concepts` from each layer's (d_m, top) value top tokens (best first; `value_top_tokens`, or the explorer's
    lookup table of the same identity top tokens, which needs no model weights); `tokenizer` names them."""
    where = [(layer, key) for layer, t in zip(layers, tops) for key in range(len(t))]
    tops = np.concatenate([np.asarray(t, dtype=np.int64) for t in tops]) if len(tops) else np.zeros((0, TOP), np.int64)
    rows, members = [], []
    kept = without_frequent(tops)
    for c, group in enumerate(cluster(tops, min_shared)):
        counts = Counter(int(t) for i in group for t in kept[i] if t >= 0)
        named = [t for t, _ in counts.most_common(NAME_TOKENS)]
        rows.append({"concept": c, "size": len(group), "tokens": list(tokenizer.token_strings(named)),
                     "token_ids": named, "layers": sorted({where[i][0] for i in group})})
        for i in group:
            members.append({"concept": c, "layer": where[i][0], "key": where[i][1],
                            "top_tokens": list(tokenizer.token_strings([int(t) for t in tops[i]]))})
    return (pd.DataFrame(rows, columns=["concept", "size", "tokens", "token_ids", "layers"]),
            pd.DataFrame(members, columns=["concept", "layer", "key", "top_tokens"]))
