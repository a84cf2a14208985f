"""metrics/fidelity.parquet: each finding of the paper, this model's number and whether it reproduces.

The rules are the experiments' own (each module's ``fidelity``, declared in its `Experiment`); this module
only gathers their rows, in the paper's order, into one table.
"""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from ffkv.experiments.registry import experiments, fidelity_tables
from ffkv.presentation.findings import FIDELITY_COLUMNS
from ffkv.store.run import RunDir


def fidelity(tables: Mapping[str, pd.DataFrame], projections: Mapping[str, str] | None = None) -> pd.DataFrame:
    """metrics/fidelity.parquet: one row per finding of the paper that this model's tables measure.

    Args:
        tables: metrics tables by name (those the experiments' fidelity rules read: `fidelity_tables`, e.g.
            patterns, ablations, values, values_confident, composition, refinement, refinement_projections);
            the others are ignored.
        projections: table name -> the projection its numbers were read under (for the `projection` column).

    Each row: the paper's `figure` and `finding`, what this model `measured`, its `chance` or control level
    (a permutation chance level or the random key directions, docs/definitions.md), the `rule` that decides
    whether it reproduces (stated with the row, so that a reader can disagree with it), the `verdict` (yes, no,
    or why none is given: fewer than `MIN_VERDICT_N` examples or keys, no control, a detector with too little
    recall), `reproduces` (True, False, or null without a verdict), the smallest `n` over the layers read, the
    `table` it was read from and the `projection`. Figures 9-11 are also given under the other residual
    projection, from refinement_projections, labelled with it.
    """
    projections = dict(projections or {})
    rows: list[dict] = []
    for experiment in experiments().values():
        for name in experiment.fidelity_tables if experiment.fidelity is not None else ():
            table = tables.get(name)
            if table is not None and len(table):
                rows += experiment.fidelity(name, table, projections)
    table = pd.DataFrame(rows, columns=list(FIDELITY_COLUMNS))
    table["reproduces"] = table["reproduces"].astype("boolean")
    table["n"] = table["n"].astype("Int64")
    return table


def write_fidelity(run: RunDir) -> None:
    """RUN/metrics/fidelity.parquet from the per-layer tables the run holds (from this call or an earlier one);
    nothing when it holds none."""
    tables = {name: run.read_metric(name) for name in fidelity_tables() if run.has_metric(name)}
    if not tables:
        return
    projections = {name: str(run.metric_description(name).get("projection", "")) for name in tables}
    run.write_metric("fidelity", fidelity(tables, projections), {
        "sources": sorted(tables),
        "rule": "each row states its own rule; reproduces is that rule on this run's tables"})
