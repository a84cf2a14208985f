"""What a run holds for the report: the tables and figures of `ffkv analyze`, and the paper's findings.

Nothing here knows the experiments' schemas: tables and figures are found by globbing
``RUN/metrics/*.parquet`` and ``RUN/figures/*.{png,svg}``, and paired by name. The paper's
finding for a name comes from `ffkv.experiments.findings` when that module exists (its
``PAPER_FINDINGS``, and its ``reading(name, table)`` for the sentence on this model),
else from the SPEC summaries below.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

#: The experiments of `ffkv analyze`, in the paper's order (the report follows it).
ORDER = ("patterns", "ablations", "values", "composition", "refinement")

#: SPEC's statement of each finding, used when `ffkv.experiments.findings` has none for a name.
#: (words that must all appear in the name, paper figure, finding)
SPEC_FINDINGS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("pattern",), "Figure 2", "Almost every key has a few clear patterns that cover most of its top trigger "
     "examples; lower layers hold mostly shallow patterns, upper layers mostly semantic ones."),
    (("ablation",), "Figure 3", "Removing the last token of a trigger prefix lowers the key's coefficient most, "
     "less so in upper layers; removing the first or a random token matters less."),
    (("confident",), "Table 2", "Of the 100 most confident values, almost half have a top trigger example whose "
     "next token is the value's top token."),
    (("rank",), "Figure 5", "The rank of the top trigger example's next token in the value's distribution "
     "improves (gets lower) through the layers."),
    (("value",), "Figure 4", "Agreement between a value's top token and its top trigger example's next token is "
     "near zero in layers 1-10 and rises to about 3.5% by layer 16, far above chance (1/|V|)."),
    (("active",), "Figure 7", "Hundreds of the 4,096 memories of a layer are active (m > 0) at once, with a drop "
     "around layer 10."),
    (("composition",), "Figure 8", "In at least ~68% of examples in every layer, the FF layer's top prediction "
     "differs from that of every active memory; the matching cases are mostly stop words."),
    (("confidence",), "Figure 10", "The probability the residual gives to the model's final prediction rises "
     "through the layers."),
    (("refinement", "agreement"), "Figure 9", "About a third of the residual's top predictions already equal the "
     "final prediction in the bottom layers, rising quickly from layer 10."),
    (("last",), "Table 3", "Examples where the last layer changes the prediction, for reading."),
    (("refinement",), "Figure 11", "The FF layer mostly keeps the residual's prediction; when it changes it, "
     "rarely to the FF layer's own top prediction (a compromise)."),
)


def discover_metrics(run_dir: str | Path) -> dict[str, Path]:
    """NAME -> RUN/metrics/NAME.parquet."""
    return {p.stem: p for p in sorted(Path(run_dir, "metrics").glob("*.parquet"))}


def discover_figures(run_dir: str | Path) -> dict[str, Path]:
    """NAME -> RUN/figures/NAME.png (or .svg when there is no PNG)."""
    out: dict[str, Path] = {}
    folder = Path(run_dir, "figures")
    for path in sorted(folder.glob("*.svg")) + sorted(folder.glob("*.png")):
        out[path.stem] = path  # a PNG replaces the SVG of the same name
    return dict(sorted(out.items(), key=lambda kv: order_key(kv[0])))


def order_key(name: str) -> tuple[int, str]:
    for i, experiment in enumerate(ORDER):
        if name.startswith(experiment):
            return i, name
    return len(ORDER), name


def _findings_module():
    try:
        return importlib.import_module("ffkv.experiments.findings")
    except Exception:  # noqa: BLE001 - absent or broken: the SPEC summaries stand in
        return None


def _normalise(entry: Any) -> dict | None:
    if entry is None:
        return None
    if isinstance(entry, str):
        return {"finding": entry, "figure": None}
    if isinstance(entry, dict):
        text = next((entry[k] for k in ("finding", "paper", "text", "summary", "claim") if entry.get(k)), None)
        figure = next((entry[k] for k in ("figure", "paper_figure", "title", "label") if entry.get(k)), None)
        return {"finding": str(text) if text else None, "figure": str(figure) if figure else None} if text else None
    text = next((getattr(entry, k) for k in ("finding", "paper", "text", "summary") if getattr(entry, k, None)), None)
    figure = next((getattr(entry, k) for k in ("figure", "paper_figure", "title") if getattr(entry, k, None)), None)
    return {"finding": str(text), "figure": str(figure) if figure else None} if text else None


def paper_finding(name: str) -> dict | None:
    """{"figure": "Figure 4", "finding": "..."} for a figure or table name, or None."""
    module = _findings_module()
    table = getattr(module, "PAPER_FINDINGS", None) if module is not None else None
    if isinstance(table, dict) and table:
        if name in table:
            found = _normalise(table[name])
            if found:
                return found
        # The longest key that the name starts with (e.g. values_agreement -> values).
        for key in sorted(table, key=lambda k: -len(str(k))):
            if name.startswith(str(key)) or str(key).startswith(name):
                found = _normalise(table[key])
                if found:
                    return found
    lowered = name.lower()
    for words, figure, finding in SPEC_FINDINGS:
        if all(w in lowered for w in words):
            return {"figure": figure, "finding": finding, "source": "SPEC"}
    return None


def _numeric_columns(table: pd.DataFrame) -> list[str]:
    skip = {"layer", "key", "rank", "seed", "n", "count", "example_id", "position", "token_id"}
    return [c for c in table.columns if c not in skip and pd.api.types.is_numeric_dtype(table[c])
            and not pd.api.types.is_bool_dtype(table[c])]


def reading(name: str, table: pd.DataFrame | None) -> str | None:
    """One sentence on how this model compares: the experiments' own reading when they give one,
    else a plain description of the table's main column across the layers."""
    module = _findings_module()
    for attr in ("reading", "model_reading", "compare"):
        fn = getattr(module, attr, None) if module is not None else None
        if callable(fn) and table is not None:
            try:
                text = fn(name, table)
            except Exception:  # noqa: BLE001 - a reading is a nicety; the table is still shown
                text = None
            if text:
                return str(text)
    if table is None or table.empty:
        return None
    columns = _numeric_columns(table)
    if not columns:
        return f"This model: {len(table):,} rows (see the table)."
    column = columns[0]
    if "layer" in table.columns and table["layer"].nunique() > 1:
        per_layer = table.groupby("layer")[column].mean()
        first, last = per_layer.index[0], per_layer.index[-1]
        peak = per_layer.idxmax()
        return (f"In this model, {column} goes from {per_layer.iloc[0]:.3g} at layer {first} to "
                f"{per_layer.iloc[-1]:.3g} at layer {last} (highest, {per_layer.max():.3g}, at layer {peak}).")
    values = table[column].to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    return f"In this model, {column} averages {values.mean():.3g} over {len(values):,} rows."
