"""The index's fixed costs per run (weights hash, trigger table) give the same results as their definitions."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ffkv.indexing.tables import trigger_table
from ffkv.indexing.topk import EMPTY, TopKState
from support.helpers import loaded_tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_hash_is_sha256_of_names_shapes_and_bytes(dtype):
    """The hash equals sha256 over every state-dict entry in name order: name, shape, then a bytes copy."""
    loaded = loaded_tiny("gpt2")
    loaded.model.to(dtype)
    h = hashlib.sha256()
    for name in sorted(loaded.model.state_dict()):
        t = loaded.model.state_dict()[name]
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(bytes(t.contiguous().view(torch.uint8).flatten().tolist()))
    assert loaded.weights_hash() == h.hexdigest()
    loaded.model.state_dict()[sorted(loaded.model.state_dict())[0]].view(-1)[0] += 1  # a changed weight
    loaded._weights_hash = None
    assert loaded.weights_hash() != h.hexdigest()


def _state(n_layers: int, d_m: int, k: int, directions: int, empty: float, seed: int) -> TopKState:
    g = torch.Generator().manual_seed(seed)
    shape = (n_layers, d_m * directions, k)
    state = TopKState(values=torch.randn(shape, generator=g), example_id=torch.randint(0, 99, shape, generator=g),
                      position=torch.randint(0, 9, shape, generator=g, dtype=torch.int32),
                      next_token=torch.randint(-1, 9, shape, generator=g, dtype=torch.int32))
    unfilled = torch.rand(shape, generator=g) < empty
    state.example_id[unfilled] = EMPTY
    return state


@pytest.mark.parametrize("empty", [0.0, 0.3])  # a full state (the fast path) and a partly filled one
@pytest.mark.parametrize("directions", [(1,), (1, -1)])
def test_trigger_table_lists_every_filled_slot_in_order(empty, directions):
    n_layers, d_m, k = 2, 3, 4
    state = _state(n_layers, d_m, k, len(directions), empty, seed=len(directions) + int(10 * empty))
    expected = []
    for layer in range(n_layers):
        for key in range(d_m):
            for b, direction in enumerate(directions):
                for rank in range(k):
                    row = b * d_m + key
                    if int(state.example_id[layer, row, rank]) != EMPTY:
                        expected.append((layer, key, direction, rank,
                                         float(state.values[layer, row, rank]) * direction,
                                         int(state.example_id[layer, row, rank]),
                                         int(state.position[layer, row, rank]),
                                         int(state.next_token[layer, row, rank])))
    table = trigger_table(state, directions)
    got = list(zip(*(table[c].to_pylist() for c in table.column_names)))
    assert got == expected
    assert (len(expected) == n_layers * d_m * len(directions) * k) == (empty == 0.0)
