"""The human side of docs/definitions.md: a sample of keys to label, as the paper's experts did, and the labels read back.

`export_sample` writes a CSV of seeded random keys per layer with their top prefixes; a person fills in a
``label`` per key; `import_labels` stores the labels in the run (`ffkv.store.annotations.Annotations`), where
`ffkv analyze --only patterns` compares them with the automatic ones.

The CSV names each key as everything a person reads does: a ``memory`` column ``LAYER:KEY`` with LAYER counted
from 1 (`ffkv.memories.address`). A CSV exported before this column existed names keys by ``layer`` and ``key``
columns counted from 0; it is still read, by those columns' own convention.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pandas as pd

from ffkv.errors import FfkvError
from ffkv.experiments.common import RunContext, open_run
from ffkv.memories.address import MemoryRef, quoted, whole_number
from ffkv.store import atomic, untrusted
from ffkv.store.annotations import LABELS, Annotations
from ffkv.store.run import RunDir

#: The most bytes a labelled CSV may have (an export of every key of a 10,000-key sample takes a few MB).
MAX_CSV_BYTES = 256 << 20
#: The CSV's columns, in order.
COLUMNS = ("memory", "rank", "prefix", "next_token", "coefficient", "example_id", "position", "label", "description")


def export_sample(run_dir: str | Path, out: str | Path, keys_per_layer: int = 10, top: int = 25,
                  seed: int = 0, loaded=None) -> Path:
    """Write a CSV for human annotation: `keys_per_layer` seeded random keys per layer, `top` prefixes each.

    One row per prefix (memory LAYER:KEY, rank, prefix, next token, coefficient) and an empty ``label`` column
    (shallow, semantic, both or none) to fill in on any row of the key, plus an optional ``description``.
    Automatic labels are left out so as not to prime.
    """
    run, manifest, loaded = open_run(run_dir, loaded)
    ctx = RunContext(run, manifest, loaded, progress=False, seed=seed)
    view = loaded.view
    rng = np.random.default_rng([seed, 7])
    trig = ctx.triggers()
    trig = trig[trig["rank"] < top]
    rows = []
    for layer in range(view.n_layers):
        chosen = np.sort(rng.choice(view.d_m, size=min(keys_per_layer, view.d_m), replace=False))
        sub = trig[(trig["layer"] == layer) & trig["key"].isin(chosen)]
        for t in sub.itertuples(index=False):
            rows.append({"memory": str(MemoryRef(layer, int(t.key))), "rank": int(t.rank),
                         "prefix": ctx.prefix_text(t.example_id, t.position), "next_token": ctx.token(t.next_token_id),
                         "coefficient": f"{t.coefficient:.4g}", "example_id": int(t.example_id),
                         "position": int(t.position), "label": "", "description": ""})
    out = Path(out)
    with atomic.atomic_path(out) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
            writer.writeheader()
            writer.writerows(rows)
    return out


def import_labels(run_dir: str | Path, path: str | Path, annotator: str = "") -> int:
    """Store the labels of a filled-in annotation CSV (`export_sample`); returns the number of keys labelled.

    Each key needs one label (shallow, semantic, both or none) on at least one of its rows; different labels for
    one key are an error. Keys without a label are skipped. Every row's memory is checked against the run.
    """
    path = Path(path)
    data = untrusted.read_bytes(path, MAX_CSV_BYTES, "an annotation CSV")
    shape = RunDir(run_dir).require_complete().model
    table = _read_csv(path, data)
    if "label" not in table.columns:
        raise FfkvError(f"annotation file {path} lacks a label column")
    table["layer"], table["key"] = _memories(table, path, shape.n_layers, shape.d_m)
    table["label"] = table["label"].str.strip().str.lower()
    labelled = table[table["label"] != ""]
    bad = sorted(set(labelled["label"]) - set(LABELS))
    if bad:
        raise FfkvError(f"unknown label {bad[0]!r} in {path}; use one of {', '.join(LABELS)}")
    rows = []
    for (layer, key), g in labelled.groupby(["layer", "key"]):
        labels = set(g["label"])
        if len(labels) > 1:
            raise FfkvError(f"memory {MemoryRef(int(layer), int(key))} has several labels in {path}: "
                            f"{', '.join(sorted(labels))}")
        description = next((d for d in g.get("description", []) if isinstance(d, str) and d.strip()), "")
        rows.append((int(layer), int(key), labels.pop(), description))
    with RunDir(run_dir).lock("annotate import"):
        Annotations(run_dir).save_many(rows, annotator)
    return len(rows)


def _read_csv(path: Path, data: bytes) -> pd.DataFrame:
    """A labelled CSV (`data`, the bytes of `path`) as text columns, or one line saying why it is not one."""
    try:
        return pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False, encoding="utf-8")
    except UnicodeDecodeError:
        raise FfkvError(f"annotation file {path} is not UTF-8 text: give the CSV of `ffkv annotate export`, "
                        "saved as CSV (UTF-8)") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as error:
        raise FfkvError(f"annotation file {path} is not a CSV table ({str(error).splitlines()[0]})") from None


def _memories(table: pd.DataFrame, path: Path, n_layers: int, d_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(layer from 0, key) of every row: from its ``memory`` (LAYER:KEY, layers from 1), or from the ``layer``
    and ``key`` columns of an older export (layers from 0); a row naming no memory of this run is refused."""
    if "memory" in table.columns:
        texts, legacy = table["memory"].tolist(), False
    elif {"layer", "key"} <= set(table.columns):  # exported before the memory column: layers from 0
        texts, legacy = [f"{str(a).strip()}:{str(b).strip()}" for a, b in zip(table["layer"], table["key"])], True
    else:
        raise FfkvError(f"annotation file {path} lacks a memory column (LAYER:KEY, layers from 1)")
    layers, keys = np.zeros(len(texts), dtype=np.int64), np.zeros(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        where = f"annotation file {path}, line {i + 2}"
        if not legacy:
            try:
                layers[i], keys[i] = MemoryRef.parse(text, n_layers, d_m)
            except FfkvError as error:
                raise FfkvError(f"{where}: memory {quoted(text)}: {error}") from None
            continue
        for j, (column, value, size) in enumerate((("layer", text.partition(":")[0], n_layers),
                                                   ("key", text.partition(":")[2], d_m))):
            digits = value.strip()
            try:  # a sign, then the digits every number a person writes is read in
                number = (-1 if digits[:1] == "-" else 1) * whole_number(digits.removeprefix("-"), column)
            except FfkvError:
                raise FfkvError(f"{where}: {column} {quoted(value)} is not an integer") from None
            if not 0 <= number < size:
                raise FfkvError(f"{where}: {column} {quoted(value)} is not a {column} of this run (0 to {size - 1}, "
                                "0-based as in an older export's layer and key columns)")
            (layers if j == 0 else keys)[i] = number
    return layers, keys
