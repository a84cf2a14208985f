"""Per-token coefficients of every trigger example, computed once with the explorer's lookup tables.

A memory page shades each token of a key's trigger examples by the key's coefficient m_i there
(the prefix ending at that token for a causal model, the whole example for an encoder, as the
index reads it). Computing them when the page is first asked for costs a forward pass over the
key's examples (SmolLM2-135M: 1-57 s on a CPU); here one pass over every example the trigger rows use,
capturing every layer, computes them for all keys at once, and the page reads a slice of a file.

Stored in RUN/explorer/ as `FILE` (read by `ffkv.store.lookups.read_coefficients`, which checks it against
info.json's record and names it when it differs): one flat float16 array (float32 when some |m| exceeds float16's
range), the rows of the ``triggers`` table of explorer.duckdb one after another in its order, each as long as its
example, or, where every row's whole example would exceed `MAX_CELLS`, as long as a window around its trigger
(`window_for`: `WINDOW`, narrowed where the rows' windows would exceed `MAX_CELLS`; the tokens a page shades); the
row's ``m_offset``, ``m_start`` and ``m_length`` point into it. The file therefore holds at most
min(Σ whole examples, rows × window width) ≤ `MAX_CELLS` values: 120 MB in float16 (240 MB in the float32 case).
float16 keeps three significant digits (the page shows three; the trigger position's own coefficient is the
index's, exact). An index of more than `MAX_ROWS` rows (an 8B model's: 92M) stores them for the strongest ranks of
every memory in each direction, as many as fit (`located_ranks`: at Llama-3.1-8B's shape, ranks 0-5 of 100, in a
window of 10 tokens); its other rows' pages show the trigger position's coefficient alone, and no page runs the
model. Skipped (the explorer then computes a page's coefficients when it is asked for) for a model whose pages cost
little to compute: where a page's forward pass over
one memory's trigger examples (`page_macs`, the costliest tenth of the memories) stays within `LIVE_MACS`, the
pass over every example would cost the build more than all first views together save (ffkv-tiny's demo: 21 s
of its lookups' 24 s, for first views of 0.1 s instead of 0.03 s).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import torch

from ffkv.batching import collate, length_batches
from ffkv.corpus import Example
from ffkv.models.loading import LoadedModel
from ffkv.store import atomic, lookups
from ffkv.store.database import open_database

#: The file in RUN/explorer/.
FILE = lookups.COEFFICIENTS
#: Most token coefficients stored (float16: 2 bytes each; the build holds them as float32, 4 bytes).
MAX_CELLS = 60_000_000
#: Most trigger rows for which explorer.duckdb locates coefficients (more rows cannot stay under `MAX_CELLS`
#: with examples of a few tokens); an index of more locates its strongest ranks (`located_ranks`).
MAX_ROWS = 6_000_000
#: Tokens before and after the trigger position whose coefficients are stored, where every row's whole example
#: would exceed `MAX_CELLS` (SmolLM2-135M, 30 layers x 1,536 keys x 2 directions x top-20 over WikiText lines: 1.8M
#: rows, their whole examples about 200M cells; their windows 47M, 93 MB in float16). Narrowed by `window_for` where
#: the rows' windows would exceed `MAX_CELLS` (the same model at the index's default top-50: 4.6M rows).
WINDOW = (20, 6)
#: The narrowest window `window_for` gives: the trigger, the token after it (the page underlines it) and this many
#: before. `MAX_ROWS` x (`MIN_BEFORE` + 2) must not exceed `MAX_CELLS`.
MIN_BEFORE = 2
#: Examples per forward pass, and padded tokens per batch.
BATCH_SIZE = 16
MAX_BATCH_TOKENS = 8192
#: Multiply-adds of a page's own forward pass (`page_macs`) at or under which nothing is stored. On this project's
#: 2-core CPU at a load of 2, ffkv-tiny's demo pages (11 G: 50 verses through 6 layers of 4.7M weights) took 0.11 s
#: (median; 0.18 s at most), where SmolLM2-135M's over WikiText lines (800 G at top-20) took 7 s: 25 G keeps a
#: first view near 0.25 s, half the explorer's 0.5 s.
LIVE_MACS = 25e9


def window_for(rows: int) -> tuple[int, int] | None:
    """The tokens before and after each trigger position whose coefficients are stored for an index of `rows`
    trigger rows whose whole examples do not fit `MAX_CELLS`: `WINDOW` while rows x its width fits `MAX_CELLS`, else
    the widest window that does, cut from both sides in `WINDOW`'s proportions (at least the token after the
    trigger, and `MIN_BEFORE` before it); None (nothing stored) beyond `MAX_ROWS` rows, or where even that narrowest
    window would exceed `MAX_CELLS`.

    So the stored cells never exceed rows x (before + 1 + after) <= `MAX_CELLS` (a row near its example's start or
    end holds fewer)."""
    if rows > MAX_ROWS or rows * (MIN_BEFORE + 2) > MAX_CELLS:
        return None
    before, after = WINDOW
    width = before + 1 + after
    if rows * width <= MAX_CELLS:
        return before, after
    width = MAX_CELLS // rows
    after = max(1, min(after, (width - 1) * after // (before + after)))
    return width - 1 - after, after


def located_ranks(per_rank: Sequence[int]) -> int:
    """How many of a trigger table's ranks (0, 1, ...: the strongest rows of every memory, in each direction) get
    stored coefficients, given the table's rows at each rank: all of them while `window_for` the whole table gives a
    window, else the most leading ranks whose rows do (at most `MAX_ROWS`; 0 where not even rank 0's fit). Every
    memory's page then shades the same strongest examples, and the stored cells stay within `MAX_CELLS`."""
    counts = np.cumsum(np.asarray(per_rank, dtype=np.int64))
    return int(sum(window_for(int(rows)) is not None for rows in counts))


def token_macs(view, through: int, latents: int = 0) -> float:
    """Multiply-adds per token of a forward pass through the first `through` blocks of `view`'s model (one per
    weight of each block's matrices: attention's projections, the FF layer's two or three) and a dictionary's
    encoder of `latents` latents; attention's own products, norms and biases left out."""
    weights = sum(p.numel() for block in view.blocks[:through] for p in block.parameters() if p.dim() == 2)
    return float(weights + view.d_model * latents)


def page_macs(db_path: Path, per_token: float, table: str = "triggers") -> float:
    """Multiply-adds of the forward pass a page runs over one memory's trigger examples when none are stored: the
    tokens of a memory's examples (the 90th percentile over the memories of `table`), times `per_token`
    (`token_macs`)."""
    if table not in ("triggers", "latent_triggers"):
        raise ValueError(f"no trigger table {table!r} in explorer.duckdb")
    con = open_database(db_path, tables={table: ("layer", "key", "example_id"), "texts": ("example_id", "token_ids")})
    try:
        tokens = con.execute(f"SELECT quantile_cont(n, 0.9) FROM (SELECT sum(len(x.token_ids)) AS n FROM {table} t "
                             "JOIN texts x USING (example_id) GROUP BY t.layer, t.key)").fetchone()[0]
    finally:
        con.close()
    return float(tokens or 0.0) * per_token


@dataclass(frozen=True)
class Storing:
    """Whether a build stores the per-token values of a trigger table's rows (`planned`): the rows `plan` locates,
    their cells, and a page's own pass over one memory's examples (`page_macs`; None where the rows do not fit
    `MAX_CELLS`)."""

    rows: dict[str, np.ndarray] | None
    cells: int | None
    macs: float | None

    @property
    def store(self) -> bool:
        """They fit `MAX_CELLS`, and a page would not compute them cheaply (more than `LIVE_MACS`)."""
        return self.macs is not None and self.macs > LIVE_MACS

    def not_stored(self, rows: str, values: str) -> dict:
        """info.json's record of values not stored, with why; `rows` and `values` name them (``trigger``,
        ``token coefficients``)."""
        if self.macs is not None:
            return {"file": None, "cells": self.cells, "page_macs": self.macs,
                    "reason": f"a page's own forward pass costs {self.macs / 1e9:.1f}G multiply-adds, at most "
                              f"{LIVE_MACS / 1e9:.0f}G: computed at its first view"}
        return {"file": None, "cells": self.cells, "reason": f"more than {MAX_ROWS:,} {rows} rows of rank 0, or "
                                                             f"more than {MAX_CELLS:,} {values} in the narrowest "
                                                             "window"}


def planned(db_path: Path, per_token: float, table: str = "triggers") -> Storing:
    """What a build of explorer.duckdb's `table` stores (`Storing`), a page's pass costing `per_token` multiply-adds
    a token (`token_macs`)."""
    rows = plan(db_path, table)
    cells = int(rows["m_length"].sum()) if rows is not None else None
    fits = cells is not None and cells <= MAX_CELLS
    return Storing(rows, cells, page_macs(db_path, per_token, table) if fits else None)


def plan(db_path: Path, table: str = "triggers") -> dict[str, np.ndarray] | None:
    """The rows of explorer.duckdb's triggers table (or `table`: ``latent_triggers``) whose coefficients it locates,
    in the order of their coefficients: layer, key, example_id, m_offset, m_start, m_length (numpy arrays); None when
    it has rows but locates none of them (not even rank 0's fit: `located_ranks`)."""
    if table not in ("triggers", "latent_triggers"):
        raise ValueError(f"no trigger table {table!r} in explorer.duckdb")
    con = open_database(db_path, tables={table: ("layer", "key", "example_id", "m_offset", "m_start", "m_length")})
    try:
        rows = con.execute(f"SELECT layer, key, example_id, m_offset, m_start, m_length FROM {table} "
                           "WHERE m_offset IS NOT NULL ORDER BY m_offset").fetchnumpy()
        located = len(rows["m_offset"]) or not con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        con.close()
    if not located:
        return None
    return {name: np.asarray(column) for name, column in rows.items()}


def texts_of(db_path: Path) -> dict[int, np.ndarray]:
    """Token ids of every example the trigger rows use (explorer.duckdb's texts table), each a numpy array (as
    Python lists, the 1.2M examples of an 8B model's index held 4 GB)."""
    con = open_database(db_path, tables={"texts": ("example_id", "token_ids")})
    try:
        table = con.execute("SELECT example_id, token_ids FROM texts").fetchnumpy()
    finally:
        con.close()
    return {int(e): np.asarray(t) for e, t in zip(table["example_id"], table["token_ids"])}


class Passenger(Protocol):
    """Another reader of `compute`'s pass over the trigger examples (the latents' activations, which read the FF
    input or output of the same examples): what it captures, and what it does with each captured tensor."""

    quantities: tuple[str, ...]

    def read(self, quantity: str, layer: int, captured: torch.Tensor, example_ids: np.ndarray) -> None:
        """One layer's captured `quantity` (batch, tokens, ...) of the batch's examples (ascending ids)."""


@torch.no_grad()
def compute(loaded: LoadedModel, rows: dict[str, np.ndarray], texts: dict[int, np.ndarray], bar=None,
            passenger: Passenger | None = None) -> np.ndarray:
    """m of each row's key at the stored positions of its example (``m_start`` on, ``m_length`` of them), the rows
    one after another (`plan`'s order).

    Args:
        rows: `plan`'s arrays.
        texts: token ids of every example the rows use.
        bar: a progress bar, advanced once per batch.
        passenger: another reader of the same pass (its batches are these rows' examples, whoever reads them).

    Returns a flat float32 array of length ``sum(m_length)``.
    """
    view = loaded.view
    total = int(rows["m_length"].sum()) if len(rows["m_length"]) else 0
    flat = np.zeros(total, dtype=np.float32)
    order = np.argsort(rows["example_id"], kind="stable")
    example_sorted = rows["example_id"][order]
    examples = [Example(int(e), np.asarray(texts[int(e)], dtype=np.int64), "") for e in np.unique(example_sorted)]
    special = loaded.special_ids
    state: dict = {}

    def sink(quantity: str, layer: int, m: torch.Tensor) -> None:
        if quantity != "coefficients":
            passenger.read(quantity, layer, m, state["ids"])
            return
        chosen = state["rows"][rows["layer"][state["rows"]] == layer]
        if not len(chosen):
            return
        batch_row = np.searchsorted(state["ids"], rows["example_id"][chosen])
        keys = torch.as_tensor(rows["key"][chosen].astype(np.int64), device=m.device)
        values = m[torch.as_tensor(batch_row, device=m.device), :, keys].float().cpu().numpy()  # (rows, T)
        starts, lengths = rows["m_start"][chosen][:, None], rows["m_length"][chosen][:, None]
        at = np.arange(values.shape[1])[None, :]
        inside = (at >= starts) & (at < starts + lengths)
        where = rows["m_offset"][chosen][:, None] + at - starts
        flat[where[inside]] = values[inside]

    quantities = ("coefficients", *(q for q in passenger.quantities if q != "coefficients")) if passenger else \
        ("coefficients",)
    with view.capture(quantities, sink=sink, stop_early=True):
        for group in length_batches(examples, BATCH_SIZE, MAX_BATCH_TOKENS):
            batch = collate(group, loaded.tokenizer.pad_id, special)
            ids = batch.example_ids.numpy()  # sorted (`collate`)
            lo, hi = np.searchsorted(example_sorted, ids), np.searchsorted(example_sorted, ids, "right")
            state["ids"] = ids
            state["rows"] = np.concatenate([order[a:b] for a, b in zip(lo, hi)])  # the rows of this batch's examples
            view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))
            if bar is not None:
                bar.update(1)
    return flat


def batches_needed(rows: dict[str, np.ndarray], texts: dict[int, np.ndarray]) -> int:
    """How many forward passes `compute` makes (for a progress bar)."""
    examples = [Example(int(e), np.zeros(len(texts[int(e)]), dtype=np.int64), "") for e in np.unique(rows["example_id"])]
    return len(length_batches(examples, BATCH_SIZE, MAX_BATCH_TOKENS))


def write(path: Path, flat: np.ndarray) -> str:
    """Write the coefficients atomically as float16 (float32 where some value overflows float16); returns the dtype."""
    small = flat.astype(np.float16)
    data = small if np.isfinite(small).all() or not np.isfinite(flat).all() else flat
    buffer = io.BytesIO()
    np.save(buffer, data, allow_pickle=False)
    atomic.write_bytes(path, buffer.getvalue())
    return str(data.dtype)
