"""Per-token coefficients of every trigger example, computed once with the explorer's lookup tables.

A memory page shades each token of a key's trigger examples by the key's coefficient m_i there
(the prefix ending at that token for a causal model, the whole example for an encoder, as the
index reads it). Computing them when the page is first asked for costs a forward pass over the
key's examples (1-4 s on a CPU); here one pass over every example the trigger rows use, capturing
every layer, computes them for all keys at once, and the page reads a slice of a file.

Stored in RUN/explorer/ as `FILE` (read by `ffkv.store.lookups.read_coefficients`): one flat
float16 array (float32 when some |m| exceeds float16's range), the rows of the ``triggers`` table
of explorer.duckdb one after another in its order, each as long as its example, or, where every
row's whole example would exceed `MAX_CELLS`, as long as the `WINDOW` around its trigger (a real
model's index: the page shades those tokens); the row's ``m_offset``, ``m_start`` and ``m_length``
point into it. float16 keeps three
significant digits (the page shows three; the trigger position's own coefficient is the index's,
exact). Skipped (the explorer then computes a page's coefficients when it is asked for) when even
the windows hold more than `MAX_CELLS` tokens in all, or the index more than `MAX_ROWS` rows.
"""

from __future__ import annotations

import io
from pathlib import Path

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
#: with examples of a few tokens; the 8B-scale index, 92M rows, is never located).
MAX_ROWS = 6_000_000
#: Tokens before and after the trigger position whose coefficients are stored, where every row's whole example
#: would exceed `MAX_CELLS` (SmolLM2-135M, 30 layers x 1,536 keys x 2 directions x top-20 over WikiText lines: 1.8M
#: rows, their whole examples about 200M cells; their windows 50M, 100 MB in float16).
WINDOW = (20, 6)
#: Examples per forward pass, and padded tokens per batch.
BATCH_SIZE = 16
MAX_BATCH_TOKENS = 8192


def plan(db_path: Path) -> dict[str, np.ndarray] | None:
    """The rows of explorer.duckdb's triggers table in the order of their coefficients: layer, key, example_id,
    m_offset, m_start, m_length (numpy arrays); None when the table locates none (more than `MAX_ROWS` rows)."""
    con = open_database(db_path, tables={"triggers": ("layer", "key", "example_id", "m_offset", "m_start",
                                                      "m_length")})
    try:
        rows = con.execute("SELECT layer, key, example_id, m_offset, m_start, m_length FROM triggers "
                           "WHERE m_offset IS NOT NULL ORDER BY m_offset").fetchnumpy()
        located = con.execute("SELECT count(*) = count(m_offset) FROM triggers").fetchone()[0]
    finally:
        con.close()
    if not located:
        return None
    return {name: np.asarray(column) for name, column in rows.items()}


def texts_of(db_path: Path) -> dict[int, list[int]]:
    """Token ids of every example the trigger rows use (explorer.duckdb's texts table)."""
    con = open_database(db_path, tables={"texts": ("example_id", "token_ids")})
    try:
        table = con.execute("SELECT example_id, token_ids FROM texts").fetchnumpy()
    finally:
        con.close()
    return {int(e): list(t) for e, t in zip(table["example_id"], table["token_ids"])}


@torch.no_grad()
def compute(loaded: LoadedModel, rows: dict[str, np.ndarray], texts: dict[int, list[int]], bar=None) -> np.ndarray:
    """m of each row's key at the stored positions of its example (``m_start`` on, ``m_length`` of them), the rows
    one after another (`plan`'s order).

    Args:
        rows: `plan`'s arrays.
        texts: token ids of every example the rows use.
        bar: a progress bar, advanced once per batch.

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

    with view.capture(("coefficients",), sink=sink, stop_early=True):
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


def batches_needed(rows: dict[str, np.ndarray], texts: dict[int, list[int]]) -> int:
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
