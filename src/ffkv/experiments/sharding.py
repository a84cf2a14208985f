"""`ffkv analyze` across torchrun ranks: which rows each rank runs, and gathering them back.

Under torchrun (WORLD_SIZE > 1) `analyze` opens one process group for the whole call
(`ffkv.index.distributed.process_group`: Gloo on CPU, NCCL on GPU). A forward pass over many rows (held-out
examples, ablated prefixes, prefixes to embed) first cuts all its rows into the padded
batches one process would run; rank r runs batches r, r + world, r + 2·world, ...
(`owned`). The split is fixed by the rows alone, never by timing, and each rank runs
exactly the batches one process runs: a batch's padded shape can change the last bits
of a float, so rows are never re-batched per rank. Each rank fills its rows of
full-size arrays and `gather_rows` hands every rank every row, so that all ranks hold
the arrays one process computes, in the same order; then every rank builds the same
tables and only rank 0 writes them (`is_writer`). The weights-only values scan is
split by layer the same way.

Without a process group this process is rank 0 of 1: `owned` keeps every item and
`gather_rows` returns its input, so one process runs the same code, unchanged.

    torchrun --nproc-per-node 2 -m ffkv.cli analyze RUN          # CPU, Gloo
    torchrun --nproc-per-node 8 -m ffkv.cli analyze RUN --device cuda
"""

from __future__ import annotations

from typing import Mapping, Sequence, TypeVar, overload

import numpy as np
import torch.distributed as dist

from ffkv.index.distributed import Shard, current_shard

T = TypeVar("T")

#: One rank's share of a gather: (row indices, those rows of each named array).
Part = tuple[np.ndarray, Mapping[str, np.ndarray]]


def is_writer() -> bool:
    """Whether this process writes the run's tables, figures and manifest: rank 0, or the only process."""
    return current_shard()[0] == 0


def owned(items: Sequence[T], shard: Shard | None = None) -> list[T]:
    """The items (batches of rows, or layers) this rank runs: items rank, rank + world, ...

    Round robin, so that batches sorted by length spread long and short ones evenly.
    `shard` defaults to `current_shard()`; with one process every item is owned.
    """
    rank, world = shard if shard is not None else current_shard()
    if not (world >= 1 and 0 <= rank < world):
        raise ValueError(f"a shard is (rank, world size) with 0 <= rank < world size, got {(rank, world)}")
    return list(items[rank::world])


def merge_rows(parts: Sequence[Part]) -> dict[str, np.ndarray]:
    """Full arrays from every rank's part: row i of each comes from the part that holds row i.

    The parts' rows must together be 0..n-1, each exactly once; a part without rows may
    leave out its arrays (a rank that owned nothing need not know their shapes).
    """
    rows = [np.asarray(r, dtype=np.int64) for r, _ in parts]
    every = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    n = len(every)
    if not np.array_equal(np.sort(every), np.arange(n)):
        raise RuntimeError(f"the ranks' rows are not a partition of 0..{n - 1}: a sharding bug, please report it")
    names = dict.fromkeys(name for _, arrays in parts for name in arrays)
    full = {}
    for name in names:
        first = next(arrays[name] for _, arrays in parts if name in arrays)
        out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
        for r, (_, arrays) in zip(rows, parts):
            if len(r):
                out[r] = arrays[name]
        full[name] = out
    return full


@overload
def gather_rows(arrays: np.ndarray, rows: np.ndarray | Sequence[int]) -> np.ndarray: ...
@overload
def gather_rows(arrays: Mapping[str, np.ndarray], rows: np.ndarray | Sequence[int]) -> dict[str, np.ndarray]: ...


def gather_rows(arrays: np.ndarray | Mapping[str, np.ndarray],
                rows: np.ndarray | Sequence[int]) -> np.ndarray | dict[str, np.ndarray]:
    """Every rank's rows of full-size arrays, on every rank, in full order (one collective call).

    Args:
        arrays: one array, or a dict of arrays, indexed by row along the first axis;
            only `rows` of them are this rank's results (the rest is ignored).
        rows: the rows this rank computed; all ranks' rows together are 0..n-1.

    Returns:
        The arrays (same names, dtypes and shapes) with every row from the rank that
        computed it. Without a process group: `arrays` itself, unchanged.

    Every rank must call it, the same number of times, in the same order.
    """
    rank, world = current_shard()
    if world == 1:
        return arrays if isinstance(arrays, np.ndarray) else dict(arrays)
    named = {"": arrays} if isinstance(arrays, np.ndarray) else dict(arrays)
    rows = np.asarray(rows, dtype=np.int64)
    parts: list = [None] * world
    dist.all_gather_object(parts, (rows, {name: a[rows] for name, a in named.items()}))
    full = merge_rows(parts)
    for name, a in named.items():
        if len(a) != len(full[name]):
            raise RuntimeError(f"rank {rank} has {len(a)} rows of {name or 'its array'!r} but the ranks computed "
                               f"{len(full[name])}: a sharding bug, please report it")
    return full[""] if isinstance(arrays, np.ndarray) else full
