"""Work shared across torchrun ranks: process groups, which rank owns which batch, gathering rows.

The ground floor of every parallel job, used by `ffkv.indexing` and `ffkv.experiments` alike.

Under torchrun (WORLD_SIZE > 1) a job opens one process group (`process_group`: Gloo on
CPU, NCCL on GPU). A forward pass over many rows (held-out examples, ablated prefixes,
prefixes to embed) first cuts all its rows into the padded batches one process would
run; rank r runs batches r, r + world, r + 2·world, ... (`owned`). The split is fixed by
the rows alone, never by timing, and each rank runs exactly the batches one process
runs: a batch's padded shape can change the last bits of a float, so rows are never
re-batched per rank. Each rank fills its rows of full-size arrays and `gather_rows`
hands every rank every row, so that all ranks hold the arrays one process computes, in
the same order; then every rank builds the same tables and only rank 0 writes them
(`is_writer`). Weights-only work is split by layer the same way.

Without a process group this process is rank 0 of 1: `owned` keeps every item and
`gather_rows` returns its input, so one process runs the same code, unchanged.

    torchrun --nproc-per-node 2 -m ffkv.cli analyze RUN          # CPU, Gloo
    torchrun --nproc-per-node 8 -m ffkv.cli analyze RUN --device cuda
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence, TypeVar, overload

import numpy as np
import torch
import torch.distributed as dist

T = TypeVar("T")

#: (rank, world size) of one process of a job.
Shard = tuple[int, int]


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of several started by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_device(device: str) -> str:
    """The device of this rank: `cuda` becomes `cuda:LOCAL_RANK`."""
    if device == "cuda" and launched_by_torchrun():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def current_shard() -> Shard:
    """(rank, world size) in the open process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def process_group(device: torch.device | str) -> Iterator[Shard]:
    """Under torchrun, one process group for the block (NCCL for a GPU device, else Gloo).

    At the end of the block every rank waits for the others (so rank 0 finishes writing
    before any rank leaves), then the group is closed, also after an error. In one
    process, or when a group is already open (its opener closes it), it does nothing.
    Yields (rank, world size).
    """
    if not launched_by_torchrun() or dist.is_initialized():
        yield current_shard()
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # collectives of objects go through the current GPU: one per rank
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield current_shard()
        dist.barrier()
    finally:
        dist.destroy_process_group()

#: One rank's share of a gather: (row indices, those rows of each named array).
Part = tuple[np.ndarray, Mapping[str, np.ndarray]]


def is_writer() -> bool:
    """Whether this process writes the run's tables, figures and manifest: rank 0, or the only process."""
    return current_shard()[0] == 0


def wait_for_writer() -> None:
    """Under torchrun, hold every rank here until all arrive (rank 0 has written what it writes before it comes):
    a step that reads an earlier step's table from disk then finds it on every rank. One process: nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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
