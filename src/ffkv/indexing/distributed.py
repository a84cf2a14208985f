"""`ffkv index` across processes and machines with torch.distributed (torchrun).

Each rank indexes the batches of its shard into a shard run beside the output,
then rank 0 merges them exactly (`merge_runs`). NCCL on GPUs, Gloo on CPUs.

    torchrun --nproc-per-node 8 -m ffkv.cli index --model M --corpus C --out RUN --device cuda
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.indexing.merge import merge_runs
from ffkv.models.loading import LoadedModel
from ffkv.parallel import process_group
from ffkv.store.run import RunDir


def shard_dir(out: Path, rank: int) -> Path:
    return out.parent / f".{out.name}.shards" / f"rank-{rank}"


def build_index_distributed(loaded: LoadedModel, spec, out: str | Path, options: IndexOptions,
                            batching: BatchOptions, resume: bool = False, progress: bool = True,
                            dictionary=None) -> RunDir:
    """Index with every rank of the torchrun job; returns the merged run (on every rank)."""
    out = Path(out)
    with process_group(loaded.view.device) as (rank, world):
        mine = shard_dir(out, rank)
        build_index(loaded, spec, mine, options, batching, resume=resume and RunDir(mine).exists(),
                    progress=progress and rank == 0, shard=(rank, world), dictionary=dictionary)
        dist.barrier()
        if rank == 0:
            merge_runs([shard_dir(out, r) for r in range(world)], out)
            shutil.rmtree(mine.parent)
    return RunDir(out)
