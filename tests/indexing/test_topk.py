"""The running top-k: both merge paths give the same exact order, ties included."""

from __future__ import annotations

import pytest
import torch

from ffkv.indexing.topk import EMPTY, TopKState, select_top


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
        fast.merge_candidates(*(t[None] for t in batch), one_per_example=True)
        slow.merge_candidates(*(t[None] for t in batch))
    for a, b in zip(fast.state_dict().values(), slow.state_dict().values()):
        assert torch.equal(a, b)
    # Order: value desc, then example id asc.
    v, e = slow.values[0], slow.example_id[0]
    for row in range(16):
        keys = list(zip((-v[row]).tolist(), e[row].tolist()))
        assert keys == sorted(keys)


def test_state_keeps_empty_slots_last_until_full():
    state = TopKState.empty(1, 2, 4)
    state.merge_candidates(torch.tensor([[[1.0, 2.0], [0.0, 0.0]]]), torch.tensor([[[5, 3], [9, 8]]]),
                           torch.zeros(1, 2, 2, dtype=torch.int32), torch.zeros(1, 2, 2, dtype=torch.int32),
                           one_per_example=True)
    assert state.example_id[0].tolist() == [[3, 5, EMPTY, EMPTY], [8, 9, EMPTY, EMPTY]]


def test_select_top_breaks_ties_by_lower_column():
    values = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, 3.0]])
    assert select_top(values, 4).tolist() == [[1, 2, 5, 0]]
    assert select_top(torch.tensor([[-0.0, 0.0]]), 1).tolist() == [[0]]  # -0.0 counts as 0.0


def test_all_layers_merge_like_a_brute_force_sort_of_everything_seen():
    """Several layers merged at once, over batches, keep per (layer, key) the k best of all candidates."""
    g = torch.Generator().manual_seed(1)
    n_layers, d_m, k = 3, 8, 4
    state = TopKState.empty(n_layers, d_m, k)
    seen: dict[tuple[int, int], list] = {}
    for step in range(6):
        batch = [_random_candidates(g, d_m, 5, first_id=100 * ((step * 5) % 6)) for _ in range(n_layers)]
        state.merge_candidates(*(torch.stack(f) for f in zip(*batch)), one_per_example=step % 2 == 0)
        _record(seen, batch, d_m)
    _assert_k_best(state, seen, k)


def test_cpu_merge_of_ranges_and_scattered_keys_equals_brute_force(monkeypatch):
    """On a CPU, blocks of keys that all reach the k-th value merge through views (a range), other blocks
    through their indices; both keep per key the k best of everything seen, ties included."""
    from ffkv.indexing import topk

    monkeypatch.setattr(topk, "_CPU_BLOCK_ROWS", 4)
    kinds = []
    merge_rows = topk._merge_rows
    monkeypatch.setattr(topk, "_merge_rows", lambda state, new, rows, fast: (
        kinds.append(type(rows).__name__), merge_rows(state, new, rows, fast))[1])
    _merges_keep_the_k_best(seed=2, steps=10, merge=lambda state, fields, fast: state.merge_candidates(
        *fields, one_per_example=fast))
    assert "slice" in kinds and "Tensor" in kinds  # both paths ran


def _merges_keep_the_k_best(seed: int, steps: int, merge) -> None:
    """`merge(state, (values, ids, positions, next tokens) of shape (L, d_m, 4), one_per_example)` for `steps`
    batches of random candidates with ties into a (2, 12, top-3) state, which must then hold per key the k best
    of everything seen (the one-sort merge every other step)."""
    g = torch.Generator().manual_seed(seed)
    n_layers, d_m, k = 2, 12, 3
    state = TopKState.empty(n_layers, d_m, k)
    seen: dict[tuple[int, int], list] = {}
    for step in range(steps):
        batch = [_random_candidates(g, d_m, 4, first_id=100 * step) for _ in range(n_layers)]
        merge(state, [torch.stack(f) for f in zip(*batch)], step % 2 == 1)
        _record(seen, batch, d_m)
    _assert_k_best(state, seen, k)


def _record(seen: dict, batch: list, d_m: int) -> None:
    """Add a batch's candidates to the brute force: per (layer, key), (-value, example, position, next token)."""
    for layer, (v, e, p, t) in enumerate(batch):
        for key in range(d_m):
            seen.setdefault((layer, key), []).extend(
                zip((-v[key]).tolist(), e[key].tolist(), p[key].tolist(), t[key].tolist()))


def _assert_k_best(state, seen: dict, k: int) -> None:
    """The state holds, per key, the k best of everything seen, in the tie-break order (value, example, position)."""
    for (layer, key), entries in seen.items():
        best = sorted(entries)[:k]
        assert state.values[layer, key].tolist() == [-b[0] for b in best]
        assert state.example_id[layer, key].tolist() == [b[1] for b in best]
        assert state.position[layer, key].tolist() == [b[2] for b in best]
        assert state.next_token[layer, key].tolist() == [b[3] for b in best]


@pytest.mark.parametrize("block", [1, 5, 24, 1000])
def test_gpu_merge_in_blocks_of_rows_equals_brute_force(block):
    """A GPU merges every row at once in blocks that bound its temporaries (`_merge_blocks`): blocks of one row, of
    rows that do not divide the 24, the 24 exactly and more than all of them keep the same k best per key."""
    from ffkv.indexing import topk

    def merge(state, fields, fast):
        rows = [f.reshape(-1, f.shape[-1]) for f in fields]
        new = [rows[0].float(), rows[1], rows[2].to(torch.int32), rows[3].to(torch.int32)]
        own = [t.view(-1, state.k) for t in (state.values, state.example_id, state.position, state.next_token)]
        topk._merge_blocks(own, new, fast, block)

    _merges_keep_the_k_best(seed=4, steps=8, merge=merge)
