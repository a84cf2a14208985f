"""What a run holds for the report: the tables and figures of `ffkv analyze`, in the paper's order.

Tables and figures are found through the run directory (`RunDir.metric_names`,
`RunDir.figure_names`) and paired by name; the paper's finding for a name and the
sentence on this model come from `ffkv.presentation.findings`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ffkv.presentation import findings

#: The experiments of `ffkv analyze`, in the paper's order (the report follows it).
ORDER = ("patterns", "ablations", "values", "composition", "refinement")


def order_key(name: str) -> tuple[int, str]:
    for i, experiment in enumerate(ORDER):
        if name.startswith(experiment):
            return i, name
    return len(ORDER), name


def _numeric_columns(table: pd.DataFrame) -> list[str]:
    skip = {"layer", "key", "rank", "seed", "n", "count", "example_id", "position", "token_id"}
    return [c for c in table.columns if c not in skip and pd.api.types.is_numeric_dtype(table[c])
            and not pd.api.types.is_bool_dtype(table[c])]


def reading(name: str, table: pd.DataFrame | None) -> str | None:
    """One sentence on how this model compares: the findings' own reading when they give one,
    else a plain description of the table's main column across the layers."""
    if table is None:
        return None
    text = findings.reading(name, table)
    if text:
        return text
    if table.empty:
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
