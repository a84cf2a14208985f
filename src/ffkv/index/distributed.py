"""`ffkv index` across processes and machines with torch.distributed (torchrun).

Each rank indexes the batches of its shard into a shard run beside the output,
then rank 0 merges them exactly (`merge_runs`). NCCL on GPUs, Gloo on CPUs.

    torchrun --nproc-per-node 8 -m ffkv.cli index --model M --corpus C --out RUN --device cuda
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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


def shard_dir(out: Path, rank: int) -> Path:
    return out.parent / f".{out.name}.shards" / f"rank-{rank}"


def build_index_distributed(loaded: LoadedModel, spec, out: str | Path, options: IndexOptions,
                            batching: BatchOptions, resume: bool = False, progress: bool = True) -> RunDir:
    """Index with every rank of the torchrun job; returns the merged run (on every rank)."""
    out = Path(out)
    backend = "nccl" if loaded.view.device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine = shard_dir(out, rank)
        build_index(loaded, spec, mine, options, batching, resume=resume and mine.exists(),
                    progress=progress and rank == 0, shard=(rank, world))
        dist.barrier()
        if rank == 0:
            merge_runs([shard_dir(out, r) for r in range(world)], out)
            shutil.rmtree(mine.parent)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return RunDir(out)
