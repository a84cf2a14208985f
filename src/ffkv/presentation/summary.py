"""A run described for a reader, for the report's and the explorer's overview: the run in a few rows, the
numbering of layers, and the table of the paper's findings that this model reproduces (or not)."""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from ffkv.presentation.tables import TableView, table_view
from ffkv.store.manifest import Manifest

#: Said once wherever layers are shown (the report, the explorer's overview, docs/run-directory.md).
NUMBERING = ("Layers are counted from 1, as in the paper: layer 1 is the first block. The run's Parquet tables, "
             "its JSON exports and the notebook API count layers from 0 (layer 1 here is layer 0 there); "
             "keys are the 0-based memory index i everywhere.")


def manifest_summary(manifest: Manifest) -> list[tuple[str, str]]:
    """(field, value) rows describing a run: model, corpus, options, timings, counts."""
    model = manifest.model
    rows = [("model", f"{model.id} ({model.family}, {model.dtype})"),
            ("shape", f"{model.n_layers} layers x {model.d_m:,} memories, d_model {model.d_model:,}, "
                      f"vocabulary {model.vocab_size:,}"),
            ("residual", model.resid_mid),
            ("corpus", ", ".join(f"{k}={v}" for k, v in manifest.corpus.items() if v is not None)),
            ("index", ", ".join(f"{k}={v}" for k, v in manifest.index.items() if k not in ("batching", "dictionary"))),
            *([("dictionary", dictionary_summary(manifest.index["dictionary"]))]
              if manifest.index.get("dictionary") else []),
            ("counts", ", ".join(f"{k}: {v:,}" if isinstance(v, int) else f"{k}: {v}"
                                 for k, v in manifest.counts.items())),
            ("timings", ", ".join(f"{k}: {v:.1f} s" if isinstance(v, (int, float)) else f"{k}: {v}"
                                  for k, v in manifest.timings.items())),
            ("status", f"{manifest.status} (updated {manifest.updated or '?'})")]
    return rows


def dictionary_summary(recorded: Mapping[str, Mapping]) -> str:
    """The sparse dictionary a run was indexed with, one clause per layer, layers from 1 as readers count them:
    "transcoder at layer 4: 512 latents, topk k=16 (PATH)"."""
    def clause(layer: str, d: Mapping) -> str:
        k = f" k={d['k']}" if d.get("k") else ""
        return (f"{d.get('kind', '?')} at layer {int(layer) + 1}: {int(d.get('n_latents', 0)):,} latents, "
                f"{d.get('activation', '?')}{k} ({d.get('path', 'built in memory')})")
    return "; ".join(clause(layer, d) for layer, d in sorted(recorded.items(), key=lambda item: int(item[0])))


#: Columns of a fidelity row that come from the table it reads: not shown when that table cannot be read.
MEASURED_COLUMNS = ("measured", "chance", "n", "reproduces")


def fidelity_view(table: pd.DataFrame, unreadable: Mapping[str, str] | None = None) -> TableView:
    """metrics/fidelity.parquet (one row per paper finding: finding, figure, this model's value, whether it
    reproduces, the rule) as a table to read: whatever its columns, booleans as yes / no; the verdict column says
    yes, no, or why there is none (the reproduces column, which says the same, is left out beside it).

    Args:
        unreadable: metrics table name (the rows' ``table``) -> why it cannot be trusted now, as one line naming
            the file and the command that rewrites it (`ffkv.store.integrity.Problem.line`). A row read from such
            a table keeps its finding and rule, but its numbers and verdict are not shown: its verdict cell says
            ``not shown: LINE``.
    """
    if unreadable and "table" in table.columns:
        hit = table["table"].isin(list(unreadable))
        if hit.any():
            table = table.copy()
            for column in [c for c in MEASURED_COLUMNS if c in table.columns]:
                table[column] = table[column].astype(object).where(~hit, None)
            notes = table.loc[hit, "table"].map(lambda name: f"not shown: {unreadable[name]}")
            table["verdict"] = table["verdict"].astype(object) if "verdict" in table.columns else None
            table.loc[hit, "verdict"] = notes
    if "reproduces" in table.columns and "verdict" in table.columns:  # the verdict cell says it, and why not
        table = table.drop(columns="reproduces")
    elif "reproduces" in table.columns:
        table = table.assign(reproduces=pd.Series([bool(v) if v is not None and not pd.isna(v) else "no verdict"
                                                   for v in table["reproduces"]], index=table.index, dtype=object))
    return table_view(table)


def massive_view(table: pd.DataFrame) -> TableView | None:
    """metrics/composition_massive.parquet summarised per layer (layers from 1): how many analysed positions carry a
    massive activation, at which positions and tokens, the largest |m_i| and RMS over the median position's; None
    when no layer has one."""
    if table is None or table.empty:
        return None
    rows = []
    for layer, g in table.groupby("layer", sort=True):
        tokens = g["token"].value_counts()
        rows.append({"layer": int(layer), "positions": len(g),
                     "at position": ", ".join(str(p) for p in sorted(g["position"].unique())[:5]),
                     "tokens": ", ".join(f"{t!r} ×{n}" for t, n in tokens.head(3).items()),
                     "largest |m|": float(g["max_abs"].max()), "RMS / median": float(g["times_median"].max())})
    return table_view(pd.DataFrame(rows))
