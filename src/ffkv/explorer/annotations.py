"""Human pattern labels of keys (SPEC section 4, the human workflow), kept in the run directory.

Public contract: ``RUN/annotations/labels.parquet``, one row per (layer, key, annotator), the
latest label wins; columns ``layer`` int16, ``key`` int32, ``label`` string (shallow, semantic,
both, none), ``description`` string, ``annotator`` string, ``time`` string (ISO 8601, UTC).
Every save rewrites the file atomically, so a reader never sees half a table.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa

from ffkv.store import atomic

SCHEMA = pa.schema([
    ("layer", pa.int16()),
    ("key", pa.int32()),
    ("label", pa.string()),
    ("description", pa.string()),
    ("annotator", pa.string()),
    ("time", pa.string()),
])


def labels_path(run_dir: str | Path) -> Path:
    """Where a run keeps its human labels."""
    return Path(run_dir) / "annotations" / "labels.parquet"


def read_labels(run_dir: str | Path) -> pd.DataFrame:
    """All human labels of a run (empty, with the columns, when there are none)."""
    path = labels_path(run_dir)
    if not path.exists():
        return SCHEMA.empty_table().to_pandas()
    return pd.read_parquet(path)


class Annotations:
    """Read and save the labels of one run; saves from several threads are serialised."""

    _lock = threading.Lock()

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = labels_path(run_dir)

    def all(self) -> pd.DataFrame:
        return read_labels(self.run_dir)

    def of(self, layer: int, key: int) -> list[dict]:
        table = self.all()
        rows = table[(table.layer == layer) & (table.key == key)].sort_values("time", ascending=False)
        return rows.to_dict("records")

    def save(self, layer: int, key: int, label: str, description: str = "", annotator: str = "") -> dict:
        """Store a label; a second label by the same annotator for the same key replaces the first."""
        row = {"layer": layer, "key": key, "label": label, "description": description,
               "annotator": annotator or "anonymous", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with self._lock:
            table = self.all()
            same = (table.layer == layer) & (table.key == key) & (table.annotator == row["annotator"])
            table = pd.concat([table[~same], pd.DataFrame([row])], ignore_index=True)
            table = table.sort_values(["layer", "key", "annotator"], kind="stable")
            atomic.write_parquet(self.path, pa.Table.from_pandas(table, schema=SCHEMA, preserve_index=False))
        return row
