"""The overview's "Latents beside neurons": what `ffkv analyze` wrote in metrics/latents_beside and
metrics/latents_beside_dictionary (`ffkv.experiments.latents_beside`), per dictionary layer, for a reader.

Each table is checked when read: its record (`ffkv.store.run.RunDir.read_metric`), then its columns by kind
against the study's own schema (`latents_beside.SCHEMA`, `FIDELITY_SCHEMA`), then its layers against the run's
dictionaries. A table that fails is named as damaged with the command that rewrites it; none is shown in part.
The labels, verdicts and rule are the table's own words, never recomputed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ffkv.errors import DamagedRun, FfkvError
from ffkv.experiments import latents_beside as study
from ffkv.experiments.registry import experiments
from ffkv.presentation.style import number, percent
from ffkv.store import integrity

if TYPE_CHECKING:  # pragma: no cover
    from ffkv.explorer.data import ExplorerData

TABLE, FIDELITY = study.NAME, f"{study.NAME}_dictionary"
#: The forest figure `latents_beside.draw` saves (RUN/figures/latents_beside.png), shown in the section.
FIGURE = study.NAME


def points(value) -> str:
    """A difference of two shares in percentage points, signed (+1.9, −0.2; 0.0 unsigned), "—" for none."""
    if value is None or not math.isfinite(float(value)):
        return "—"
    p = 100 * float(value)
    text = f"{abs(p):.2g}" if p != 0 and abs(p) < 0.05 else f"{abs(p):.1f}"
    zero = not text.strip("0.")
    return text if zero else ("−" if p < 0 else "+") + text


def share(value) -> str:
    """A share as the overview writes it (`percent`, one decimal), "—" for none."""
    return "—" if value is None or not math.isfinite(float(value)) else percent(value, 1)


def mean(value) -> str:
    """A mean that is not a share (the explanation score, a correlation), three decimals, "—" for none."""
    return "—" if value is None or not math.isfinite(float(value)) else f"{float(value):.3f}"


def signed(value) -> str:
    """A difference of two means (not shares), signed, three decimals, "—" for none."""
    if value is None or not math.isfinite(float(value)):
        return "—"
    text = f"{abs(float(value)):.3f}"
    return text if not text.strip("0.") else ("−" if value < 0 else "+") + text


def count(value) -> str:
    """A count (stored as a number, NaN where the study had none), "—" for none."""
    return "—" if value is None or not math.isfinite(float(value)) else f"{int(value):,}"


@dataclass
class LayerBeside:
    """One dictionary layer's part of the section: its rows (in the table's order) and its fidelity (None where
    the fidelity table has no row for it)."""

    layer: int
    name: str
    kind: str
    rows: list[dict] = field(default_factory=list)
    fidelity: dict | None = None


@dataclass
class Beside:
    """The section of a run indexed with a dictionary. Exactly one of: `damaged` (one line per damaged table),
    `missing` (not computed, or computed before any latent study: the command that computes it), or `layers`."""

    layers: list[LayerBeside] = field(default_factory=list)
    rule: str = ""
    damaged: list[str] = field(default_factory=list)
    missing: str = ""


def _kind(kind: pa.DataType) -> str:
    if pa.types.is_integer(kind):
        return "whole numbers"
    if pa.types.is_floating(kind):
        return "numbers"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "text"
    return str(kind)


def column_problem(found: pa.Schema, expected: pa.Schema, rows: int) -> str | None:
    """What is wrong with a table's columns against `expected`, compared by kind (whole numbers where it has whole
    numbers; numbers, whole or not, where it has numbers; text where it has text), or None. A table without rows
    may have columns of nulls."""
    lacking, other = [], []
    for f in expected:
        if f.name not in found.names:
            lacking.append(f.name)
            continue
        have, want = found.field(f.name).type, f.type
        fits = (pa.types.is_null(have) and rows == 0) or _kind(have) == _kind(want) or (
            _kind(want) == "numbers" and _kind(have) == "whole numbers")
        if not fits:
            other.append(f"{f.name} holds {_kind(have)}, not {_kind(want)}")
    parts = ([f"it lacks the column(s) {', '.join(lacking)}"] if lacking else []) + other
    return "; ".join(parts) or None


def _read(data: "ExplorerData", name: str, schema: pa.Schema, layers: list[int]) -> tuple[pd.DataFrame | None, str]:
    """metrics/NAME checked (the module's docstring): (table, "") or (None, the line naming it as damaged)."""
    run, rel = data.run, f"metrics/{name}.parquet"
    try:
        table = run.read_metric(name)
        found = pq.read_schema(run.metric_path(name))
    except DamagedRun as error:
        return None, str(error)
    why = column_problem(found, schema, len(table))
    if why is None:
        table = table[schema.names]
        strangers = sorted({int(layer) for layer in table["layer"]} - set(layers))
        if strangers:
            why = (f"it has rows of layer {', '.join(str(s + 1) for s in strangers)}, which has no dictionary in "
                   "this run")
        elif table.duplicated([c for c in ("layer", "measure") if c in schema.names]).any():
            why = "it repeats a row (the same layer" + (" and measure)" if "measure" in schema.names else ")")
        elif any(table[f.name].map(lambda v: not isinstance(v, str)).any() for f in schema if _kind(f.type) == "text"):
            why = "a text column has an empty cell"
    if why is None:
        return table, ""
    fix = integrity.rewrite_command(run.path, rel, integrity.step_of(run.manifest(), rel))
    return None, integrity.Problem(rel, "damaged", why, fix).line(run.path)


def missing_command(data: "ExplorerData") -> str:
    """The `ffkv analyze` call that computes the table: latents_beside after the latent studies the run lacks (those
    `ffkv analyze` computes by itself; a measure that needs another command first is not named)."""
    lacking = []
    for measure in study.MEASURES:
        name = measure.table.removesuffix("_latents")
        if not measure.first and not data.run.has_metric(measure.table) and name not in lacking:
            lacking.append(name)
    return f"ffkv analyze {data.run.path} --only {','.join([*lacking, study.NAME])}"


def _link(study_table: str) -> str:
    """The report's section of the study that wrote a row (its anchor), or "" for a name no study has."""
    name = study_table.removesuffix("_latents")
    return f"#analysis-{name}" if name in experiments() else ""


def beside_of(data: "ExplorerData") -> Beside | None:
    """The section for the overview of `data`: None for a run indexed without a dictionary."""
    latents = data.latents
    if latents is None:
        return None
    if not data.run.has_metric(TABLE):
        return Beside(missing=missing_command(data))
    layers = latents.layers
    table, damaged = _read(data, TABLE, study.SCHEMA, layers)
    fidelity, damaged_fidelity = (_read(data, FIDELITY, study.FIDELITY_SCHEMA, layers) if data.run.has_metric(FIDELITY)
                                  else (None, ""))
    if damaged or damaged_fidelity:
        return Beside(damaged=[line for line in (damaged, damaged_fidelity) if line])
    if table.empty:
        return Beside(missing=missing_command(data))
    try:
        rule = str(data.run.metric_description(TABLE).get("rule") or "")
    except FfkvError:
        rule = ""
    out = Beside(rule=rule)
    shares = {m.column: m.share for m in study.MEASURES}
    by_layer = {int(r["layer"]): r for r in fidelity.to_dict("records")} if fidelity is not None else {}
    for layer in layers:
        mine = table[table["layer"] == layer]
        if mine.empty and layer not in by_layer:
            continue
        part = LayerBeside(layer, latents.name(layer), latents.kind(layer), fidelity=by_layer.get(layer))
        for r in mine.to_dict("records"):
            verdict = r["verdict"]
            # shares as percentages and their differences in points; a mean (the explanation score) as it is
            value, gap = (share, points) if shares.get(r["measure"], True) else (mean, signed)
            part.rows.append({
                "measure": r["measure"], "label": r["label"], "link": _link(r["study"]), "study": r["study"],
                **{kind: {"share": value(r[kind]), "low": value(r[f"{kind}_ci_low"]),
                          "high": value(r[f"{kind}_ci_high"]), "n": count(r[f"n_{kind}"]),
                          "null": value(r[f"{kind}_null"])} for kind in ("latents", "neurons")},
                "difference": gap(r["difference"]), "difference_low": gap(r["difference_ci_low"]),
                "difference_high": gap(r["difference_ci_high"]), "difference_means": r["difference_means"],
                "verdict": verdict,
                # the verdict's colour is the forest figure's (`latents_beside.draw`): its words are the table's
                "side": "latents" if verdict.startswith("latents") else "neurons" if verdict.startswith("neurons")
                else "none"})
        if part.fidelity is not None:
            f = part.fidelity
            part.fidelity = {"fvu": number(f["fvu"], 3) or "—", "dead": count(f["dead_latents"]),
                             "latents": count(f["n_latents"]), "dead_share": share(f["dead_share"]),
                             "loss_recovered": number(f["loss_recovered"], 3) or "—",
                             **{c: number(f[c], 4) or "—" for c in ("loss_original", "loss_spliced",
                                                                     "loss_mean_ablated")},
                             "tokens": count(f["eval_tokens"])}
        out.layers.append(part)
    return out
