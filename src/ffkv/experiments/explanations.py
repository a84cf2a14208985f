"""Explanations of memories and their simulation scores, in the report (beyond the paper; Bills et al. 2023).

`ffkv explain` writes one sentence per memory (metrics/explanations.parquet) and `ffkv score` scores each by
simulation on held-out text (`ffkv.tools.explain`, `ffkv.tools.score`); this study owns the score tables'
names and gives them their report section: per layer, the mean score of the memories' own explanations beside
the two baselines, shuffled explanations and the random control memories' explanations. Named alone
(``ffkv analyze RUN --only explanation_scores``) it draws that figure; it reads what `ffkv score` wrote and
computes nothing else, so without it the step is skipped: "run ffkv score first".

A run indexed with a sparse dictionary may have its latents explained and scored too (`ffkv explain --latents`):
kinds "latent" and "latent_control" beside the neurons' "memory" and "control" (`KINDS`), and the table `LATENTS`
(per dictionary layer, the latents' mean score, shuffled and control baselines beside the neurons'), which this
section shows with a figure of its own and which `ffkv.experiments.latents_beside` reads as one more measure.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ffkv.errors import DamagedRun
from ffkv.experiments.common import RunContext
from ffkv.experiments.figures import interval_bars, layer_axis, legend_outside, new_figure
from ffkv.experiments.registry import Experiment, Figures, Finding, Result

NAME = "explanation_scores"
#: The tables `ffkv score` writes (per explanation and baseline; per layer) and `ffkv explain`'s.
SCORES = NAME
BY_LAYER = f"{NAME}_by_layer"
EXPLANATIONS = "explanations"
#: Per dictionary layer, the latents' scores beside the neurons' (`ffkv score`, where latents were explained).
LATENTS = f"{NAME}_latents"

#: The kinds of explained memory (explanations.parquet's ``kind``): the model's neurons ("memory") and their random
#: control keys; a sparse dictionary's latents and its control latents. Each kind is summarised on its own.
KINDS = ("memory", "control", "latent", "latent_control")
NEURON_KINDS = ("memory", "control")
LATENT_KINDS = ("latent", "latent_control")
#: Each kind of real memory -> the kind of its control (its baseline).
CONTROL_OF = {"memory": "control", "latent": "latent_control"}

FINDINGS = {BY_LAYER: Finding("Beyond the paper (Bills et al. 2023)",
                              "An explanation is worth reading when a simulator that sees only "
                              "it predicts the memory's activations on held-out text better than with another "
                              "memory's explanation (shuffled) and better than random key directions' explanations "
                              "(control)."),
            LATENTS: Finding("Beyond the paper (Bills et al. 2023)",
                             "Are a sparse dictionary's latents easier to explain than the layer's neurons? Per "
                             "dictionary layer, the latents' explanations scored as the neurons' are, each kind "
                             "beside its own shuffled and control baselines.")}


#: What names one explanation: a memory (or control memory) in one direction, by one explainer.
ONE_PER = ["kind", "layer", "key", "direction", "explainer"]


def read_explanation_rows(run, columns: list[str]) -> pd.DataFrame:
    """The `ONE_PER` columns and `columns` of RUN/metrics/explanations.parquet (`ffkv explain`; a table without
    them is named as damaged, `RunDir.read_metric`), checked to hold one explanation per `ONE_PER`: the
    table `ffkv explain` keeps, which replaces a memory's explanation when its prompt changes. A table with two
    (an older ffkv's, or one written by hand) is refused as damaged, naming a memory, since scoring both would
    count that memory twice; so is one whose layer, key or direction are not integers, or whose kind, explainer or
    explanation are not text (`_check_types`)."""
    rows = run.read_metric(EXPLANATIONS, columns=list(dict.fromkeys([*ONE_PER, *columns])))
    _check_types(run, EXPLANATIONS, rows, integers=("layer", "key", "direction"),
                 texts=[c for c in ("kind", "explainer", "explanation") if c in rows.columns],
                 fix=f"run `ffkv explain {run.path}` again")
    twice = rows[rows.duplicated(ONE_PER, keep=False)]
    if len(twice):
        r = twice.iloc[0]
        n = len(twice.drop_duplicates(ONE_PER))
        example = f"{r['kind']} {int(r['layer']) + 1}:{int(r['key'])}, direction {int(r['direction']):+d}"
        raise DamagedRun(f"{run.metric_path(EXPLANATIONS)} holds more than one explanation of {n} "
                         f"{'memory' if n == 1 else 'memories'} by one explainer (e.g. {example}, by "
                         f"{r['explainer']}), each from another prompt: run the same `ffkv explain {run.path}` "
                         "again, which keeps the current prompt's explanation only")
    return rows


def _check_types(run, name: str, rows: pd.DataFrame, integers=(), texts=(), numbers=(), fix: str = "") -> None:
    """`DamagedRun` naming RUN/metrics/NAME.parquet, the column and `fix` where a column of `integers` is not of
    integers (or lacks one), one of `texts` holds a value that is not text, or one of `numbers` is not numeric (a
    table written by hand or by another program: the pages and `ffkv score` read these as such)."""
    def damaged(column: str, what: str):
        return DamagedRun(f"{run.metric_path(name)} is damaged (its column {column!r} holds "
                          f"{rows[column].dtype} values, not {what}): {fix}")

    for column in integers:
        if not pd.api.types.is_integer_dtype(rows[column]) or rows[column].isna().any():
            raise damaged(column, "integers")
    for column in texts:
        if not rows[column].map(lambda x: isinstance(x, str)).all():
            raise damaged(column, "text")
    for column in numbers:
        if not (pd.api.types.is_numeric_dtype(rows[column]) and not pd.api.types.is_bool_dtype(rows[column])):
            raise damaged(column, "numbers")


def memory_explanations(run, kind: str = "memory") -> pd.DataFrame:
    """The explanations of a run's (`ffkv.store.run.RunDir`) real memories of `kind` ("memory": the model's
    neurons; "latent": a sparse dictionary's latents, `ffkv explain --latents`), one row per (layer, key, direction,
    explainer), with their own score and the shuffled baseline's where `ffkv score` ran (NaN otherwise): columns
    layer, key, direction, explanation, explainer, score, shuffled_score, simulator. A control's explanation is
    never among them (`CONTROL_OF`). Empty without `ffkv explain`. For a latent, ``key`` is its index in the layer's
    dictionary."""
    if kind not in CONTROL_OF:
        raise ValueError(f"kind must be one of {', '.join(CONTROL_OF)}, got {kind!r}")
    columns = ["layer", "key", "direction", "explanation", "explainer", "score", "shuffled_score", "simulator"]
    if not run.has_metric(EXPLANATIONS):
        return pd.DataFrame(columns=columns)
    # the columns read are named, so a table without them is named as damaged (`RunDir.read_metric`), not a KeyError
    rows = read_explanation_rows(run, columns=["explanation"])
    rows = rows[rows["kind"] == kind][["layer", "key", "direction", "explanation", "explainer"]]
    if run.has_metric(SCORES):
        on = ["layer", "key", "direction", "explainer"]
        scores = run.read_metric(SCORES, columns=["kind", "baseline", *on, "score", "simulator"])
        _check_types(run, SCORES, scores, integers=("layer", "key", "direction"), numbers=("score",),
                     texts=("kind", "baseline", "explainer"), fix=f"run `ffkv score {run.path}` again")
        scores = scores[scores["kind"] == kind]
        own = scores[scores["baseline"] == "own"][on + ["score", "simulator"]]
        shuffled = scores[scores["baseline"] == "shuffled"][on + ["score"]].rename(columns={"score": "shuffled_score"})
        rows = rows.merge(own, on=on, how="left").merge(shuffled, on=on, how="left")
    else:
        rows = rows.assign(score=np.nan, shuffled_score=np.nan, simulator=None)
    rows = rows[columns].sort_values(["layer", "key", "direction"], ascending=[True, True, False])
    return rows.reset_index(drop=True)


def _latent_figure(table: pd.DataFrame):
    """Per dictionary layer (and explainer): the latents' and the neurons' own scores, each beside its shuffled and
    control baselines, with 95% intervals."""
    fig, ax = new_figure()
    several = table["explainer"].nunique() > 1
    series = [(f"{part}_{kind}", f"{label} ({kind})", color, marker)
              for kind, marker in (("latents", "o"), ("neurons", "s"))
              for part, label, color in (("score", "own explanation", "#4C72B0"),
                                         ("shuffled", "shuffled explanation", "#8C8C8C"),
                                         ("control", "controls' own explanations", "#DD8452"))]
    rows = list(table.itertuples(index=False))
    width = 0.8 / len(series)
    for s, (column, label, color, marker) in enumerate(series):
        xs = np.arange(len(rows)) + (s - (len(series) - 1) / 2) * width
        ax.plot(xs, table[column].to_numpy(float), marker, color=color, label=label,
                fillstyle="full" if column.endswith("latents") else "none")
        interval_bars(ax, xs, table, column, scale=1.0)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_ylabel("simulation score (correlation)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"layer {r.layer + 1}" + (f"\n{r.explainer}" if several else "") for r in rows])
    ax.set_xlim(-0.6, len(rows) - 0.4)
    legend_outside(ax)
    return fig


def skip_reason(ctx: RunContext) -> str | None:
    if not ctx.run.has_metric(BY_LAYER):
        return f"run ffkv score first: `ffkv explain {ctx.run.path}`, then `ffkv score {ctx.run.path}`"
    return None


def draw(result: Result) -> Figures:
    """Figure: per layer (and explainer), the mean score with its 95% interval beside the shuffled and control
    baselines, and the paired difference own - shuffled; and where latents were scored, `_latent_figure`."""
    figures = {}
    table = result.table(BY_LAYER)
    if len(table):  # empty where only latents were explained
        figures[NAME] = _neuron_figure(table, result.n_layers)
    latents = result.inputs.get(LATENTS)
    if latents is not None and len(latents):
        figures[LATENTS] = _latent_figure(latents)
    return figures


def _neuron_figure(table: pd.DataFrame, n_layers: int):
    """The neurons' scores per layer (`draw`)."""
    fig, ax = new_figure()
    explainers = sorted(table["explainer"].unique()) if "explainer" in table else [None]
    series = (("score", "own explanation", "#4C72B0"), ("shuffled", "shuffled explanation", "#8C8C8C"),
              ("control", "random control memories", "#DD8452"),
              ("score_minus_shuffled", "own - shuffled (paired by memory)", "#55A868"))
    slots = len(series) * len(explainers)
    width = 0.8 / slots
    scored = sorted(int(x) for x in table["layer"].unique())
    # the layers explained side by side, each labelled, when they are few; else the model's layer axis
    at = {layer: i for i, layer in enumerate(scored)} if len(scored) <= 16 else {layer: layer for layer in scored}
    for e, explainer in enumerate(explainers):
        part = table if explainer is None else table[table["explainer"] == explainer]
        x = np.array([at[int(layer)] for layer in part["layer"]])
        marker = "os^Dv"[e % 5]
        by = f" ({explainer})" if len(explainers) > 1 else ""
        for s, (column, label, color) in enumerate(series):
            xs = x + (len(series) * e + s - (slots - 1) / 2) * width
            ax.plot(xs, part[column].to_numpy(float), marker, color=color, label=label + by)
            interval_bars(ax, xs, part, column, scale=1.0)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_ylabel("simulation score (correlation)")
    if len(scored) <= 16:
        ax.set_xlabel("layer")
        ax.set_xticks(range(len(scored)))
        ax.set_xticklabels([str(layer + 1) for layer in scored])
        ax.set_xlim(-0.6, len(scored) - 0.4)
    else:
        layer_axis(ax, n_layers)
    legend_outside(ax)
    return fig


def compute(ctx: RunContext, options=None) -> Result:
    """Nothing computed: the per-layer scores `ffkv score` wrote (metrics/explanation_scores_by_layer, and
    explanation_scores_latents where latents were scored), read for the figures; its tables are recorded as this
    step's, not written again."""
    inputs = {BY_LAYER: ctx.run.read_metric(BY_LAYER)}
    if ctx.run.has_metric(LATENTS):
        inputs[LATENTS] = ctx.run.read_metric(LATENTS)
    return Result(ctx.view.n_layers, inputs=inputs,
                  record={"tables": [SCORES, BY_LAYER, *([LATENTS] if LATENTS in inputs else [])],
                          "note": "written by `ffkv score`; this step draws the figure"})


def reading(name: str, table: pd.DataFrame) -> str | None:
    if name == LATENTS and len(table):
        return _latent_reading(table)
    if name != BY_LAYER or not len(table):
        return None
    several = "explainer" in table and table["explainer"].nunique() > 1
    parts = []
    for explainer, t in (table.groupby("explainer") if several else [(None, table)]):
        n = int(t["n_score"].sum())
        own, shuffled, control = (float(np.nanmean(t[c].to_numpy(float))) for c in ("score", "shuffled", "control"))
        by = f"By {explainer}, over" if several else "Over"
        parts.append(f"{by} {t['layer'].nunique()} layers and {n:,} explanations, the mean score is {own:.2f}, "
                     f"against {shuffled:.2f} for shuffled explanations and {control:.2f} for the random control "
                     "memories' own explanations.")
    return " ".join(parts)


def _latent_reading(table: pd.DataFrame) -> str:
    """One sentence per dictionary layer and explainer: both kinds' mean scores and the excess's interval."""
    parts = []
    for r in table.itertuples():
        by = f" by {r.explainer}" if table["explainer"].nunique() > 1 else ""
        parts.append(f"Layer {r.layer + 1}{by}: latents {r.score_latents:.2f} (n {r.n_score_latents}; shuffled "
                     f"{r.shuffled_latents:.2f}, control latents {r.control_latents:.2f}), neurons "
                     f"{r.score_neurons:.2f} (n {r.n_score_neurons}; shuffled {r.shuffled_neurons:.2f}); own - "
                     f"shuffled, latents minus neurons {r.excess_latents_minus_neurons:+.2f} "
                     f"[{r.excess_latents_minus_neurons_ci_low:+.2f}, {r.excess_latents_minus_neurons_ci_high:+.2f}].")
    return " ".join(parts)


EXPERIMENT = Experiment(
    name=NAME, title="Explanations of memories, scored by simulation (beyond the paper)",
    section="beyond the paper", order=21, compute=compute, draw=draw, optional=True, skip_reason=skip_reason,
    findings=FINDINGS,
    latents=(f"{LATENTS}: where `ffkv explain --latents` and `ffkv score` ran, the latents' simulation scores beside "
             "the neurons' per dictionary layer, each kind with its shuffled and control baselines"),
    reading=reading, how=("simulator", "held_out", "score", "baselines", "difference"), module=__name__)

__all__ = ["BY_LAYER", "CONTROL_OF", "EXPLANATIONS", "KINDS", "LATENTS", "LATENT_KINDS", "NAME", "NEURON_KINDS",
           "ONE_PER", "SCORES", "memory_explanations", "read_explanation_rows", "skip_reason"]
