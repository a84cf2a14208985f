"""Join the runs of `ffkv index --shard i/n` into the run one process would have written.

The top-k merge is exact and associative, and both tables are written in their
canonical layout, so the merged tables are byte-identical to a single-process run
with the same batching.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ffkv.errors import FfkvError
from ffkv.indexing import excluded
from ffkv.indexing.tables import (CONTROL_KEYS, CONTROL_TRIGGERS, LATENT_CONTROL_KEYS, LATENT_CONTROL_TRIGGERS,
                               LATENT_TRIGGERS, latent_trigger_table, parquet_batches, state_from_table,
                               write_examples, write_triggers)
from ffkv.indexing.topk import SIGNS, TopKState
from ffkv.store import atomic
from ffkv.store.manifest import FORMAT_VERSION
from ffkv.store.run import RunDir


def merge_runs(shards: Sequence[str | Path], out: str | Path) -> RunDir:
    """Merge complete shard runs (one per shard i of n, any order) into a new run directory."""
    if not shards:
        raise FfkvError("give the shard runs to merge")
    runs = [RunDir(p) for p in shards]
    manifests = [r.require_complete() for r in runs]
    first = manifests[0]
    n = first.identity.shard_of[1]
    seen = sorted(m.identity.shard_of[0] for m in manifests)
    if seen != list(range(n)) or any(m.identity.shard_of[1] != n for m in manifests):
        raise FfkvError(f"need exactly one run of each shard 0..{n - 1} of {n}; got shards {seen}")
    for run, m in zip(runs, manifests):
        if (not m.identity.unsharded().same_result(first.identity.unsharded())
                or m.identity.batching != first.identity.batching):
            raise FfkvError(f"{run.path} is a shard of a different run (model, corpus, options or batching differ)")
    target = RunDir(out)
    identity = first.identity.unsharded()
    with target.lock("merge", create=True) as holder:
        # An unfinished merge (or index) of the same run is redone: the merge is deterministic.
        manifest = target.prepare(identity, resume=target.exists()) or replace(first, identity=identity)
        manifest = replace(manifest, counts={}, timings={}, tables={}, analyses={}, analyzing=None,
                           merged_from=[str(r.path) for r in runs],
                           format_version=FORMAT_VERSION)  # the tables are written in this version's layout
        with target.writing(manifest, holder, "rerun `ffkv merge`"):
            _merge_tables(runs, manifests, target, manifest)
    return target


def _merged_state(runs: list[RunDir], table: str, n_layers: int, rows: int, first) -> TopKState:
    """The exact merge of one trigger table of every shard."""
    state = None
    for run in runs:
        shard_state = state_from_table(pq.read_table(run.table(table)), n_layers, rows, first.top_k,
                                       SIGNS[first.sign])
        if state is None:
            state = shard_state
        else:
            state.merge(shard_state, one_per_example=first.mode == "example")
    return state


def _merged_latents(runs: list[RunDir], table: str, widths: dict[int, int], first) -> dict[int, TopKState]:
    """The exact merge of one latent table of every shard, per dictionary layer (`ffkv.memories.latent_keys`). The
    tables keep only positive entries; those outrank every entry left out, so the merge of what was kept is
    what one process keeps."""
    merged: dict[int, TopKState] = {}
    for run in runs:
        every = pq.read_table(run.table(table))
        for layer, width in widths.items():
            rows = every.filter(pc.equal(every["layer"], layer))
            rows = rows.set_column(0, "layer", pa.array([0] * rows.num_rows, pa.int16()))
            state = state_from_table(rows, 1, width, first.top_k)
            if layer in merged:
                merged[layer].merge(state, one_per_example=first.mode == "example")
            else:
                merged[layer] = state
    return merged


def _merge_latents(runs: list[RunDir], target: RunDir, first) -> list[str]:
    """Merge the shards' latent tables; returns the names written (none for a run without a dictionary)."""
    dictionary = first.identity.index.get("dictionary")
    if not dictionary:
        return []
    widths = {int(layer): int(d["n_latents"]) for layer, d in dictionary.items()}
    atomic.write_parquet(target.table(LATENT_TRIGGERS),
                         latent_trigger_table(_merged_latents(runs, LATENT_TRIGGERS, widths, first)))
    if not first.control_keys:
        return [LATENT_TRIGGERS]
    controls = {layer: first.control_keys for layer in widths}
    atomic.write_parquet(target.table(LATENT_CONTROL_TRIGGERS),
                         latent_trigger_table(_merged_latents(runs, LATENT_CONTROL_TRIGGERS, controls, first)))
    atomic.write_parquet(target.table(LATENT_CONTROL_KEYS), pq.read_table(runs[0].table(LATENT_CONTROL_KEYS)))
    return [LATENT_TRIGGERS, LATENT_CONTROL_TRIGGERS, LATENT_CONTROL_KEYS]


def _merge_tables(runs: list[RunDir], manifests: list, target: RunDir, manifest) -> None:
    first = manifests[0]
    directions = SIGNS[first.sign]
    state = _merged_state(runs, "trigger_examples", first.model.n_layers, first.model.d_m, first)
    n_examples = write_examples(target.table("examples"), [parquet_batches(r.table("examples")) for r in runs])
    write_triggers(target.table("trigger_examples"), state, directions)
    if first.control_keys:  # every shard drew the same control (same seed): its keys are copied, its triggers merged
        control = _merged_state(runs, CONTROL_TRIGGERS, first.model.n_layers, first.control_keys, first)
        write_triggers(target.table(CONTROL_TRIGGERS), control, directions)
        atomic.write_parquet(target.table(CONTROL_KEYS), pq.read_table(runs[0].table(CONTROL_KEYS)))
    control = (CONTROL_TRIGGERS, CONTROL_KEYS) if first.control_keys else ()
    latents = _merge_latents(runs, target, first)
    for table in ("examples", "trigger_examples", *control, *latents):
        target.record_table(manifest, target.table(table).name, "merge")
    manifest.counts = {"examples": n_examples, "tokens": sum(m.counts["tokens"] for m in manifests),
                       "examples_cut": sum(int(m.counts.get("examples_cut", 0)) for m in manifests)}
    manifest.index.pop("excluded_tokens", None)  # the first shard's own, copied with its manifest
    if all("excluded_positions" in m.counts for m in manifests):  # shards indexed before the count existed lack it
        manifest.counts["excluded_positions"] = sum(m.counts["excluded_positions"] for m in manifests)
        manifest.index["excluded_tokens"] = excluded.merged(m.index.get("excluded_tokens") for m in manifests)
    manifest.timings = {"index_seconds": max(m.timings["index_seconds"] for m in manifests)}
    manifest.status, manifest.process, manifest.error = "complete", None, None
    target.write_manifest(manifest)
    shutil.rmtree(target.partial, ignore_errors=True)  # an unfinished index that this merge replaced
