"""The running top-k: both merge paths give the same exact order, ties included."""

from __future__ import annotations

import torch

from ffkv.index.topk import EMPTY, TopKState, select_top


def _random_candidates(g, d_m, n, first_id):
    values = torch.randint(0, 4, (d_m, n), generator=g).float() / 2  # many exact ties
    ids = torch.stack([torch.randperm(n, generator=g) for _ in range(d_m)]) + first_id
    position = torch.randint(0, 9, (d_m, n), generator=g, dtype=torch.int32)
    return values, ids, position, position + 100


def test_one_sort_merge_equals_three_sort_merge():
    g = torch.Generator().manual_seed(0)
    fast, slow = TopKState.empty(1, 16, 5), TopKState.empty(1, 16, 5)
    for step in range(12):
        batch = _random_candidates(g, 16, 7, first_id=1000 * ((step * 7) % 12))  # distinct ids, out of order
        fast.merge_layer(0, *batch, one_per_example=True)
        slow.merge_layer(0, *batch)
    for a, b in zip(fast.state_dict().values(), slow.state_dict().values()):
        assert torch.equal(a, b)
    # Order: value desc, then example id asc.
    v, e = slow.values[0], slow.example_id[0]
    for row in range(16):
        keys = list(zip((-v[row]).tolist(), e[row].tolist()))
        assert keys == sorted(keys)


def test_state_keeps_empty_slots_last_until_full():
    state = TopKState.empty(1, 2, 4)
    state.merge_layer(0, torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[5, 3], [9, 8]]),
                      torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                      one_per_example=True)
    assert state.example_id[0].tolist() == [[3, 5, EMPTY, EMPTY], [8, 9, EMPTY, EMPTY]]


def test_select_top_breaks_ties_by_lower_column():
    values = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, 3.0]])
    assert select_top(values, 4).tolist() == [[1, 2, 5, 0]]
    assert select_top(torch.tensor([[-0.0, 0.0]]), 1).tolist() == [[0]]  # -0.0 counts as 0.0
