"""`ffkv index` across processes and machines with torch.distributed (torchrun).

Each rank indexes the batches of its shard into a shard run beside the output,
then rank 0 merges them exactly (`merge_runs`). NCCL on GPUs, Gloo on CPUs.

    torchrun --nproc-per-node 8 -m ffkv.cli index --model M --corpus C --out RUN --device cuda
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from ffkv.index.indexer import BatchOptions, IndexOptions, build_index
from ffkv.index.merge import merge_runs
from ffkv.models.loading import LoadedModel
from ffkv.store.run import RunDir


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of several started by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_device(device: str) -> str:
    """The device of this rank: `cuda` becomes `cuda:LOCAL_RANK`."""
    if device == "cuda" and launched_by_torchrun():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


#: (rank, world size) of one process of a job.
Shard = tuple[int, int]


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


def shard_dir(out: Path, rank: int) -> Path:
    return out.parent / f".{out.name}.shards" / f"rank-{rank}"


def build_index_distributed(loaded: LoadedModel, spec, out: str | Path, options: IndexOptions,
                            batching: BatchOptions, resume: bool = False, progress: bool = True) -> RunDir:
    """Index with every rank of the torchrun job; returns the merged run (on every rank)."""
    out = Path(out)
    with process_group(loaded.view.device) as (rank, world):
        mine = shard_dir(out, rank)
        build_index(loaded, spec, mine, options, batching, resume=resume and mine.exists(),
                    progress=progress and rank == 0, shard=(rank, world))
        dist.barrier()
        if rank == 0:
            merge_runs([shard_dir(out, r) for r in range(world)], out)
            shutil.rmtree(mine.parent)
    return RunDir(out)
