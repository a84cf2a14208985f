"""The explorer's lookup tables of a sparse dictionary's latents (docs/definitions.md), built with the neurons'.

A run indexed with ``--dictionary`` holds each latent's trigger examples (latent_trigger_examples.parquet). A
latent is a key-value memory of its own (key e_j, coefficient a_j(x), value d_j), and its page shows what a
neuron's shows; these tables let it answer without running the model (`ffkv.store.lookups`, "latents"):

- latent_value_top_tokens.parquet and latent_stats.parquet's value columns: d_j read as a neuron's v_i is
  (`scan_values` through the same projection, identity: the paper's), with the trigger target of the latent's
  top-1 trigger example (`ffkv.memories.targets`) and its rank;
- latent_stats.parquet's activation columns, over the corpus sample the neurons' histograms use
  (`ffkv.experiments.lookups.corpus_sample`): the share of positions where a_j > 0 (its activation is its active
  rule) and a histogram of a_j (equal-width bins from the sample's smallest to its largest a_j, two passes);
- its trigger rows' common last token and share (shallow_share), their count and the largest a_j;
- latent_trigger_coefficients.npy: a_j at every token of each latent trigger example (or of a window around its
  trigger, `ffkv.experiments.trigger_contexts.window_for`), in the order of explorer.duckdb's latent_triggers,
  written as `trigger_contexts.write` writes the neurons'.

The activations are the dictionary's own encoding of what its keys read (`ffkv.memories.sets.Latents`), so a
stored a_j at a trigger position is the index's coefficient there.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ffkv.batching import collate, length_batches
from ffkv.corpus import Example
from ffkv.experiments import trigger_contexts
from ffkv.experiments.common import progress_bar
from ffkv.experiments.lookups import trigger_summaries
from ffkv.memories.projection import DEFAULT_FOR_VALUES, scan_values
from ffkv.memories.sets import Latents
from ffkv.models.loading import LoadedModel
from ffkv.store import atomic, lookups, schemas

#: Top tokens kept per decoder row (as the neurons' `ffkv.experiments.lookups.TOP_TOKENS`).
TOP_TOKENS = 10
#: Bins of a latent's activation histogram.
HISTOGRAM_BINS = 24
#: Padded tokens per forward pass: a batch's dense activations are tokens x latents floats (24,576 latents x 2,048
#: tokens: 200 MB).
MAX_BATCH_TOKENS = 2048


def build(latents: Latents, loaded: LoadedModel, folder: Path, sample: list[list[int]], located: dict,
          progress: bool = False, activations: TriggerActivations | None = None) -> dict:
    """Write the latents' tables into `folder` (explorer.duckdb, with its latent_triggers, already written by
    `ffkv.experiments.lookups.build_database`); returns info.json's ``latent_trigger_coefficients`` record.

    Args:
        latents: the run's (`ffkv.memories.sets.Latents.of_run`).
        sample: token ids of the corpus sample the neurons' activation statistics read.
        located: `ffkv.experiments.lookups.build_database`'s record of latent_triggers: the window ([before, after]
            of the stored activations around each trigger, or None: whole examples) and the ranks located (None:
            every rank).
        activations: `plan_activations`'s, already fed by the neurons' pass over their trigger examples (the
            examples it did not run get their own passes here); None: every example in passes of its own.
    """
    db = folder / "explorer.duckdb"
    storing = _planned(loaded, latents, db)
    rows, cells, store = storing.rows, storing.cells, storing.store
    texts = trigger_contexts.texts_of(db) if store and activations is None else {}
    bar = progress_bar(progress, len(latents.layers) + 2, "latent lookups", "step")
    top1, summaries = trigger_summaries(db, "latent_triggers", {layer: latents.size(layer) for layer in latents.layers},
                                        loaded.view.encoder)
    tops, stats = [], []
    for layer in latents.layers:
        tables = _value_tables(loaded, latents, layer, top1[layer])
        tops.append(tables[0])
        stats.append(tables[1])
        bar.update(1)
    stats = pd.concat(stats, ignore_index=True)
    act = activation_stats(loaded, latents, sample)
    bar.update(1)
    record = storing.not_stored("latent trigger", "activations")
    path = folder / lookups.LATENT_COEFFICIENTS
    if store:
        begun = time.perf_counter()
        flat = activations.finish(loaded) if activations is not None else trigger_coefficients(loaded, latents,
                                                                                                rows, texts)
        dtype = trigger_contexts.write(path, flat)
        record = {"file": lookups.LATENT_COEFFICIENTS, "cells": cells, "dtype": dtype, **located,
                  "max_cells": trigger_contexts.MAX_CELLS, "bytes": path.stat().st_size,
                  "seconds": round(time.perf_counter() - begun, 3)}
    elif path.exists():
        path.unlink()  # an older build's, for other rows
    bar.update(1)
    bar.close()
    stats = stats.merge(summaries, on=["layer", "key"], how="left")
    stats["shallow_share"] = stats["shallow_share"].fillna(0).astype("float32")
    stats["common_last_token_id"] = stats["common_last_token_id"].fillna(-1).astype("int32")
    stats["n_triggers"] = stats["n_triggers"].fillna(0).astype("int32")
    stats["top_coefficient"] = stats["top_coefficient"].astype("float32")  # NaN: a latent that never fired
    # stats holds the layers in `latents.layers` order, each's latents 0..n-1, as `activation_stats` does
    stats["activation_frequency"] = np.concatenate(act["frequency"]).astype(np.float32)
    stats["activation_lo"] = np.concatenate(act["lo"]).astype(np.float32)
    stats["activation_hi"] = np.concatenate(act["hi"]).astype(np.float32)
    stats["activation_histogram"] = list(np.concatenate(act["histogram"]).astype(np.int32))
    atomic.write_parquet(folder / "latent_value_top_tokens.parquet",
                         pa.Table.from_pandas(pd.concat(tops, ignore_index=True), schema=schemas.VALUE_TOP_TOKENS,
                                              preserve_index=False))
    atomic.write_parquet(folder / "latent_stats.parquet",
                         pa.Table.from_pandas(stats[schemas.LATENT_STATS.names], schema=schemas.LATENT_STATS,
                                              preserve_index=False))
    record["sample_positions"] = int(act["positions"])
    record["layers"] = {str(layer): {"kind": latents.dictionaries[layer].kind,
                                     "n_latents": latents.size(layer)} for layer in latents.layers}
    return record


def _value_tables(loaded: LoadedModel, latents: Latents, layer: int, targets: np.ndarray
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One layer's decoder rows read as values (`scan_values`, `DEFAULT_FOR_VALUES`): their top tokens (rows of
    latent_value_top_tokens) and value statistics (columns of latent_stats)."""
    view = loaded.view
    targets = np.where(targets < view.vocab_size, targets, -1)
    s = scan_values(view, layer, DEFAULT_FOR_VALUES, targets, top=TOP_TOKENS, memories=latents)
    n, k = s["top_token_ids"].shape
    keys = np.arange(n)
    top = pd.DataFrame({"layer": np.int16(layer), "key": np.repeat(keys, k).astype(np.int32),
                        "rank": np.tile(np.arange(k, dtype=np.int16), n),
                        "token_id": s["top_token_ids"].astype(np.int32).ravel(),
                        "prob": s["top_probs"].astype(np.float32).ravel()})
    has = s["target_rank"] >= 0
    norms = latents.values(layer).float().norm(dim=1).cpu().numpy()
    stats = pd.DataFrame({"layer": np.int16(layer), "key": keys.astype(np.int32),
                          "confidence": s["top_prob"].astype(np.float32),
                          "top_token_id": s["top_token_id"].astype(np.int32),
                          "agreement": has & (s["top_token_id"] == targets),
                          "next_token_rank": np.where(has, s["target_rank"], -1).astype(np.int32),
                          "logsumexp": s["logsumexp"].astype(np.float32),
                          "value_norm": norms.astype(np.float32)})
    return top, stats


def _batches(loaded: LoadedModel, token_lists: dict[int, np.ndarray]) -> list:
    """Padded batches of the examples (id -> token ids), grouped by length, at most `MAX_BATCH_TOKENS` each."""
    examples = [Example(int(e), np.asarray(t, dtype=np.int64), "") for e, t in sorted(token_lists.items()) if len(t)]
    groups = length_batches(examples, trigger_contexts.BATCH_SIZE, MAX_BATCH_TOKENS)
    return [collate(g, loaded.tokenizer.pad_id, loaded.special_ids) for g in groups]


def _passes(loaded: LoadedModel, latents: Latents, batches: list, each) -> None:
    """One forward pass per batch that stops after the dictionaries' last layer, calling
    ``each(batch, layer, activations)`` with each layer's dense activations (batch, tokens, latents)."""
    view = loaded.view
    state: dict = {}

    def sink(quantity: str, layer: int, captured: torch.Tensor) -> None:
        if layer in latents.dictionaries and quantity == latents.reads(layer):
            each(state["batch"], layer, latents.coefficients(layer, captured).float())

    quantities = sorted({latents.reads(layer) for layer in latents.layers})
    with torch.no_grad(), view.capture(quantities, layers=latents.layers, sink=sink, stop_early=True):
        for batch in batches:
            state["batch"] = batch
            view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))


def activation_stats(loaded: LoadedModel, latents: Latents, sample: list[list[int]], bins: int = HISTOGRAM_BINS
                     ) -> dict:
    """Per layer of the dictionary (in `latents.layers` order), over every real position of the sample: the share
    of positions where each latent is active (a_j > 0), its mean a_j (``mean``), the smallest and largest a_j, and a
    histogram of a_j in `bins` equal-width bins from the smallest to the largest (the last bin includes it); two
    passes, so memory holds one batch's activations at a time. ``positions`` counts the positions."""
    batches = _batches(loaded, dict(enumerate(sample)))
    index = {layer: i for i, layer in enumerate(latents.layers)}
    n = [latents.size(layer) for layer in latents.layers]
    lo = [torch.full((k,), float("inf"), dtype=torch.float64) for k in n]
    hi = [torch.full((k,), float("-inf"), dtype=torch.float64) for k in n]
    active = [torch.zeros(k, dtype=torch.float64) for k in n]
    total = [torch.zeros(k, dtype=torch.float64) for k in n]
    hist = [torch.zeros(k * bins, dtype=torch.int64) for k in n]

    def real(batch, a: torch.Tensor) -> torch.Tensor:
        return a[batch.attention_mask.bool().to(a.device)].double().cpu()  # (positions, latents)

    def first(batch, layer: int, a: torch.Tensor) -> None:
        i, x = index[layer], real(batch, a)
        lo[i] = torch.minimum(lo[i], x.amin(0))
        hi[i] = torch.maximum(hi[i], x.amax(0))
        active[i] += (x > 0).sum(0)
        total[i] += x.sum(0)

    def second(batch, layer: int, a: torch.Tensor) -> None:
        i, x = index[layer], real(batch, a)
        width = (hi[i] - lo[i]).clamp(min=1e-30)
        at = ((x - lo[i]) / width * bins).floor().long().clamp(0, bins - 1)
        hist[i].scatter_add_(0, (at + torch.arange(n[i]) * bins).ravel(), torch.ones(at.numel(), dtype=torch.int64))

    positions = sum(int(b.attention_mask.sum()) for b in batches)
    _passes(loaded, latents, batches, first)
    _passes(loaded, latents, batches, second)
    empty = positions == 0
    return {"frequency": [(a / max(positions, 1)).float().numpy() for a in active],
            "mean": [(t / max(positions, 1)).numpy() for t in total],
            "lo": [(torch.zeros_like(x) if empty else x).float().numpy() for x in lo],
            "hi": [(torch.zeros_like(x) if empty else x).float().numpy() for x in hi],
            "histogram": [h.view(k, bins).numpy() for h, k in zip(hist, n)], "positions": positions}


class TriggerActivations:
    """a_j of each latent trigger row at the stored positions of its example (``m_start`` on, ``m_length`` of them),
    the rows one after another (`trigger_contexts.plan`'s order of latent_triggers), gathered from whichever
    forward pass captures what the latents read: the neurons' pass over their trigger examples
    (`trigger_contexts.compute`'s passenger), and `finish`'s own over the examples it did not run."""

    def __init__(self, latents: Latents, rows: dict[str, np.ndarray], texts: dict[int, np.ndarray]) -> None:
        self.latents, self.rows = latents, rows
        self.quantities = tuple(sorted({latents.reads(layer) for layer in latents.layers}))
        total = int(rows["m_length"].sum()) if len(rows["m_length"]) else 0
        self.flat = np.zeros(total, dtype=np.float32)
        self.needed = {int(e): texts[int(e)] for e in np.unique(rows["example_id"])}
        self.done: set[int] = set()
        self.order = np.argsort(rows["example_id"], kind="stable")
        self.example_sorted = rows["example_id"][self.order]

    def read(self, quantity: str, layer: int, captured: torch.Tensor, example_ids: np.ndarray) -> None:
        """`trigger_contexts.Passenger.read`: the rows of this batch's examples at a dictionary layer."""
        if layer in self.latents.dictionaries and quantity == self.latents.reads(layer):
            self.fill(layer, self.latents.coefficients(layer, captured).float(), example_ids)

    def fill(self, layer: int, a: torch.Tensor, example_ids: np.ndarray) -> None:
        """Place the rows of `layer` among the batch's examples (ascending ids) from their activations a."""
        rows, ids = self.rows, example_ids
        lo, hi = np.searchsorted(self.example_sorted, ids), np.searchsorted(self.example_sorted, ids, "right")
        self.done.update(int(e) for e in ids)
        chosen = np.concatenate([self.order[x:y] for x, y in zip(lo, hi)])
        chosen = chosen[rows["layer"][chosen] == layer]
        if not len(chosen):
            return
        batch_row = np.searchsorted(ids, rows["example_id"][chosen])
        keys = torch.as_tensor(rows["key"][chosen].astype(np.int64), device=a.device)
        values = a[torch.as_tensor(batch_row, device=a.device), :, keys].cpu().numpy()  # (rows, T)
        starts, lengths = rows["m_start"][chosen][:, None], rows["m_length"][chosen][:, None]
        at = np.arange(values.shape[1])[None, :]
        inside = (at >= starts) & (at < starts + lengths)
        self.flat[(rows["m_offset"][chosen][:, None] + at - starts)[inside]] = values[inside]

    def finish(self, loaded: LoadedModel) -> np.ndarray:
        """Run the examples no pass has read yet (their own passes, stopping after the last dictionary layer);
        returns the flat float32 activations."""
        left = {e: t for e, t in self.needed.items() if e not in self.done}
        if left:
            _passes(loaded, self.latents, _batches(loaded, left),
                    lambda batch, layer, a: self.fill(layer, a, batch.example_ids.numpy()))
        return self.flat


def trigger_coefficients(loaded: LoadedModel, latents: Latents, rows: dict[str, np.ndarray],
                         texts: dict[int, np.ndarray]) -> np.ndarray:
    """`TriggerActivations` computed in passes of their own (no other pass reads the examples)."""
    return TriggerActivations(latents, rows, texts).finish(loaded)


def plan_activations(latents: Latents, loaded: LoadedModel, folder: Path) -> TriggerActivations | None:
    """The latent trigger activations `build` stores, ready to ride on the neurons' pass; None where none are
    stored (more than `trigger_contexts.MAX_CELLS`, no window fits, or a page computes its own cheaply)."""
    db = folder / "explorer.duckdb"
    storing = _planned(loaded, latents, db)
    if not storing.store:
        return None
    return TriggerActivations(latents, storing.rows, trigger_contexts.texts_of(db))


def _planned(loaded: LoadedModel, latents: Latents, db: Path) -> trigger_contexts.Storing:
    """What the build stores of the latent trigger rows (`trigger_contexts.planned`), a latent page's own pass
    running through the deepest dictionary's layer and its encoder."""
    per_token = trigger_contexts.token_macs(loaded.view, max(latents.layers) + 1,
                                            max(latents.size(layer) for layer in latents.layers))
    return trigger_contexts.planned(db, per_token, "latent_triggers")


__all__ = ["TOP_TOKENS", "HISTOGRAM_BINS", "TriggerActivations", "build", "activation_stats", "plan_activations",
           "trigger_coefficients"]
