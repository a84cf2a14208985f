"""The positions the index leaves out of ranking, counted and named for the manifest.

A prefix that ends in a special token of the tokenizer (BOS, EOS, CLS, SEP, padding, and the unknown
token: PTB's ``<unk>`` read by a tokenizer whose ``<unk>`` is special) never competes for a key's
trigger examples (`ffkv.batching.collate`). The manifest says how many positions that was and which
tokens: ``counts.excluded_positions`` and ``index.excluded_tokens`` ({token: positions}), read back from
the examples table once it is written (one pass, a row group at a time).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow.parquet as pq


def count(examples_path: Path, special_ids: Iterable[int]) -> Counter:
    """{token id: positions} of the special tokens in the examples table."""
    special = np.asarray(sorted(set(int(i) for i in special_ids)), dtype=np.int64)
    found: Counter = Counter()
    if not len(special):
        return found
    file = pq.ParquetFile(examples_path)
    for group in range(file.num_row_groups):
        column = file.read_row_group(group, columns=["token_ids"]).column(0).combine_chunks()
        values = np.asarray(column.values, dtype=np.int64)
        hits = values[np.isin(values, special)]
        ids, n = np.unique(hits, return_counts=True)
        found.update(dict(zip(ids.tolist(), n.tolist())))
    return found


def named(counts: Counter, tokenizer) -> dict[str, int]:
    """{token as the tokenizer spells it: positions}, most frequent first."""
    out: dict[str, int] = {}
    for token_id, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        try:
            name = tokenizer.token_strings([int(token_id)])[0].strip() or f"#{token_id}"
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot spell
            name = f"#{token_id}"
        out[name] = out.get(name, 0) + int(n)
    return out


def merged(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The sum of several runs' `named` counts (shards), most frequent first."""
    total: Counter = Counter()
    for part in parts:
        total.update(part or {})
    return dict(sorted(total.items(), key=lambda item: (-item[1], item[0])))


def sentence(manifest) -> str | None:
    """One line for the reader: how many positions were left out of ranking and which tokens, or None."""
    tokens = manifest.index.get("excluded_tokens") or {}
    n = int(manifest.counts.get("excluded_positions", 0))
    if not n:
        return None
    total = max(int(manifest.counts.get("tokens", 0)), 1)
    listed = ", ".join(f"{name} ({count:,})" for name, count in list(tokens.items())[:6])
    more = f" and {len(tokens) - 6} more" if len(tokens) > 6 else ""
    return (f"{n:,} positions ({n / total:.1%}) end in a special token and are left out of ranking: "
            f"{listed}{more}")
