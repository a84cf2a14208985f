"""The explorer's lookup tables, built by `ffkv analyze` so that `ffkv serve` answers at once.

Written to RUN/explorer/ (`RunDir.cache_dir`; names and validity in `ffkv.store.lookups`,
the contract in docs/run-directory.md). Per key of every layer:

- its value's top tokens and probabilities, p_i = softmax(v_i·Eᵀ) (identity, as the values
  experiment), the confidence max p_i, whether the argmax is the trigger target of the key's
  top-1 trigger example (`ffkv.memories.targets`), that target's rank, the log-normaliser of
  p_i (p_i(x) of any token is then one dot product), and ‖v_i‖ (`scan_values`, chunked);
- the share of its top trigger prefixes that end in their most common last token;
- over the positions of a seeded sample of the run's examples: how often it is active (`ffkv.memories.active`, with
  the run's s_l: `ffkv.experiments.heldout.active_scale`, of the held-out examples), and a
  histogram of m_i (equal-width bins between the sample's smallest and largest m_i, two
  passes over the sample, so memory never holds more than one batch of coefficients);
- explorer.duckdb: the trigger examples (with each prefix's last token) and the texts of the
  examples they use, indexed for point queries;
- trigger_coefficients.npy: the key's coefficient at every token of each trigger example, or at a window of tokens
  around its trigger where the whole examples would not fit, and only for each memory's strongest ranks where even
  the narrowest windows of every row would not (`ffkv.experiments.trigger_contexts`: at most `MAX_CELLS` values), so
  that a memory page runs no model to shade them;
- for a run indexed with a sparse dictionary (`ffkv.store.lookups.has_latents`), the same for its latents
  (`ffkv.experiments.latent_lookups`); nothing of them for a run without one.

Only the writing rank builds them (they are small next to the experiments' passes).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ffkv.batching import collate, length_batches
from ffkv.corpus import Example
from ffkv.errors import DamagedRun, FfkvError
from ffkv.experiments import trigger_contexts
from ffkv.experiments.common import RunContext, progress_bar
from ffkv.experiments.heldout import active_threshold, threshold_source
from ffkv.experiments.registry import Experiment, Result
from ffkv.memories.active import active
from ffkv.memories.projection import DEFAULT_FOR_VALUES, scan_values
from ffkv.memories.targets import trigger_targets
from ffkv.models.loading import LoadedModel
from ffkv.parallel import is_writer
from ffkv.store import atomic, integrity, lookups, ranges, schemas
from ffkv.store.database import confine, open_database
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

if TYPE_CHECKING:
    from ffkv.memories.sets import Latents

NAME = "lookups"
#: Top tokens kept per value (the explorer's search and trace chips read them).
TOP_TOKENS = 10
#: How `value_tables` scans a layer's values: (layer, projection, targets, top=...) -> `scan_values`' statistics.
Scan = Callable[..., dict[str, np.ndarray]]
#: The corpus sample for activation frequencies and histograms: examples, tokens per example, bins.
SAMPLE_EXAMPLES = 128
SAMPLE_MAX_TOKENS = 64
HISTOGRAM_BINS = 24


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")


#: DuckDB's memory while it builds explorer.duckdb: its joins and sorts spill to a temporary folder beside the
#: database past this, so the build's memory does not grow with the trigger table (92M rows at an 8B model's shape).
DATABASE_MEMORY = "1GB"


def build_database(run: RunDir, path: Path, latents: bool = False) -> dict[str, dict]:
    """Write explorer.duckdb atomically: triggers (with each prefix's last token) in (layer, key) order,
    the same triggers' (memory, coefficient) in example order, and texts.

    No ART index: the pages' queries read a key's rows, or an example's, through the min-max
    zone maps of tables stored in that order (DuckDB's planner chose sequential scans over the
    indexes anyway), and an ART index must fit in memory while it is built.

    Each row whose coefficients are stored (every row while the index has at most `trigger_contexts.MAX_ROWS`, else
    those of its strongest ranks: `trigger_contexts.located_ranks`) also holds ``m_start`` and ``m_length`` (the
    first of its example's tokens whose coefficients are stored, and how many: the whole example, or a window around
    the trigger where the whole would not fit; `_located`) and ``m_offset`` (where they start in
    `trigger_contexts.FILE`); NULL in the other rows.

    With `latents` (a run indexed with a sparse dictionary: `ffkv.store.lookups.has_latents`), also the latents'
    rows of latent_trigger_examples.parquet, located the same way on their own (latent_triggers,
    latent_triggers_by_example; ``key`` is the latent), and the texts of their examples.

    Returns where each table's coefficients are stored (`_located`): {"triggers": {"window": [before, after] or None,
    "ranks": the ranks located, or None for all}, "latent_triggers": ... (with `latents`)}.
    """
    te, ex = run.table("trigger_examples"), _sql_path(run.table("examples"))
    lte = run.table("latent_trigger_examples") if latents else None
    columns = pq.read_schema(run.table("trigger_examples")).names
    # Runs of format 3 hold a direction column (+1, and -1 with --sign both); older runs are all +1.
    direction = "t.direction" if "direction" in columns else "CAST(1 AS TINYINT)"
    used = f"SELECT DISTINCT example_id FROM read_parquet('{_sql_path(te)}')"
    if latents:
        used += f" UNION SELECT DISTINCT example_id FROM read_parquet('{_sql_path(lte)}')"
    with atomic.atomic_path(path) as tmp:
        tmp.unlink()
        spill = tmp.with_name(tmp.name + ".spill")
        con = duckdb.connect(str(tmp))
        try:
            con.execute("SET threads TO 2")
            con.execute(f"SET memory_limit = '{DATABASE_MEMORY}'")
            con.execute(f"SET temp_directory = '{_sql_path(spill)}'")
            confine(con, [run.table("trigger_examples"), run.table("examples"), *([lte] if latents else [])], [spill])
            con.execute(f"""
                CREATE TABLE texts AS
                SELECT example_id, token_ids, text FROM read_parquet('{ex}')
                WHERE example_id IN ({used})
                ORDER BY example_id""")
            located = {"triggers": _triggers_table(con, te, "triggers", direction)}
            if latents:
                located["latent_triggers"] = _triggers_table(con, lte, "latent_triggers", None)
            con.execute("CREATE UNIQUE INDEX texts_id ON texts (example_id)")
            con.execute("CHECKPOINT")
        finally:
            con.close()
            shutil.rmtree(spill, ignore_errors=True)
        wal = Path(str(tmp) + ".wal")
        if wal.exists():
            wal.unlink()
    return located


def _triggers_table(con, path: Path, name: str, direction: str | None) -> dict:
    """Create the table `name` (and `name`_by_example) from the trigger rows of the Parquet file `path`,
    located as `_located` decides; `direction` None: a table without that column (latents, positive only).
    Returns `_located`'s window and ranks."""
    triggers = _sql_path(path)
    start, length, located = _located(con, triggers)
    signed = direction is not None
    con.execute(f"""
        CREATE TABLE {name} AS
        SELECT *, CAST(sum(m_length) OVER (ORDER BY layer, key{", direction DESC" if signed else ""}, rank
                                           ROWS UNBOUNDED PRECEDING) - m_length AS BIGINT) AS m_offset
        FROM (SELECT t.layer, t.key, {f"{direction} AS direction, " if signed else ""}t.rank, t.coefficient,
                     t.example_id, t.position, t.next_token_id,
                     CAST(x.token_ids[t.position + 1] AS INTEGER) AS last_token_id,
                     CAST({start} AS INTEGER) AS m_start, CAST({length} AS INTEGER) AS m_length
              FROM read_parquet('{triggers}') t JOIN texts x USING (example_id))
        ORDER BY layer, key{", direction DESC" if signed else ""}, rank""")
    con.execute(f"""
        CREATE TABLE {name}_by_example AS
        SELECT example_id, layer, key, {"direction, " if signed else ""}rank, coefficient, position, last_token_id
        FROM {name}
        ORDER BY example_id, layer, key{", direction DESC" if signed else ""}""")
    return located


def _located(con, triggers: str) -> tuple[str, str, dict]:
    """SQL for where each trigger row's stored coefficients start in its example and how many there are, and what
    decides them: the rows of the ranks `trigger_contexts.located_ranks` gives (every rank while the index has at
    most `trigger_contexts.MAX_ROWS` rows; NULL in the others), each its whole example (window None) while those
    rows' whole examples fit `trigger_contexts.MAX_CELLS`, else `trigger_contexts.window_for` those rows around the
    trigger (the tokens a page shows shaded). Returns (start, length, {"window": ..., "ranks": how many ranks are
    located, None for all})."""
    per_rank = con.execute(f"SELECT t.rank, count(*), coalesce(sum(len(x.token_ids)), 0) "
                           f"FROM read_parquet('{triggers}') t JOIN texts x USING (example_id) "
                           "GROUP BY t.rank ORDER BY t.rank").fetchall()
    ranks = trigger_contexts.located_ranks([n for _, n, _ in per_rank])
    if ranks == 0:
        return "NULL", "NULL", {"window": None, "ranks": 0 if per_rank else None}
    rows, whole = sum(n for _, n, _ in per_rank[:ranks]), sum(w for _, _, w in per_rank[:ranks])
    window = None if whole <= trigger_contexts.MAX_CELLS else list(trigger_contexts.window_for(int(rows)))
    if window is None:
        start, length = "0", "len(x.token_ids)"
    else:
        before, after = window
        start = f"greatest(t.position - {before}, 0)"
        length = f"least(t.position + {after + 1}, len(x.token_ids)) - {start}"
    if ranks == len(per_rank):
        return start, length, {"window": window, "ranks": None}
    only = f"WHEN t.rank <= {int(per_rank[ranks - 1][0])}"
    return f"CASE {only} THEN {start} END", f"CASE {only} THEN {length} END", {"window": window, "ranks": ranks}


def value_tables(loaded: LoadedModel, top1_target: np.ndarray, top_tokens: int = TOP_TOKENS,
                 projection: str = DEFAULT_FOR_VALUES, bar=None, scan: Scan | None = None
                 ) -> tuple[pa.Table, pd.DataFrame]:
    """The value_top_tokens table and the per-key value statistics of every layer (`scan_values`).

    Args:
        top1_target: (L, d_m) trigger target of each key's top-1 trigger example (-1: none).
        scan: scan(layer, projection, targets, top=...) giving `scan_values`' statistics of a layer's values (default:
            `scan_values` itself); `analyze` passes `RunContext.value_scan`, which hands back the values
            experiment's scan of the same targets.
    """
    view = loaded.view
    tops, stats = [], []
    for layer in range(view.n_layers):
        norms = view.values(layer).float().norm(dim=1).cpu().numpy()
        targets = np.asarray(top1_target[layer], dtype=np.int64)
        targets = np.where(targets < view.vocab_size, targets, -1)
        s = (scan(layer, projection, targets, top=top_tokens) if scan is not None
             else scan_values(view, layer, projection, targets, top=top_tokens))
        d_m, k = s["top_token_ids"].shape
        keys = np.arange(d_m)
        tops.append(pd.DataFrame({
            "layer": np.int16(layer), "key": np.repeat(keys, k).astype(np.int32),
            "rank": np.tile(np.arange(k, dtype=np.int16), d_m),
            "token_id": s["top_token_ids"].astype(np.int32).ravel(),
            "prob": s["top_probs"].astype(np.float32).ravel(),
        }))
        has = s["target_rank"] >= 0
        stats.append(pd.DataFrame({
            "layer": np.int16(layer), "key": keys.astype(np.int32),
            "confidence": s["top_prob"].astype(np.float32),
            "top_token_id": s["top_token_id"].astype(np.int32),
            "agreement": has & (s["top_token_id"] == targets),
            # 0-based here (tokens strictly more probable); the pages show it 1-based.
            "next_token_rank": np.where(has, s["target_rank"], -1).astype(np.int32),
            "logsumexp": s["logsumexp"].astype(np.float32),
            "value_norm": norms.astype(np.float32),
        }))
        if bar is not None:
            bar.update(1)
    table = pa.Table.from_pandas(pd.concat(tops, ignore_index=True), schema=schemas.VALUE_TOP_TOKENS,
                                 preserve_index=False)
    return table, pd.concat(stats, ignore_index=True)


def corpus_sample(run: RunDir, n: int = SAMPLE_EXAMPLES, seed: int = 0,
                  max_tokens: int = SAMPLE_MAX_TOKENS) -> list[list[int]]:
    """Token ids of a seeded uniform sample of n examples of the run (each cut to max_tokens).

    Reads only the row groups that hold a chosen row, so memory does not grow with the corpus.
    """
    file = pq.ParquetFile(run.table("examples"))
    total = file.metadata.num_rows
    if total == 0:
        return []
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=min(n, total), replace=False))
    out: list[list[int]] = []
    start = 0
    for group in range(file.num_row_groups):
        rows = file.metadata.row_group(group).num_rows
        inside = chosen[(chosen >= start) & (chosen < start + rows)] - start
        if len(inside):
            column = file.read_row_group(group, columns=["token_ids"]).column(0)
            out.extend(list(column[int(i)].as_py())[:max_tokens] for i in inside)
        start += rows
    return [t for t in out if t]


def sample_batches(loaded: LoadedModel, token_lists: list[list[int]], batch_size: int = 16) -> list:
    """The sample's padded batches (grouped by length), on the host."""
    examples = [Example(i, np.asarray(t, dtype=np.int64), "") for i, t in enumerate(token_lists) if len(t)]
    special = loaded.special_ids
    return [collate(g, loaded.tokenizer.pad_id, special) for g in length_batches(examples, batch_size)]


@torch.no_grad()
def activation_stats(loaded: LoadedModel, batches: list, threshold: np.ndarray | None, bins: int = HISTOGRAM_BINS,
                     bar=None) -> dict[str, np.ndarray]:
    """Per key, over every real position of `batches` (`sample_batches`): the share of positions where it is
    active (`ffkv.memories.active`: |m_i| > `threshold`, the run's tau·s_l per layer: `heldout.active_threshold`,
    s_l of the held-out examples, never of this sample; 0 for ReLU models, whose rule is m_i > 0) and a histogram
    of m_i.

    Returns (L, d_m) arrays ``frequency`` (None without a threshold), ``mean_abs`` (the mean of |m_i| over the
    positions), ``lo``, ``hi``,
    (L, d_m, bins) ``histogram`` (int64 counts of m_i in `bins` equal-width bins from lo to hi; the last bin
    includes hi) and ``positions``, the number of positions counted.
    """
    view = loaded.view
    L, d_m = view.n_layers, view.d_m
    threshold = None if threshold is None else np.asarray(threshold, dtype=np.float64)
    if threshold is not None and threshold.shape != (L,):
        raise FfkvError(f"activation_stats needs one threshold per layer ({L}), got shape {threshold.shape}")
    lo = torch.full((L, d_m), float("inf"), dtype=torch.float64)
    hi = torch.full((L, d_m), float("-inf"), dtype=torch.float64)
    active_count = torch.zeros(L, d_m, dtype=torch.float64)
    abs_sum = torch.zeros(L, d_m, dtype=torch.float64)
    hist = torch.zeros(L, d_m * bins, dtype=torch.int64)
    state: dict = {}

    def coefficients(m: torch.Tensor) -> torch.Tensor:
        return m[state["mask"]].double().cpu()  # (real positions, d_m)

    def first_pass(quantity: str, layer: int, m: torch.Tensor) -> None:
        x = coefficients(m)
        lo[layer] = torch.minimum(lo[layer], x.amin(0))
        hi[layer] = torch.maximum(hi[layer], x.amax(0))

    def second_pass(quantity: str, layer: int, m: torch.Tensor) -> None:
        x = coefficients(m)
        width = (hi[layer] - lo[layer]).clamp(min=1e-30)
        index = ((x - lo[layer]) / width * bins).floor().long().clamp(0, bins - 1)
        hist[layer].scatter_add_(0, (index + torch.arange(d_m) * bins).ravel(), torch.ones(index.numel(), dtype=torch.int64))
        if threshold is not None:
            active_count[layer] += active(x, float(threshold[layer])).sum(0)
        abs_sum[layer] += x.abs().sum(0)

    total = 0
    for sink in (first_pass, second_pass):
        with view.capture(("coefficients",), sink=sink, stop_early=True):
            for batch in batches:
                state["mask"] = batch.attention_mask.bool().to(view.device)
                view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))
                if sink is first_pass:
                    total += batch.n_tokens
                if bar is not None:
                    bar.update(1)
    empty = total == 0
    return {"frequency": None if threshold is None else (active_count / max(total, 1)).float().numpy(),
            "mean_abs": (abs_sum / max(total, 1)).numpy(),
            "lo": (torch.zeros_like(lo) if empty else lo).float().numpy(),
            "hi": (torch.zeros_like(hi) if empty else hi).float().numpy(),
            "histogram": hist.view(L, d_m, bins).numpy(), "positions": np.int64(total)}


def sample_statistics(ctx: RunContext, bar=None) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    """The run's corpus sample (`corpus_sample`, seeded by the call's seed) and `activation_stats` over it under the
    run's active rule: one pass per analyze, read by the explorer's lookups and by pruning's criteria."""
    def compute() -> tuple[list[list[int]], dict[str, np.ndarray]]:
        sample = corpus_sample(ctx.run, seed=ctx.seed)
        return sample, activation_stats(ctx.loaded, sample_batches(ctx.loaded, sample), active_threshold(ctx), bar=bar)
    return ctx.once("sample_statistics", compute)


def trigger_summaries(db_path: Path, table: str, sizes: Mapping[int, int], encoder: bool
                      ) -> tuple[dict[int, np.ndarray], pd.DataFrame]:
    """What the explorer's lookups read of the positive trigger examples of explorer.duckdb's `table` ("triggers":
    the neurons', direction 1; "latent_triggers": every row, a latent's a_j >= 0 goes one way): the neurons' and
    the latents' tables both build from here.

    Returns:
        per layer of `sizes` (layer -> its number of keys), the trigger target of each key's top-1 trigger example
        (-1: none); and per (layer, key) with trigger rows, its most common last token (ties: the lowest id, so
        that the table is the same on every build), that token's share (shallow_share), its rows (n_triggers) and
        its largest coefficient (top_coefficient).
    """
    if table not in ("triggers", "latent_triggers"):
        raise ValueError(f"no trigger table {table!r} in explorer.duckdb")
    signed = table == "triggers"  # a neuron's trigger examples go both ways
    positive = "direction = 1" if signed else "true"
    con = open_database(db_path, tables={table: ("layer", "key", "rank", "coefficient", "next_token_id",
                                                 "last_token_id", *(("direction",) if signed else ()))})
    try:
        first = con.execute(f"SELECT layer, key, next_token_id, last_token_id FROM {table} "
                            f"WHERE rank = 0 AND {positive}").fetchnumpy()
        summaries = con.execute(f"""
            SELECT layer, key, first(last_token_id ORDER BY n DESC, last_token_id) AS common_last_token_id,
                   CAST(max(n) AS FLOAT) / sum(n) AS shallow_share, CAST(sum(n) AS INTEGER) AS n_triggers,
                   max(top) AS top_coefficient
            FROM (SELECT layer, key, last_token_id, count(*) AS n, max(coefficient) AS top FROM {table}
                  WHERE {positive} GROUP BY ALL)
            GROUP BY layer, key""").df()
    finally:
        con.close()
    layers, keys = np.asarray(first["layer"], dtype=np.int64), np.asarray(first["key"], dtype=np.int64)
    targets = trigger_targets(first["next_token_id"], first["last_token_id"], encoder)
    top1 = {}
    for layer, n in sizes.items():
        top1[layer] = np.full(n, -1, dtype=np.int64)
        here = layers == layer
        top1[layer][keys[here]] = targets[here]
    return top1, summaries.astype({"layer": "int16", "key": "int32"})


def refuse_damaged_sources(run: RunDir, manifest: Manifest) -> None:
    """Refuse (`DamagedRun`, naming it and what rewrites it) an index table the lookups are built from that is not
    as written: each one hashed against its record, as `ffkv status --verify` does (the build reads every byte of
    them anyway), so that no page is built from a table whose rows were moved; and the trigger tables' ids within the
    run's shape (`ffkv.store.ranges`: a page would index past an array)."""
    sources = ["examples.parquet", "trigger_examples.parquet"]
    if manifest.identity.index.get("dictionary"):
        sources.append("latent_trigger_examples.parquet")
    for rel in sources:
        run.require_table(rel, manifest, verify=True)
    con = duckdb.connect()
    try:
        con.execute("SET threads TO 2")
        confine(con, [run.path / rel for rel in sources[1:]], [])
        for rel in sources[1:]:  # the trigger tables: their ids, within the run's shape (a page indexes by them)
            spans = con.execute(ranges.SPANS_SQL.format(table=f"read_parquet('{_sql_path(run.path / rel)}')")).df()
            outside = ranges.problem(spans, ranges.sizes(manifest, rel), manifest.top_k)
            if outside is not None:
                raise DamagedRun(f"{run.path / rel} is damaged (its ids lie outside the run's shape: {outside}): "
                                 f"{integrity.rewrite_command(run.path, rel, 'index')}")
    finally:
        con.close()


def build(run: RunDir, manifest: Manifest, loaded: LoadedModel, folder: Path, threshold: np.ndarray,
          progress: bool = False, seed: int = 0, threshold_source: dict | None = None,
          sampled: tuple[list[list[int]], dict[str, np.ndarray]] | None = None,
          dictionary_at: str | Path | None = None, scan: Scan | None = None,
          latents: Latents | None = None) -> Path:
    """Build every lookup table of a run into `folder` (atomically, info.json last); returns the folder.

    `threshold`: the run's tau·s_l per layer (`ffkv.experiments.heldout.active_threshold`), the active rule of the
    activation frequencies; `threshold_source` says where it came from (info.json's activation_sample).
    `sampled`: the corpus sample of `seed` and its `activation_stats` under `threshold`, when the caller has them
    (`sample_statistics`); else computed here. `dictionary_at`: where the dictionary the run was indexed with lies
    now, if its files moved (`ffkv.dictionaries.reopen`). `scan`: how the values are scanned (`value_tables`).
    `latents`: the run's dictionary, already read again and checked (`ffkv.memories.sets.Latents.of_run`), so that
    its files are not read and hashed a second time; None: read here, where the run has one. Its callers (`compute`,
    the explorer's first start) refuse damaged index tables first (`refuse_damaged_sources`), each once, before
    anything is computed from them."""
    started = time.perf_counter()
    view = loaded.view
    folder.mkdir(parents=True, exist_ok=True)
    sample = sampled[0] if sampled is not None else corpus_sample(run, seed=seed)
    batches = sample_batches(loaded, sample) if sampled is None else []
    if not lookups.has_latents(run, manifest):
        latents = None
    elif latents is None:  # read again and checked before anything is written
        from ffkv.memories.sets import Latents

        latents = Latents.of_run(view, manifest.index.get("dictionary"), dictionary_at, run.path)
    located = build_database(run, folder / "explorer.duckdb", latents=latents is not None)
    storing = trigger_contexts.planned(folder / "explorer.duckdb", trigger_contexts.token_macs(view, view.n_layers))
    rows, cells, store_contexts = storing.rows, storing.cells, storing.store
    texts = trigger_contexts.texts_of(folder / "explorer.duckdb") if store_contexts else {}
    context_batches = trigger_contexts.batches_needed(rows, texts) if store_contexts else 0
    bar = progress_bar(progress, 1 + view.n_layers + 2 * len(batches) + context_batches, "explorer lookups", "step")
    bar.update(1)
    top1, shallow = trigger_summaries(folder / "explorer.duckdb", "triggers",
                                      {layer: view.d_m for layer in range(view.n_layers)}, view.encoder)
    top_table, stats = value_tables(loaded, np.stack([top1[layer] for layer in range(view.n_layers)]), bar=bar,
                                    scan=scan)
    act = sampled[1] if sampled is not None else activation_stats(loaded, batches, threshold, bar=bar)
    contexts = storing.not_stored("trigger", "token coefficients")
    riders = None  # the latents' trigger activations, read in the same pass where their examples are these
    if latents is not None and store_contexts:
        from ffkv.experiments import latent_lookups

        riders = latent_lookups.plan_activations(latents, loaded, folder)
    if store_contexts:
        begun = time.perf_counter()
        flat = trigger_contexts.compute(loaded, rows, texts, bar=bar, passenger=riders)
        dtype = trigger_contexts.write(folder / trigger_contexts.FILE, flat)
        contexts = {"file": trigger_contexts.FILE, "cells": cells, "dtype": dtype,
                    **located["triggers"], "max_cells": trigger_contexts.MAX_CELLS,
                    "bytes": (folder / trigger_contexts.FILE).stat().st_size,
                    "seconds": round(time.perf_counter() - begun, 3)}
        del flat, texts
    elif (folder / trigger_contexts.FILE).exists():
        (folder / trigger_contexts.FILE).unlink()  # an older build's, for other rows
    bar.close()
    latent_info = {}
    if latents is not None:  # a run indexed with a sparse dictionary: its latents' tables too
        from ffkv.experiments import latent_lookups

        latent_info = {"latent_trigger_coefficients": latent_lookups.build(
            latents, loaded, folder, sample, located["latent_triggers"], progress=progress,
            activations=riders)}
    else:
        for name in (*lookups.LATENT_FILES, lookups.LATENT_COEFFICIENTS):  # an older build's, of another index
            (folder / name).unlink(missing_ok=True)
    stats["activation_frequency"] = act["frequency"].ravel()
    stats = stats.merge(shallow[["layer", "key", "common_last_token_id", "shallow_share"]], on=["layer", "key"],
                        how="left")
    stats["shallow_share"] = stats["shallow_share"].fillna(0).astype("float32")
    stats["common_last_token_id"] = stats["common_last_token_id"].fillna(-1).astype("int32")
    stats["activation_lo"] = act["lo"].ravel()
    stats["activation_hi"] = act["hi"].ravel()
    stats["activation_histogram"] = list(act["histogram"].reshape(-1, act["histogram"].shape[-1]).astype(np.int32))
    atomic.write_parquet(folder / "value_top_tokens.parquet", top_table)
    atomic.write_parquet(folder / "key_stats.parquet",
                         pa.Table.from_pandas(stats, schema=schemas.KEY_STATS, preserve_index=False))
    lookups.write_info(run, manifest, folder, projection=DEFAULT_FOR_VALUES, top_tokens=TOP_TOKENS,
                       activation_sample={"examples": len(sample), "positions": int(act["positions"]),
                                          "max_tokens": SAMPLE_MAX_TOKENS, "seed": seed, "bins": HISTOGRAM_BINS,
                                          "active_threshold": [float(t) for t in threshold],
                                          "threshold_source": threshold_source or {}},
                       trigger_coefficients=contexts, **latent_info,
                       seconds=round(time.perf_counter() - started, 3))
    return folder


def compute(ctx: RunContext, options=None) -> Result:
    """`ffkv analyze`'s step. Not a table of metrics/: it builds the explorer's lookup tables into RUN/explorer
    itself (`build`, the writing rank alone: a database and files that `ffkv serve` also builds when they are
    missing, each written atomically, info.json last) and records them. Its active rule is the run's: tau·s_l with
    s_l of this call's held-out examples (`heldout.active_scale`, computed once and shared with the studies)."""
    folder = ctx.run.cache_dir
    refuse_damaged_sources(ctx.run, ctx.manifest)
    threshold, source = active_threshold(ctx), threshold_source(ctx)  # every rank: the held-out pass is shared
    has_latents = lookups.has_latents(ctx.run, ctx.manifest)
    if is_writer():
        build(ctx.run, ctx.manifest, ctx.loaded, folder, threshold, progress=ctx.progress, seed=ctx.seed,
              threshold_source=source, sampled=sample_statistics(ctx), dictionary_at=ctx.dictionary_at,
              scan=ctx.value_scan, latents=ctx.memories("latents") if has_latents else None)
    latent_tables = list(lookups.LATENT_FILES) if has_latents else []
    return Result(ctx.view.n_layers, record={"folder": str(folder.relative_to(ctx.run.path)),
                                             "tables": list(lookups.FILES) + latent_tables,
                                             "projection": DEFAULT_FOR_VALUES,
                                             "sample_examples": SAMPLE_EXAMPLES})



def skip_reason(ctx: RunContext) -> str | None:
    """Why the lookups cannot be built: the run's dictionary cannot be read again (its latents' pages are built from
    it; `ffkv serve --dictionary PATH` builds them once it is named)."""
    return ctx.dictionary_problem()


#: Not a study: the explorer's lookup tables, built by `analyze` so that `ffkv serve` answers at once.
EXPERIMENT = Experiment(name=NAME, title="The explorer's lookup tables", section="the explorer", order=11,
                        compute=compute, held_out=True,  # the active rule's s_l, for a signed model
                        own_pass="every trigger example once, to the last layer (the coefficients a memory page "
                                 "shades), where a page's own pass would cost more than `trigger_contexts.LIVE_MACS` "
                                 "(a small model's pages compute their own): the indexed examples, not the held-out "
                                 "ones; its corpus sample's activation statistics are pruning's (`sample_statistics`, "
                                 "one pass for both)",
                        latents="explorer/latent_stats.parquet, explorer/latent_value_top_tokens.parquet, "
                                "explorer/latent_trigger_coefficients.npy, explorer/explorer.duckdb: each latent's page "
                                "(trigger examples shaded by a_j, decoder-row tokens, activation histogram; its "
                                "latent_triggers table), read from the neurons' passes "
                                "(`ffkv.experiments.latent_lookups`)",
                        skip_reason=skip_reason, module=__name__)
