"""What a run holds for the report, arranged for a reader: one section per experiment, in the paper's order.

Tables and figures are found through the run directory (`RunDir.metric_names`, `figure_names`)
and grouped by the experiment whose name they start with; the experiments, their titles, findings,
reading sentences and tables for reading are the registry's (`ffkv.experiments.registry`). A section
shows its figures beside the paper's finding, the sentence on this model that its experiment gives
(none when it gives none: a sentence is never made up from an arbitrary column), how the numbers were
computed (projection, n), the warnings of its tables, its per-layer tables in full, a few rows of the
tables meant for reading (the paper's Tables 2 and 3, the matched tokens), and the names of its larger
tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from ffkv.experiments import encoders, latent_kinds, registry
from ffkv.presentation.tables import TableView, table_view
from ffkv.store.integrity import Problem
from ffkv.store.run import RunDir

#: Most rows of a per-layer table shown (the rest are in the Parquet file).
MAX_LAYER_ROWS = 64
#: Description fields that say how a table was computed, shown with each section (others are in the file; an
#: experiment adds its own with `Experiment.how`).
HOW_FIELDS = ("projection", "projection_choice", "residual_projection", "ff_out_projection",
              "resid_post_variant_projection", "other_projection", "projection_difference", "target", "active",
              "memory_prediction", "n_examples", "interval", "keys_per_layer", "top_t", "vocab_size", "rank",
              "relative_change", "labels", "embedding", "calibration", "final_prediction",
              "positions", "thresholds", "sign", "value_type_null_rate", "suppressed", "delta_p", "statistic", "rule",
              "splits", "n_tokens", "removal", "perplexity", "census", "translator", "changes_under_translator",
              "chance", "control", "massive_factor")
#: Tables the report shows apart, above the sections (metrics/fidelity.parquet: does this model reproduce the paper).
SHOWN_APART = ("fidelity",)
#: Columns left out of the rows shown (identifiers that mean nothing out of context).
HIDDEN = ("example_id", "position", "removed_index", "trigger_example_ids", "trigger_positions")


def titles() -> dict[str, str]:
    """Section name -> title, in the paper's order: the registered experiments (`ffkv.experiments.registry`),
    then the applicability tables `ffkv analyze` writes for a masked-LM encoder and for a run with latents."""
    return {**{name: e.title for name, e in registry.experiments().items()},
            "encoder_applicability": encoders.TITLE, "latent_applicability": latent_kinds.TITLE}


def reading_rows() -> dict[str, int]:
    """Tables meant to be read row by row -> rows shown in the report (each experiment's `reading_rows`)."""
    rows = {name: n for e in registry.experiments().values() for name, n in e.reading_rows.items()}
    return {**rows, "encoder_applicability": encoders.READING_ROWS, "latent_applicability": latent_kinds.READING_ROWS}


def order_key(name: str, order: Sequence[str] | None = None) -> tuple[int, str]:
    order = tuple(order if order is not None else titles())
    group = registry.experiment_of(name, order)
    return (order.index(group) if group in order else len(order)), name


#: What a table of no rows says when its study did not record why (`EMPTY_BECAUSE` in its description).
EMPTY_UNEXPLAINED = "nothing to show for this model and corpus (its study recorded no reason)"
#: The description field in which a study says why a table it wrote holds no rows.
EMPTY_BECAUSE = "empty_because"


def empty_reason(description: dict) -> str:
    """Why a metrics table holds no rows, as its study recorded it (`EMPTY_BECAUSE`)."""
    reason = str(description.get(EMPTY_BECAUSE) or EMPTY_UNEXPLAINED)
    return reason if reason.endswith(".") else reason + "."


def is_per_layer(table: pd.DataFrame) -> bool:
    return "layer" in table.columns and table["layer"].is_unique and "key" not in table.columns


@dataclass
class Figure:
    name: str
    path: Path
    finding: str | None
    paper_figure: str | None
    reading: str | None


@dataclass
class Table:
    name: str
    rows: int
    view: TableView | None
    note: str
    finding: str | None = None       # the paper's finding for a table with no figure of its own (Tables 2, 3)
    paper_figure: str | None = None


@dataclass
class Section:
    name: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    reading: str | None = None
    finding: str | None = None
    paper_figure: str | None = None
    how: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    listed: list[tuple[str, int]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # tables and figures not computed, each with its command
    skipped: str | None = None  # why `ffkv analyze` skipped this study (the manifest's analyses[name]["skipped"])
    documented: bool = True  # its tables are described in docs/run-directory.md (ffkv's own; not a plugin's)


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
    return str(value)


def _reading(name: str, table: pd.DataFrame | None) -> str | None:
    if table is None or table.empty:
        return None
    return registry.reading(name, table)


def build_sections(run: RunDir, problems: Sequence[Problem] = (), skipped: Mapping[str, str] | None = None
                   ) -> list[Section]:
    """The report's sections: one per experiment (then one per table or figure of no known experiment).

    `problems` (`ffkv.store.integrity.survey`) mark their sections: a table or figure that is missing as not
    computed, with the command that writes it; a table out of date with a warning. `skipped` (study -> the
    one-line reason `ffkv analyze` recorded) gives each skipped study a section that says so.
    """
    metrics, figures = set(run.metric_names()) - set(SHOWN_APART), run.figure_names()
    title, order, rows_shown = titles(), tuple(titles()), reading_rows()
    marks = [p for p in problems if p.path.startswith(("metrics/", "figures/")) and p.state in ("missing", "out of date")]
    names = sorted(metrics | set(figures) | {Path(p.path).stem for p in marks}, key=lambda n: order_key(n, order))
    sections: dict[str, Section] = {}
    for name in names:
        group = registry.experiment_of(name, order)
        section = sections.setdefault(group, Section(group, title.get(group, group.replace("_", " ")),
                                                     documented=group in registry.builtin()))
        for mark in (p for p in marks if Path(p.path).stem == name):
            if mark.state == "missing":
                section.missing.append(f"not computed: {mark.path} is missing; {mark.fix}")
            else:
                section.warnings.append(f"{mark.path} is {mark.state} ({mark.why}): {mark.fix}")
        table = None
        if name in metrics:
            table = run.read_metric(name)  # a damaged table is refused with one line (`ffkv.errors.DamagedRun`)
            description = run.metric_description(name)
            section.warnings += [str(w) for w in description.get("warnings", []) or []]
            if name == group:
                own = registry.experiments().get(group)
                fields = HOW_FIELDS + (own.how if own is not None else ())
                section.how = [(k.replace("_", " "), _text(description[k])) for k in dict.fromkeys(fields)
                               if k in description]
                finding = registry.paper_finding(name) or {}
                section.finding, section.paper_figure = finding.get("finding"), finding.get("figure")
                section.reading = _reading(name, table)
            own = registry.paper_finding(name) or {} if name != group and name not in figures else {}
            if table.empty:  # never a bare header row: the table says why it holds nothing
                section.tables.append(Table(name, 0, None, f"No rows: {empty_reason(description)}",
                                            own.get("finding"), own.get("figure")))
            elif is_per_layer(table):
                shown = table.head(MAX_LAYER_ROWS)
                note = "" if len(table) <= MAX_LAYER_ROWS else f"First {MAX_LAYER_ROWS} of {len(table):,} layers."
                section.tables.append(Table(name, len(table), table_view(shown, drop=HIDDEN), note,
                                            own.get("finding"), own.get("figure")))
            elif name in rows_shown:
                n = rows_shown[name]
                section.tables.append(Table(name, len(table), table_view(table.head(n), drop=HIDDEN),
                                            f"First {n} of {len(table):,} rows." if len(table) > n else
                                            f"All {len(table):,} rows.",
                                            own.get("finding"), own.get("figure")))
            else:
                section.listed.append((name, len(table)))
        if name in figures:
            finding = registry.paper_finding(name) or {}
            section.figures.append(Figure(name, figures[name], finding.get("finding"), finding.get("figure"),
                                          _reading(name, table) if name != group else None))
    for name, why in (skipped or {}).items():
        section = sections.setdefault(name, Section(name, title.get(name, name.replace("_", " "))))
        section.skipped = why
    sections = dict(sorted(sections.items(), key=lambda item: order_key(item[0], order)))
    for section in sections.values():
        section.warnings = list(dict.fromkeys(section.warnings))  # once each, in order
        if section.figures and section.finding and section.figures[0].name == section.name:
            section.figures[0].reading = section.reading  # the sentence sits beside its figure
            section.reading = None
    return list(sections.values())
