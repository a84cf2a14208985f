"""Exact running top-k of candidates per (layer, key), kept on the model's device.

Order (docs/definitions.md): higher coefficient first; ties by lower example id, then
lower position. The state merges exactly and associatively, so shards, batches
and resumed runs all end with the same result.

A signed index (`--sign both`) keeps both directions of every key in one state of
2·d_m rows per layer: row i holds key i's largest coefficients, row d_m + i its most
negative ones, stored negated (-m), so that one order (higher first, then lower
example id, then lower position) and one merge serve both directions (`SIGNS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The trigger directions an index keeps, by its `--sign` option, in the order of the state's row blocks:
#: +1 the largest coefficients m, -1 the most negative ones.
SIGNS = {"positive": (1,), "both": (1, -1)}

#: example id of an empty slot; it loses every tie.
EMPTY = torch.iinfo(torch.int64).max


def _ordered_bits(values: torch.Tensor) -> torch.Tensor:
    """Map float32 to int64 so that integer order equals float order (-0.0 counts as 0.0)."""
    bits = (values.float() + 0.0).view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)


def select_top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best columns of each row, ties going to the lower column.

    Args:
        values: (rows, n) float scores; columns must already be in tie-break order.
        k: how many to keep (at most n).

    Returns:
        (rows, k) int64 column indices, best first.
    """
    n = values.shape[-1]
    columns = torch.arange(n, device=values.device, dtype=torch.int64)
    return column_ranking(values, columns, n).topk(k, dim=-1, sorted=True).indices


def column_ranking(values: torch.Tensor, columns: torch.Tensor, n: int) -> torch.Tensor:
    """int64 keys in the order `select_top` ranks candidates: the higher value first, ties to the lower column.

    Args:
        values: float scores.
        columns: int64 columns of the same shape, each below n.
        n: the number of columns (below 2**32, the tie-break field).
    """
    if n >= 2**32:
        raise ValueError("too many candidates in one batch for the 32-bit tie-break field")
    return (_ordered_bits(values) << 32) | (n - 1 - columns)


#: Example ids below this fit the 32-bit tie-break field of the one-sort merge.
ID_LIMIT = 2**32 - 1


def _value_then_id_key(values: torch.Tensor, example_id: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered by (value desc, example_id asc); empty slots last. Needs ids < ID_LIMIT."""
    return (_ordered_bits(values) << 32) | (ID_LIMIT - example_id.clamp(max=ID_LIMIT))


def _lexsort(values: torch.Tensor, example_id: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Row-wise permutation sorting by (-value, example_id, position), stable sorts last key first."""
    perm = position.argsort(dim=-1, stable=True)
    perm = perm.gather(-1, example_id.gather(-1, perm).argsort(dim=-1, stable=True))
    return perm.gather(-1, (-values).gather(-1, perm).argsort(dim=-1, stable=True))


#: Rows (keys) merged at once on a CPU. Smaller blocks (2,048 rows, in cache) cost the same CPU time on one
#: thread, but each block is a dozen operations, and where they run on several threads of a shared machine
#: every one of them waits for its threads to be scheduled: one merge of SmolLM2's 30 x 3,072 rows took 9.4 s
#: in blocks of 2,048 and 0.9 s in blocks of 32,768 (2 threads, load average 5.5; `benchmarks/reduction_threads.py`).
#: The index merges on one thread (`ffkv.indexing.reducer.one_thread`): 0.3 s.
_CPU_BLOCK_ROWS = 32768

#: Candidates (rows x (k + n)) merged at once on a GPU: 2**26, about 3 GB of temporaries.
_GPU_BLOCK_CANDIDATES = 2**26


def _merge_rows(state: list[torch.Tensor], new: list[torch.Tensor], rows: torch.Tensor | slice | None,
                one_per_example: bool) -> None:
    """Merge candidate rows `new` (values, ids, positions, next tokens) into the (rows, k) `state`
    views, at `rows` (indices or a range; None: every row), keeping the best k of each row."""
    k = state[0].shape[-1]
    own = state if rows is None else [t[rows] for t in state]
    v, e, p, t = (torch.cat([a, b], dim=-1) for a, b in zip(own, new))
    if one_per_example:
        keep = _value_then_id_key(v, e).topk(k, dim=-1, sorted=True).indices
    else:
        keep = _lexsort(v, e, p)[:, :k]
    for target, source in zip(state, (v, e, p, t)):
        if rows is None:
            target.copy_(source.gather(-1, keep))
        else:
            target[rows] = source.gather(-1, keep)


def _merge_blocks(state: list[torch.Tensor], new: list[torch.Tensor], one_per_example: bool, block: int) -> None:
    """Merge candidate rows into the state in blocks of `block` rows (all at once where they fit): a GPU's one
    selection for every layer and direction, its temporaries (about 45 bytes per candidate: the concatenated
    fields, the packed keys, the kept ones) bounded by the block: one block for GPT-2 small's 73,728 rows of
    50 + 512 candidates, five for Llama-3.1-8B's 917,504 rows of 100 + 256."""
    rows = state[0].shape[0]
    for start in range(0, rows, block):
        end = min(rows, start + block)
        whole = start == 0 and end == rows
        _merge_rows(state, [t[start:end] for t in new], None if whole else slice(start, end), one_per_example)


@dataclass
class TopKState:
    """Top-k entries of every key of every layer: tensors of shape (L, d_m, k)."""

    values: torch.Tensor
    example_id: torch.Tensor
    position: torch.Tensor
    next_token: torch.Tensor

    def __post_init__(self) -> None:
        # Merges work on (L * d_m, k) views of these tensors.
        for name in ("values", "example_id", "position", "next_token"):
            setattr(self, name, getattr(self, name).contiguous())

    @classmethod
    def empty(cls, n_layers: int, d_m: int, k: int, device: torch.device | str = "cpu") -> "TopKState":
        shape = (n_layers, d_m, k)
        return cls(
            values=torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
            example_id=torch.full(shape, EMPTY, dtype=torch.int64, device=device),
            position=torch.zeros(shape, dtype=torch.int32, device=device),
            next_token=torch.full(shape, -1, dtype=torch.int32, device=device),
        )

    @property
    def k(self) -> int:
        return self.values.shape[-1]

    def merge_candidates(
        self,
        values: torch.Tensor,
        example_id: torch.Tensor,
        position: torch.Tensor,
        next_token: torch.Tensor,
        one_per_example: bool = False,
    ) -> None:
        """Merge candidates (L, d_m, n) of every layer into the state, keeping the best k per key.

        All layers merge in one set of tensor operations (on a GPU, one launch per step for
        the whole model rather than one per layer).

        Args:
            one_per_example: the caller guarantees that no example appears twice for a key
                and that every example id is below `ID_LIMIT`; then one top-k over a packed
                (value, id) key replaces the three stable sorts (positions never tie-break).
        """
        if values.shape[:2] != self.values.shape[:2]:
            raise ValueError(f"candidates of shape {tuple(values.shape)} do not match a state of "
                             f"{tuple(self.values.shape[:2])} (layers, keys)")
        k = self.k
        state = [t.view(-1, k) for t in (self.values, self.example_id, self.position, self.next_token)]
        n = values.shape[-1]
        new = [values.reshape(-1, n).float(), example_id.reshape(-1, n),
               position.reshape(-1, n).to(torch.int32), next_token.reshape(-1, n).to(torch.int32)]
        if values.device.type != "cpu":
            _merge_blocks(state, new, one_per_example, max(1, _GPU_BLOCK_CANDIDATES // (k + n)))
            return
        # On a CPU, only keys where some candidate reaches the current k-th value can change
        # (selecting them first saves most of the sorting once the state has filled), and
        # blocks of keys that stay in cache sort faster than the whole model at once.
        reach = new[0].max(dim=-1).values >= state[0][:, -1]
        for rows in reach.nonzero().squeeze(1).split(_CPU_BLOCK_ROWS):
            if not len(rows):  # no key can change (split gives one empty block)
                continue
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == len(rows):  # every key of the block reaches (a filling state): views, not copies
                rows = slice(first, last + 1)
            _merge_rows(state, [t[rows] for t in new], rows, one_per_example)

    def merge(self, other: "TopKState", one_per_example: bool = False) -> None:
        """Merge another state (e.g. another shard's, of disjoint examples) into this one, exactly."""
        fast = one_per_example and self.ids_fit() and other.ids_fit()
        self.merge_candidates(other.values, other.example_id, other.position, other.next_token,
                              one_per_example=fast)

    def ids_fit(self) -> bool:
        """Whether every stored example id is below `ID_LIMIT` (one host sync)."""
        filled = self.example_id[self.example_id != EMPTY]
        return filled.numel() == 0 or int(filled.max()) < ID_LIMIT

    def to(self, device: torch.device | str) -> "TopKState":
        return TopKState(*(t.to(device) for t in (self.values, self.example_id, self.position, self.next_token)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "example_id": self.example_id,
                "position": self.position, "next_token": self.next_token}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "TopKState":
        return cls(state["values"], state["example_id"], state["position"], state["next_token"])
