"""Human pattern labels of keys (docs/definitions.md, the human workflow), kept in the run directory; the labels of
a run's latents in a table of their own (``RUN/annotations/latent_labels.parquet``, the same schema, `key` the
latent: `Annotations(run, "latents")`), which the patterns study does not read.

Public contract: ``RUN/annotations/labels.parquet`` (`ffkv.store.schemas.LABELS`), one row
per (layer, key, annotator), the latest label wins; ``label`` is one of `LABELS`. Every
save rewrites the file atomically, so a reader never sees half a table. Labels arrive
from the explorer's annotate form (`Annotations.save`) and from a filled-in CSV
(`ffkv.tools.annotate.import_labels`); `consensus` gives one label per key for the agreement with the
automatic labels. A save holds ``RUN/annotations/.labels.lock`` (a file lock) while it
reads, merges and rewrites the table, so saves from several processes (two explorers,
an import) all land; an import also holds the run's writer lock (`RunDir.lock`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable

import filelock
import pandas as pd
import pyarrow as pa

from ffkv.errors import DamagedRun, FfkvError, one_line
from ffkv.store import atomic, integrity, ranges, schemas
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

#: The pattern labels of docs/definitions.md.
LABELS = ("shallow", "semantic", "both", "none")


#: What to do about a damaged labels table: only its annotators can write it again.
RESTORE = "restore it from a copy, or move it away to start the labels again"
#: Offending rows a damaged labels table's line names (then how many more).
NAMED_ROWS = 3


def read_labels(run_dir: str | Path, source: str = "neurons") -> pd.DataFrame:
    """All human labels of a run's neurons, or (`source` ``latents``) of its dictionary's latents (empty, with the
    columns, when there are none). A table that is not whole, lacks a column, or holds a row the run cannot have
    (`label_problem`) is refused with one line (`DamagedRun`) that names the file and its first offending rows."""
    run = RunDir(run_dir)
    if not run.labels_path(source).exists():
        return schemas.LABELS.empty_table().to_pandas()
    found, table = _checked(run, run.manifest() if run.exists() else None, source)
    if found is not None:
        raise DamagedRun(found.line(run.path))
    return table


def label_problem(run: RunDir, manifest: Manifest | None, source: str = "neurons") -> integrity.Problem | None:
    """What is wrong with RUN/annotations/labels.parquet (or latent_labels.parquet, `source` ``latents``), or None
    (also when there is none): not a whole Parquet file, a column of `schemas.LABELS` missing or of another type,
    or rows the run cannot have: a layer outside the run's layers, a key outside 0..d_m-1 (`manifest`'s model;
    for latents, the dictionary's layers and each one's latents; without a manifest, a negative layer or key), a
    label not among `LABELS`, no layer, key or annotator."""
    if not run.labels_path(source).exists():
        return None
    return _checked(run, manifest, source)[0]


def _checked(run: RunDir, manifest: Manifest | None,
             source: str = "neurons") -> tuple[integrity.Problem | None, pd.DataFrame | None]:
    """(`label_problem`'s answer, the table when it has none)."""
    path = run.labels_path(source)
    rel = path.relative_to(run.path).as_posix()
    found = integrity.problem(run.path, rel, None, RESTORE, schemas.LABELS)
    if found is not None:
        return found, None
    try:
        table = pd.read_parquet(path)
    except (pa.ArrowException, OSError) as error:
        return integrity.Problem(rel, "damaged", f"it cannot be read: {one_line(error)}", RESTORE), None
    bad = _offending_rows(table, manifest, source)
    if bad:
        more = f"; and {len(bad) - NAMED_ROWS} more" if len(bad) > NAMED_ROWS else ""
        why = (f"{len(bad)} of its {len(table)} rows hold what this run cannot have (rows counted from 1): "
               + "; ".join(bad[:NAMED_ROWS]) + more)
        return integrity.Problem(rel, "damaged", why, RESTORE), None
    return None, table


def _offending_rows(table: pd.DataFrame, manifest: Manifest | None, source: str = "neurons") -> list[str]:
    """Each row of a labels table (of `source`'s memories) that the run cannot hold, as "row N: what" (N from 1)."""
    checks = _row_checks(manifest, source)
    out = []
    for row, record in enumerate(table[[c for c, _, _ in checks]].to_dict("records"), start=1):
        wrong = [f"{column} {_shown(record[column])!r} ({why(record) if callable(why) else why})"
                 for column, ok, why in checks if not ok(record)]
        if wrong:
            out.append(f"row {row}: " + ", ".join(wrong))
    return out


def _shown(value):
    return value if isinstance(value, str) or pd.isna(value) else int(value)


def _row_checks(manifest: Manifest | None, source: str) -> list[tuple[str, Callable, str | Callable]]:
    """What a row of a labels table must hold, per column: (column, ok(row), why or why(row)). The neurons': a layer
    among the run's, a key below d_m; the latents': a layer with a dictionary, a key below its number of latents
    (judged where the layer is one); both: a known label, an annotator."""
    if source == "neurons":
        n_layers = manifest.model.n_layers if manifest is not None else None
        d_m = manifest.model.d_m if manifest is not None else None
        layers = f"this run's layers are 0 to {n_layers - 1}, 0-based" if n_layers else "layers count from 0"
        keys = f"this run's keys are 0 to {d_m - 1}" if d_m else "keys count from 0"
        where = [("layer", lambda r: not pd.isna(r["layer"]) and 0 <= r["layer"] < (n_layers or float("inf")), layers),
                 ("key", lambda r: not pd.isna(r["key"]) and 0 <= r["key"] < (d_m or float("inf")), keys)]
    else:
        sizes = ranges.sizes(manifest, "latent_trigger_examples.parquet") if manifest is not None else None

        def has_layer(r) -> bool:
            return not pd.isna(r["layer"]) and r["layer"] >= 0 and (sizes is None or int(r["layer"]) in sizes)

        where = [("layer", has_layer, f"the run's dictionaries sit at layers "
                                      f"{', '.join(map(str, sorted(sizes or {}))) or 'none'}, 0-based"),
                 ("key", lambda r: not has_layer(r) or (not pd.isna(r["key"]) and 0 <= r["key"] < (
                     sizes[int(r["layer"])] if sizes is not None else float("inf"))),
                  lambda r: f"that layer's latents are 0 to {sizes[int(r['layer'])] - 1}" if sizes is not None
                  else "that layer's latents are from 0")]
    return [*where, ("label", lambda r: r["label"] in LABELS, f"labels are {', '.join(LABELS)}"),
            ("annotator", lambda r: isinstance(r["annotator"], str), "every label names its annotator")]


def consensus(labels: pd.DataFrame) -> pd.DataFrame:
    """One human label per key: each annotator's latest, then the most common (ties: alphabetical).

    Returns columns layer, key, human_label.
    """
    if labels.empty:
        return pd.DataFrame({"layer": pd.Series(dtype="int64"), "key": pd.Series(dtype="int64"),
                             "human_label": pd.Series(dtype="object")})
    latest = labels.sort_values("time").groupby(["layer", "key", "annotator"]).tail(1)
    return (latest.groupby(["layer", "key"])["label"]
            .agg(lambda s: sorted(s.value_counts().loc[lambda c: c == c.max()].index)[0])
            .rename("human_label").reset_index())


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


#: Seconds a save waits for another process's save to finish.
SAVE_WAIT_SECONDS = 30.0


class Annotations:
    """Read and save the labels of one run's neurons, or (`source` ``latents``) of its dictionary's latents; saves
    from several threads and processes are serialised."""

    def __init__(self, run_dir: str | Path, source: str = "neurons") -> None:
        self.run_dir = Path(run_dir)
        self.source = source
        self.path = RunDir(run_dir).labels_path(source)

    def _lock(self) -> filelock.FileLock:
        """Hold the lock of every save (a new descriptor each time: threads exclude each other too)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(self.path.parent / ".labels.lock", timeout=SAVE_WAIT_SECONDS,
                                 fallback_to_soft=False)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise FfkvError(f"another process has been saving labels in {self.path.parent} for "
                            f"{SAVE_WAIT_SECONDS:.0f} s; try again") from None
        return lock

    def all(self) -> pd.DataFrame:
        return read_labels(self.run_dir, self.source)

    def of(self, layer: int, key: int) -> list[dict]:
        """The labels of one key, newest first."""
        table = self.all()
        rows = table[(table.layer == layer) & (table.key == key)].sort_values("time", ascending=False)
        return rows.to_dict("records")

    def save(self, layer: int, key: int, label: str, description: str = "", annotator: str = "") -> dict:
        """Store a label; a second label by the same annotator for the same key replaces the first."""
        return self.save_many([(layer, key, label, description)], annotator)[0]

    def save_many(self, labels: Iterable[tuple[int, int, str, str]], annotator: str = "") -> list[dict]:
        """Store (layer, key, label, description) rows by one annotator in one atomic rewrite."""
        stamp = _now()
        rows = []
        for layer, key, label, description in labels:
            if label not in LABELS:
                raise FfkvError(f"unknown label {label!r}; use one of {', '.join(LABELS)}")
            rows.append({"layer": int(layer), "key": int(key), "label": label, "description": description or "",
                         "annotator": annotator or "anonymous", "time": stamp})
        if not rows:
            return rows
        new = pd.DataFrame(rows)
        lock = self._lock()
        try:
            atomic.clean_stale(self.path.parent, self.path.name)  # left by a killed save
            table = self.all()
            replaced = table.set_index(["layer", "key", "annotator"]).index.isin(
                new.set_index(["layer", "key", "annotator"]).index)
            table = pd.concat([table[~replaced], new], ignore_index=True)
            table = table.sort_values(["layer", "key", "annotator"], kind="stable")
            atomic.write_parquet(self.path, pa.Table.from_pandas(table, schema=schemas.LABELS, preserve_index=False))
        finally:
            lock.release()
        return rows


__all__ = ["LABELS", "Annotations", "consensus", "label_problem", "read_labels"]
