"""Latents beside neurons, every measure in one table, with the dictionary's fidelity (beyond the paper).

The studies that read a sparse dictionary's latents (`ffkv.experiments.registry.Experiment.latents`) each write a
table that sets a measure of the latents beside the same measure of the same layer's neurons, each kind against
its own null. This step gathers them, one row per layer and measure, in one schema, with one verdict rule, and
sets the dictionary's fidelity beside them: a latent finding from a dictionary that explains little of its layer
says little about the layer.

Per row: the latents' share (for the explanation score, a mean correlation instead) with its 95% interval, n and
null; the neurons' share, interval, n and null; the difference the study tests (latents minus neurons, or for a
measure read beyond its own null, the latents' excess minus the neurons' excess) with its interval; and the verdict.
**Verdict**: none when either kind has fewer than `MIN_N` memories judged (or, for an excess over a null, either
null: on SmolLM2 most control latents never fire); "latents higher" or "neurons higher" when the difference's 95%
interval excludes 0; otherwise "cannot say". `MEASURES` names which column of which study's table each part reads
(the one place that knows the studies' column names).

**Fidelity** (`latents_beside_dictionary`), per dictionary layer, over at most `FIDELITY_TOKENS` real tokens of the
held-out examples: the fraction of the FF output's variance the reconstruction leaves unexplained (FVU), the
latents that never fire there, and the next-token loss with the layer's FF output replaced by the reconstruction
(spliced) and by its mean over those tokens (mean-ablated) at the real tokens: loss recovered =
(L_mean − L_spliced) / (L_mean − L_original). `ffkv.dictionaries.fidelity` computes these (through
`ffkv.memories.dictionary_fidelity`'s passes), as for `ffkv train-dictionary` (there on its own held-out tokens,
with the training tokens' mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from ffkv.batching import collate, length_batches
from ffkv.corpus import Example
from ffkv.experiments.common import MIN_N, RunContext
from ffkv.experiments.figures import COLORS, new_figure
from ffkv.experiments.registry import Experiment, Figures, Finding, Result
from ffkv.memories.dictionary_fidelity import measure_fidelity

NAME = "latents_beside"
#: Real held-out tokens the fidelity reads (the model's own loss, a pass up to the deepest dictionary layer, and two
#: passes per dictionary layer).
FIDELITY_TOKENS = 8192
#: Examples per fidelity pass.
BATCH_SIZE = 16


@dataclass(frozen=True)
class Measure:
    """Where one measure's parts sit in a study's latent table (column names; "" where the table has none).

    `n_neurons` may name a column or, starting with "=", a number the run fixes ("=d_m": every neuron judged);
    `null_neurons` a column, or TABLE:COLUMN of the neurons' own table (read by layer)."""

    table: str
    column: str
    label: str
    latents: str
    n_latents: str
    null_latents: str
    neurons: str
    n_neurons: str
    null_neurons: str
    difference: str
    difference_means: str
    n_nulls: tuple[str, str] = ("", "")  # where the difference reads each kind's excess over its null: their n
    share: bool = True  # the parts are shares (shown as %, differences in points); False: a mean (a correlation)
    first: str = ""  # what must run before `ffkv analyze` can compute the measure ("": nothing)


#: Every measure the latent studies write, in the report's order.
MEASURES = (
    Measure("patterns_latents", "any_pattern", "trigger prefixes share a pattern (Figure 2), beyond own random "
            "directions", "any_pattern_latents", "n_live_latents", "any_pattern_latents_control",
            "any_pattern_neurons", "n_live_neurons", "any_pattern_neurons_control", "excess_latents_minus_neurons",
            "excess over own control, latents minus neurons", ("n_control_latents", "n_control_neurons")),
    Measure("values_latents", "agreement_rate", "value's top token is the trigger's next token (Figure 4)",
            "agreement_rate", "n_keys_with_target", "chance_rate_shuffled", "agreement_rate_neurons",
            "n_neurons_with_target", "chance_rate_shuffled_neurons", "agreement_rate_minus_neurons",
            "latents minus neurons"),
    *(Measure("census_latents", m, f"{m} memories (the census), beyond own random directions", f"{m}_latents",
              f"n_{m}_latents", f"{m}_latents_control", f"{m}_neurons", f"n_{m}_neurons", f"{m}_neurons_control",
              f"excess_{m}_latents_minus_neurons", "excess over own control, latents minus neurons",
              (f"n_{m}_latents_control", f"n_{m}_neurons_control")) for m in ("detector", "positional", "dead")),
    # Two definitions of a "prediction" (and "suppression") value, each named as its own measure: the census's value
    # type (value_type_*) and Gurnee et al.'s vocabulary class (*_class).
    *(Measure("census_latents", f"value_type_{c}", f"values of the {c} type (the census's rule)", f"share_{c}",
              "n_latents", "", f"share_{c}_neurons", "n_neurons", "", f"share_{c}_minus_neurons",
              "latents minus neurons") for c in ("prediction", "suppression")),
    # composition_rate is Figure 8's share: the layer's top token is NOT the top token of any active memory
    Measure("composition_latents", "composition_rate", "the layer's top token is no active memory's own "
            "(composition, Figure 8), beyond chance", "composition_rate", "n_examples", "composition_rate_chance",
            "composition_rate_neurons", "n_examples", "composition_rate_neurons_chance",
            "excess_composition_latents_minus_neurons", "excess over own chance, latents minus neurons"),
    Measure("suppressed_latents", "suppressed_rate", "a memory knows the gold token where the model is wrong",
            "suppressed_rate", "n_wrong", "knowing_rate_correct", "suppressed_rate_neurons", "n_wrong",
            "knowing_rate_correct_neurons", "suppressed_rate_minus_neurons", "latents minus neurons"),
    *(Measure("vocabulary_classes_latents", f"{c}_class", f"{c} values (Gurnee et al.'s vocabulary class)",
              f"{c}_share", "n_keys",
              f"{c}_share_control", f"{c}_share_neurons", "=d_m", f"vocabulary_classes:{c}_share_control",
              f"{c}_share_minus_neurons",
              "latents minus neurons") for c in ("prediction", "suppression", "partition")),
    *(Measure("confidence_neurons_latents", f"{m}_share", f"{label} values (Stolfo et al.), beyond random mixtures "
              "of own values", f"{m}_share_latents", f"n_{m}_share_latents", f"{m}_share_latents_control",
              f"{m}_share_neurons", f"n_{m}_share_neurons", f"{m}_share_neurons_control",
              f"excess_{m}_share_latents_minus_neurons", "excess over own control, latents minus neurons",
              (f"n_{m}_share_latents_control", f"n_{m}_share_neurons_control"))
      for m, label in (("token_frequency", "token-frequency"), ("entropy_candidate", "entropy-candidate"))),
    # an AUC, not a share (no signal: 0.5); the difference's interval is DeLong's, paired over the same examples
    Measure("membership_latents", "membership_auc", "fires differently on training text (membership ROC AUC; "
            "further from 0.5 is more signal)", "auc_latents", "n_examples", "auc_chance", "auc_neurons",
            "n_examples", "auc_chance", "auc_latents_minus_neurons", "latents minus neurons (paired DeLong)",
            share=False, first="`ffkv analyze RUN --only membership` with the model's training text named "
                               "(--member-corpus, --nonmember-corpus; ffkv-tiny knows its own)"),
    # a mean correlation, not a share: the figure's axis reads it x100 (`ffkv score`; null: the shuffled baseline)
    Measure("explanation_scores_latents", "explanation_score", "an LLM's explanation simulates the memory (Bills et "
            "al.; mean correlation), beyond a shuffled explanation", "score_latents", "n_score_latents",
            "shuffled_latents", "score_neurons", "n_score_neurons", "shuffled_neurons", "excess_latents_minus_neurons",
            "excess over own shuffled explanations (per memory own - shuffled), latents minus neurons",
            ("n_shuffled_latents", "n_shuffled_neurons"), share=False,
            first="`ffkv explain RUN --latents --controls N` and `ffkv score RUN`"),
)

#: metrics/latents_beside: one row per layer and measure (docs/run-directory.md). Its reader in the explorer's
#: overview checks a table's columns against it by kind (whole numbers, numbers, text).
SCHEMA = pa.schema([
    ("layer", pa.int64()), ("measure", pa.string()), ("label", pa.string()), ("study", pa.string()),
    ("latents", pa.float64()), ("latents_ci_low", pa.float64()), ("latents_ci_high", pa.float64()),
    ("n_latents", pa.float64()), ("latents_null", pa.float64()),
    ("neurons", pa.float64()), ("neurons_ci_low", pa.float64()), ("neurons_ci_high", pa.float64()),
    ("n_neurons", pa.float64()), ("neurons_null", pa.float64()),
    ("difference", pa.float64()), ("difference_ci_low", pa.float64()), ("difference_ci_high", pa.float64()),
    ("difference_means", pa.string()), ("verdict", pa.string()),
])
COLUMNS = SCHEMA.names
#: metrics/latents_beside_dictionary: the dictionary's fidelity, one row per dictionary layer.
FIDELITY_SCHEMA = pa.schema([
    ("layer", pa.int64()), ("kind", pa.string()), ("n_latents", pa.int64()), ("fvu", pa.float64()),
    ("dead_latents", pa.int64()), ("dead_share", pa.float64()), ("loss_original", pa.float64()),
    ("loss_spliced", pa.float64()), ("loss_mean_ablated", pa.float64()), ("loss_recovered", pa.float64()),
    ("eval_tokens", pa.int64()),
])


def typed(rows: list[dict], schema: pa.Schema) -> pd.DataFrame:
    """`rows` as a table with `schema`'s columns and types, even when there are none (an empty table of untyped
    columns would be written as columns of nulls, which a reader cannot tell from a damaged one)."""
    return pd.DataFrame(rows, columns=schema.names).astype(
        {f.name: "str" if pa.types.is_string(f.type) else f.type.to_pandas_dtype() for f in schema})


def verdict(n_latents: float, n_neurons: float, low: float, high: float, *n_nulls: float) -> str:
    """The module's verdict rule for one row (`n_nulls`: the n of each kind's null, where the difference reads an
    excess over it)."""
    if not all(n >= MIN_N for n in (n_latents, n_neurons)) or not (math.isfinite(low) and math.isfinite(high)):
        return f"no verdict (fewer than {MIN_N} judged)"
    if not all(n >= MIN_N for n in n_nulls):  # the n shown beside the shares are enough: say which fell short
        return f"no verdict (fewer than {MIN_N} in a null)"
    if low > 0:
        return "latents higher"
    if high < 0:
        return "neurons higher"
    return "cannot say (the interval holds 0)"


def rows_of(measure: Measure, table: pd.DataFrame, d_m: int, neurons: pd.DataFrame | None = None) -> list[dict]:
    """One row per layer of a study's latent table for `measure` (none where the table lacks its columns);
    `neurons`: the neurons' own table, where `measure.null_neurons` reads it (TABLE:COLUMN)."""
    own_null = measure.null_neurons.partition(":")[2]
    null_by_layer = (dict(zip(neurons["layer"].astype(int), neurons[own_null].astype(float)))
                     if own_null and neurons is not None and own_null in neurons else {})
    def get(row, column: str, interval: bool = False):
        if not column:
            return (math.nan, math.nan, math.nan) if interval else math.nan
        value = float(row[column]) if column in row and pd.notna(row[column]) else math.nan
        if not interval:
            return value
        return value, *(float(row[f"{column}_ci_{s}"]) if f"{column}_ci_{s}" in row else math.nan
                        for s in ("low", "high"))

    if measure.latents not in table or measure.difference not in table:
        return []
    out = []
    for _, row in table.iterrows():
        n_neurons = float(d_m) if measure.n_neurons == "=d_m" else get(row, measure.n_neurons)
        latents, neurons, difference = (get(row, c, True) for c in (measure.latents, measure.neurons,
                                                                   measure.difference))
        n_latents = get(row, measure.n_latents)
        # a table with a row per explainer (explanation_scores_latents) names it: explainers are never pooled
        label = measure.label + (f" (explained by {row['explainer']})" if "explainer" in row else "")
        out.append(dict(zip(COLUMNS, (
            int(row["layer"]), measure.column, label, measure.table, *latents, n_latents,
            get(row, measure.null_latents), *neurons, n_neurons,
            null_by_layer.get(int(row["layer"]), math.nan) if own_null else get(row, measure.null_neurons), *difference,
            measure.difference_means, verdict(n_latents, n_neurons, difference[1], difference[2],
                                              *(get(row, c) for c in measure.n_nulls if c))))))
    return out


def _real_batches(ctx: RunContext, budget: int):
    """Padded batches of the held-out examples (two tokens or more), until `budget` real tokens."""
    chosen, total = [], 0
    for e in ctx.held_out().examples:
        if len(e.token_ids) < 2:
            continue
        if chosen and total + len(e.token_ids) > budget:
            break
        chosen.append(Example(len(chosen), np.asarray(e.token_ids, dtype=np.int64), ""))
        total += len(e.token_ids)
    special = ctx.loaded.special_ids
    return [collate(group, ctx.tokenizer.pad_id, special).to(ctx.view.device)
            for group in length_batches(chosen, BATCH_SIZE)]


def dictionary_fidelity(ctx: RunContext, latents) -> pd.DataFrame:
    """metrics/latents_beside_dictionary: per dictionary layer, FVU, dead latents and loss recovered over the
    held-out tokens (the module's docstring), measured by `ffkv.memories.dictionary_fidelity`."""
    fidelity = measure_fidelity(ctx.view, _real_batches(ctx, FIDELITY_TOKENS), latents.dictionaries)
    return typed([{**row, "kind": latents.dictionaries[row["layer"]].kind} for row in fidelity.rows()],
                 FIDELITY_SCHEMA)


def skip_reason(ctx: RunContext) -> str | None:
    """Why the step cannot run: the run was indexed with a dictionary whose files are gone or changed (every part
    of the step reads its latents; the other studies keep their neuron tables), or a study it gathers holds a table
    an earlier analyze computed on other examples or options than this call's (read around, its rows would be left
    out of the table without a word)."""
    if not ctx.has_latents:
        return None
    studies = dict.fromkeys(m.table.removesuffix("_latents") for m in MEASURES)
    stale = {study: why for study in studies if study not in ctx.steps and (why := ctx.stale(study))}
    if stale:
        return (f"{NAME} gathers the latent tables of {', '.join(stale)}, which an earlier analyze computed on other "
                f"examples or options than this call's ({'; '.join(f'{s}: {w}' for s, w in stale.items())}): run "
                f"`ffkv analyze {ctx.run.path} --only {','.join(stale)},{NAME}` with this call's --eval-corpus, "
                "--n-eval, --seed and --projection")
    return ctx.dictionary_problem()


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/latents_beside (one row per layer and measure) and metrics/latents_beside_dictionary; nothing for a
    run indexed without a dictionary (no section in its report: it has no latents to set beside anything)."""
    if not ctx.has_latents:
        return Result(ctx.view.n_layers, record={"latents": "none: the run was indexed without a dictionary"})
    latents, warnings = ctx.latents_for(NAME)
    rows, read = [], []
    for measure in MEASURES:
        study = measure.table.removesuffix("_latents")
        table = ctx.need(study, measure.table, optional=True)
        if table is not None:
            own = measure.null_neurons.partition(":")[0] if ":" in measure.null_neurons else None
            rows += rows_of(measure, table, ctx.view.d_m, ctx.need(study, own, optional=True) if own else None)
            read.append(measure.table)
    beside = typed(rows, SCHEMA)
    result = Result(ctx.view.n_layers)
    about = {"rule": f"verdict only where both kinds, and each null the difference reads, have at least {MIN_N} "
                     "memories judged; latents or neurons higher where the difference's 95% interval excludes 0",
             "read": sorted(set(read)), "warnings": warnings}
    result.add(NAME, beside, **about)
    if latents is not None:
        result.add(f"{NAME}_dictionary", dictionary_fidelity(ctx, latents),
                   rule=f"over at most {FIDELITY_TOKENS:,} real held-out tokens: FVU of the FF output, latents that "
                        "never fire, loss recovered (mean ablation: the FF output's mean over those tokens)")
    return result


def draw(result: Result) -> Figures:
    """Each measure's difference, latents minus neurons, with its 95% interval, per layer: one axis."""
    table = result.tables.get(NAME)
    if table is None or table.empty:  # a run without a dictionary, or no latent study in this call
        return {}
    fig, ax = new_figure(6.5, 0.5 + 0.32 * len(table))
    y = np.arange(len(table))[::-1]
    value = 100 * table["difference"].to_numpy(float)
    low, high = 100 * table["difference_ci_low"].to_numpy(float), 100 * table["difference_ci_high"].to_numpy(float)
    colors = [COLORS["semantic"] if v.startswith("latents") else COLORS["shallow"] if v.startswith("neurons")
              else COLORS["chance"] for v in table["verdict"]]
    ax.errorbar(value, y, xerr=[np.nan_to_num(value - low), np.nan_to_num(high - value)], fmt="none",
                ecolor="black", elinewidth=0.8, capsize=2)
    ax.scatter(value, y, c=colors, zorder=3, s=18)
    ax.axvline(0, color="black", lw=0.6)
    ax.set_yticks(y)
    ratios = {m.column for m in MEASURES if not m.share}  # an AUC or a correlation: its difference x100, not points
    ax.set_yticklabels([f"layer {int(r.layer) + 1}: {r.measure}" + (" (x100)" if r.measure in ratios else "")
                        for r in table.itertuples()], fontsize=8)
    ax.set_xlabel("latents minus neurons, 95% interval: percentage points for a share;\n"
                  "x100 for a measure marked so (an AUC or a mean correlation)\n"
                  "orange: latents higher, blue: neurons higher, grey: no verdict")
    fidelity = result.tables.get(f"{NAME}_dictionary")
    said = "" if fidelity is None else "; ".join(
        f"{r.kind} at layer {int(r.layer) + 1}: FVU {r.fvu:.2f}, loss recovered {r.loss_recovered:.2f}"
        for r in fidelity.itertuples())
    ax.set_title("Latents beside neurons, each measure" + (f"\n({said})" if said else ""), fontsize=9)
    return {NAME: fig}


def reading(name: str, table: pd.DataFrame) -> str | None:
    """One sentence: how many measures favour each kind, and how many the data cannot decide."""
    if name != NAME or table.empty:
        return None
    counts = table["verdict"].value_counts()
    higher = {k: int(counts.get(k, 0)) for k in ("latents higher", "neurons higher")}
    rest = len(table) - sum(higher.values())
    return (f"Of {len(table)} layer-measures, the latents are higher on {higher['latents higher']} and the neurons on "
            f"{higher['neurons higher']}; on {rest} the data cannot say or do not carry a verdict.")


FINDINGS = {NAME: Finding("Beyond the paper", (
    "Are a dictionary's latents better key-value memories than the layer's neurons? Each measure of the studies "
    "that read latents, both kinds beside their own nulls, with the dictionary's fidelity beside them."))}

EXPERIMENT = Experiment(
    name=NAME, title="Latents beside neurons: every measure side by side, with the dictionary's fidelity "
                     "(beyond the paper)",
    section="beyond the paper: sparse dictionaries as memories", order=7.5, compute=compute, draw=draw,
    after=("patterns", "values", "composition", "census", "vocabulary_classes", "confidence_neurons", "suppressed",
           "membership", "explanation_scores"),
    held_out=True,
    own_pass="the fidelity's passes replace the FF output by the reconstruction and by its mean: a model the "
             "shared held-out pass does not run",
    latents=("latents_beside, latents_beside_dictionary: every latent measure beside the neurons' in one table with "
             "one verdict rule, and the dictionary's FVU, dead latents and loss recovered"),
    findings=FINDINGS, reading=reading, how=("rule", "read"), skip_reason=skip_reason, module=__name__)
