"""Refinement across layers (docs/definitions.md; paper Section 5.2, Figures 9-11, Table 3).

Same examples and positions as composition (one shared forward pass). o is the model's
final prediction. Per layer: residual agreement argmax p(resid_mid) = o, the probability
p(resid_mid) gives to o, and with r = argmax p(resid_mid), f = argmax p(ff_out),
y = argmax p(resid_post): kept (y = r), FF override (y = f ≠ r), composition (y ∉ {r, f}).
Every quantity of these figures (r, f, y, the confidence) goes through one projection, the
residual projection of the chosen `Projections` (final normalization by default, the
identity under ``--projection paper``). The held-out pass reads them under both
projections: `refinement_projections` holds both, and where the two differ by more than
`SHOWN_DIFFERENCE` the other projection's figures are drawn too (NAME_paper or
NAME_default). Each share carries its n and a 95% Wilson interval. Table 3: a seeded sample
of examples where the last layer changes r.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from typing import Mapping

from ffkv.experiments.common import (RESIDUAL_CHOICE, RunContext, chance_with_interval, sample_size_warnings,
                                     share_with_interval)
from ffkv.experiments.figures import COLORS, chance_line, interval_bars, layer_axis, legend_outside, new_figure
from ffkv.experiments.heldout import EvalReader, ResidualTops, capture_eval
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.presentation.findings import (diff, first_last, layer_ends, n_of, pct, rule_frame, share_ci, verdict_row,
                                        verdict_rows)

NAME = "refinement"
N_LAST_LAYER = 50
KEPT, OVERRIDE, COMPOSITION = "kept", "override", "composition"
#: The figures of the other projection are drawn when some share of Figures 9 or 11 (or the mean
#: confidence of Figure 10) differs by more than this between the two projections in some layer.
SHOWN_DIFFERENCE = 0.05
#: Per-layer columns compared between the projections.
COMPARED = ("residual_agreement", "mean_confidence", KEPT, OVERRIDE, COMPOSITION)
#: How the chance levels of Figures 9-11 are made, for tables and figures.
CHANCE = ("permutation chance level: each example paired with another (a seeded cyclic shift within each batch of "
          "the held-out pass): Figure 9 the residual's top token against the other's final prediction, Figure 10 "
          "the residual's probability of it, Figure 11 the layer's output against the other's FF top token; "
          "*_minus_chance is observed - chance over the same examples, mean +- 1.96 standard errors")


def categories(r: np.ndarray, f: np.ndarray, y: np.ndarray) -> np.ndarray:
    """kept where y = r, override where y = f ≠ r, composition where y ∉ {r, f}."""
    return np.where(y == r, KEPT, np.where(y == f, OVERRIDE, COMPOSITION))


def per_layer(tops: ResidualTops, final: np.ndarray, partner: np.ndarray | None = None,
              paired: np.ndarray | None = None) -> pd.DataFrame:
    """Figures 9-11's numbers under one projection, each share with its 95% Wilson interval, and beside each its
    permutation chance level (`CHANCE`) where `partner` (each example's partner row) is given."""
    N, L = tops.resid_top.shape
    cat = categories(tops.resid_top, tops.ff_top, tops.post_top)
    rows = []
    for layer in range(L):
        c = cat[:, layer]
        r, f, y = tops.resid_top[:, layer], tops.ff_top[:, layer], tops.post_top[:, layer]
        row = {
            "layer": layer, **share_with_interval(r == final, "residual_agreement"),
            "mean_confidence": float(tops.confidence[:, layer].mean()),
            "median_confidence": float(np.median(tops.confidence[:, layer])),
            **share_with_interval(c == KEPT, KEPT), **share_with_interval(c == OVERRIDE, OVERRIDE),
            **share_with_interval(c == COMPOSITION, COMPOSITION),
            "post_agreement": float((y == final).mean()), "n_examples": N,
        }
        if partner is not None:
            shuffled = categories(r, f[partner], y)  # the FF's own prediction taken from another example
            row.update({**chance_with_interval(r == final, r == final[partner], "residual_agreement", paired),
                        **chance_with_interval(tops.confidence[:, layer], tops.confidence_chance[:, layer],
                                               "mean_confidence", paired),
                        **chance_with_interval(c == OVERRIDE, shuffled == OVERRIDE, OVERRIDE, paired),
                        **chance_with_interval(c == COMPOSITION, shuffled == COMPOSITION, COMPOSITION, paired)})
        rows.append(row)
    return pd.DataFrame(rows)


def figure_tables(ctx: RunContext) -> dict[str, pd.DataFrame]:
    """Figures 9-11 from the held-out pass: per layer (chosen projection, and both), per example, Table 3."""
    cap = capture_eval(ctx)
    held = ctx.held_out()
    tops = cap.residual[ctx.projections.residuals]
    N, L = tops.resid_top.shape
    o = cap.final[:, None]
    cat = categories(tops.resid_top, tops.ff_top, tops.post_top)
    both = pd.concat([per_layer(t, cap.final, cap.partner, cap.paired).assign(projection=name,
                                                                              choice=RESIDUAL_CHOICE[name])
                      for name, t in cap.residual.items() if name in RESIDUAL_CHOICE], ignore_index=True)
    chosen = both[both["projection"] == ctx.projections.residuals].drop(columns=["projection", "choice"])
    examples = pd.DataFrame({
        "example_id": np.repeat(held.example_ids, L), "position": np.repeat(held.positions, L).astype(np.int32),
        "layer": np.tile(np.arange(L, dtype=np.int16), N),
        "resid_top_id": tops.resid_top.ravel().astype(np.int32), "ff_top_id": tops.ff_top.ravel().astype(np.int32),
        "post_top_id": tops.post_top.ravel().astype(np.int32),
        "final_id": np.repeat(cap.final, L).astype(np.int32), "target_id": np.repeat(held.targets, L).astype(np.int32),
        "residual_agrees": (tops.resid_top == o).ravel(), "confidence": tops.confidence.ravel(),
        "category": cat.ravel(),
    })
    return {"per_layer": chosen.reset_index(drop=True), "projections": both, "examples": examples,
            "last_layer": last_layer_cases(ctx, tops, cap.final, cat)}


def projection_difference(projections: pd.DataFrame) -> float:
    """The largest difference, over layers and the `COMPARED` columns, between the two projections' numbers."""
    tables = [g.sort_values("layer")[list(COMPARED)].to_numpy(float) for _, g in projections.groupby("projection")]
    if len(tables) < 2:
        return 0.0
    return float(np.nanmax(np.abs(tables[0] - tables[1])))


def last_layer_cases(ctx: RunContext, tops: ResidualTops, final: np.ndarray, cat: np.ndarray,
                     n: int = N_LAST_LAYER) -> pd.DataFrame:
    """Table 3: up to n examples (seeded) where the last layer's FF changes the residual's prediction."""
    held = ctx.held_out()
    last = tops.resid_top.shape[1] - 1
    changed = np.flatnonzero(cat[:, last] != KEPT)
    rng = np.random.default_rng(ctx.seed)
    chosen = np.sort(rng.choice(changed, size=min(n, len(changed)), replace=False)) if len(changed) else changed
    rows = []
    for i in chosen:
        e, j = held.examples[i], int(held.positions[i])
        ids = [int(t) for t in e.token_ids[: j + 1]]
        r, f, y = int(tops.resid_top[i, last]), int(tops.ff_top[i, last]), int(tops.post_top[i, last])
        rows.append({"example_id": int(e.example_id), "position": j, "prefix": ctx.tokenizer.decode(ids),
                     "text": e.text, "residual_top": ctx.token(r), "ff_top": ctx.token(f), "layer_top": ctx.token(y),
                     "final": ctx.token(int(final[i])), "target": ctx.token(int(held.targets[i])),
                     "category": cat[i, last], "residual_top_id": r, "ff_top_id": f, "layer_top_id": y,
                     "final_id": int(final[i]), "target_id": int(held.targets[i])})
    return pd.DataFrame(rows, columns=["example_id", "position", "prefix", "text", "residual_top", "ff_top",
                                       "layer_top", "final", "target", "category", "residual_top_id", "ff_top_id",
                                       "layer_top_id", "final_id", "target_id"])


def draw(result: Result) -> Figures:
    """Figures 9, 10 and 11 under the residual projection, and under the other one where they differ by more than
    `SHOWN_DIFFERENCE` (NAME_paper or NAME_default; an earlier analyze's are removed where they no longer do)."""
    meta = result.meta[NAME]
    figures = dict(draw_projection(result.tables[NAME], result.n_layers, meta["projection"]))
    if meta["other_projection_shown"]:
        other, table = meta["other_projection"], result.tables[f"{NAME}_projections"]
        table = table[table["projection"] == other].drop(columns=["projection", "choice"]).reset_index(drop=True)
        figures.update(draw_projection(table, result.n_layers, other, f"_{RESIDUAL_CHOICE[other]}"))
    return figures


def draw_projection(per_layer_df: pd.DataFrame, L: int, projection: str, suffix: str = "") -> Figures:
    """Figures 9, 10 and 11 under one projection (named in their titles): NAME{suffix}, NAME_agreement{suffix} and
    NAME_confidence{suffix}."""
    figures = {}
    x = per_layer_df["layer"].to_numpy()
    under = f"{projection} projection ({RESIDUAL_CHOICE[projection]}), n = {int(per_layer_df['n_examples'].iloc[0]):,}"
    fig, ax = new_figure()
    ax.plot(x, 100 * per_layer_df["residual_agreement"], "o-", color="#4C72B0", label="observed")
    interval_bars(ax, x, per_layer_df, "residual_agreement")
    chance_line(ax, x, per_layer_df, "residual_agreement", "chance (another example's final prediction)")
    ax.set_ylim(0, 100)
    ax.set_ylabel("% examples: residual's top token = final prediction")
    ax.set_title(f"Residual agreement with the model's prediction (paper Fig. 9)\n{under}")
    layer_axis(ax, L)
    legend_outside(ax)
    figures[f"{NAME}_agreement{suffix}"] = fig

    fig, ax = new_figure()
    ax.plot(x, per_layer_df["mean_confidence"], "o-", color="#DD8452", label="mean")
    ax.plot(x, per_layer_df["median_confidence"], "s--", color="#DD8452", alpha=0.6, label="median")
    chance_line(ax, x, per_layer_df, "mean_confidence", "chance (another example's final prediction)", scale=1.0)
    ax.set_ylim(0, 1)
    ax.set_ylabel("p(resid_mid) of the final prediction")
    ax.set_title(f"Residual's probability of the final prediction (paper Fig. 10)\n{under}")
    layer_axis(ax, L)
    legend_outside(ax)
    figures[f"{NAME}_confidence{suffix}"] = fig

    fig, ax = new_figure()
    bottom = np.zeros(len(x))
    for name, label in ((KEPT, "residual kept (y = r)"), (OVERRIDE, "FF override (y = f ≠ r)"),
                        (COMPOSITION, "composition (y ∉ {r, f})")):
        ax.bar(x, 100 * per_layer_df[name], bottom=bottom, color=COLORS[name], label=label)
        bottom += 100 * per_layer_df[name].to_numpy()
    interval_bars(ax, x, per_layer_df, KEPT)  # the kept share's interval, at the top of its bar
    if f"{OVERRIDE}_chance" in per_layer_df:  # the override share expected from another example's FF prediction
        level = 100 * (per_layer_df[KEPT] + per_layer_df[f"{OVERRIDE}_chance"]).to_numpy(float)
        ax.plot(x, level, color="black", ls="--", lw=1.1, marker="_", ms=10,
                label="kept + override at chance (another example's FF prediction)")
    ax.set_ylim(0, 100)
    ax.set_ylabel("% examples")
    ax.set_title(f"How the FF layer changes the residual's prediction (paper Fig. 11)\n{under}")
    layer_axis(ax, L)
    legend_outside(ax)
    return {f"{NAME}{suffix}": fig, **figures}


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/refinement (per layer, the residual projection), _projections (both), _examples, _last_layer."""
    found = figure_tables(ctx)
    held = ctx.held_out()
    n = len(held.examples)
    pr = ctx.projections.residuals
    other = next(p for p in RESIDUAL_CHOICE if p != pr)
    difference = projection_difference(found["projections"])
    shown = difference > SHOWN_DIFFERENCE
    meta = {"projection": pr, "residual_projection": pr, "ff_out_projection": pr,
            "projection_choice": RESIDUAL_CHOICE[pr], "other_projection": other,
            "projection_difference": round(difference, 4), "other_projection_shown": shown,
            "final_prediction": "the model's LM head (bias included)",
            "resid_mid": ctx.view.resid_mid_definition, "interval": "95% Wilson score interval", "n_examples": n,
            "chance": CHANCE,
            "eval_corpus": held.spec.to_dict(), "position_seed": ctx.seed,
            "warnings": sample_size_warnings(NAME, n)}
    result = Result(ctx.view.n_layers, record=dict(meta))
    result.add(NAME, found["per_layer"], **meta)
    for part in ("projections", "examples", "last_layer"):
        result.add(f"{NAME}_{part}", found[part], **meta)
    return result


# ------------------------------------------------ refinement: the paper's findings, its reading and fidelity rules
#: Table or figure name -> the paper's finding shown beside it (exact names: `ffkv.experiments.registry`).
FINDINGS: dict[str, Finding] = {
    "refinement": Finding("Figure 11", (
        "The FF layer mostly keeps the residual's prediction; when it changes it, rarely to the FF layer's "
        "own top prediction: the result is a compromise.")),
    "refinement_agreement": Finding("Figure 9", (
        "About a third of the residual's top predictions already equal the model's final prediction in the "
        "bottom layers; the share rises quickly from layer 10.")),
    "refinement_confidence": Finding("Figure 10", (
        "The probability the residual gives to the final prediction rises through the layers.")),
    "refinement_last_layer": Finding("Table 3", (
        "Examples where the last layer changes the residual's prediction: often to a related token or a "
        "compromise, for reading.")),
}
# The other tables and figures of the study stand beside the finding they belong to.
FINDINGS.update({
    "refinement_projections": FINDINGS["refinement"],
    "refinement_examples": FINDINGS["refinement"],
    "refinement_paper": FINDINGS["refinement"],
    "refinement_default": FINDINGS["refinement"],
    "refinement_agreement_paper": FINDINGS["refinement_agreement"],
    "refinement_agreement_default": FINDINGS["refinement_agreement"],
    "refinement_confidence_paper": FINDINGS["refinement_confidence"],
    "refinement_confidence_default": FINDINGS["refinement_confidence"],
})


def reading(name: str, table: pd.DataFrame) -> str | None:
    """Figure 11 on this model: how often the residual's prediction is kept, overridden by the FF layer's
    own, or composed, on average and in the last layer; None for its other tables. Layers count from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "refinement" and "kept" in t:
        n = last["n_examples"] if "n_examples" in t else None
        return (f"In this model, averaged over the {len(t)} layers, the residual's prediction is kept in "
                f"{pct(t['kept'].mean())} of examples, overridden by the FF's own prediction in "
                f"{pct(t['override'].mean())}, composed in {pct(t['composition'].mean())}; in {n_last}: kept "
                f"{share_ci(last.kept, n)}, overridden {pct(last.override)}, composed {pct(last.composition)}.")
    return None


def fidelity_rows(name: str, t: pd.DataFrame, projections: Mapping[str, str], label: str = "") -> list[dict]:
    """Rows of metrics/fidelity.parquet for Figures 9-11: what they measured, the chance level, the rule and the
    verdict (`ffkv.presentation.findings.verdict_row`); from refinement_projections, the same under the residual
    projection that was not chosen, labelled with it."""
    if name == f"{NAME}_projections":
        rows = []
        for projection, other in t.groupby("projection", sort=True) if "projection" in t else ():
            if projection == projections.get(NAME):
                continue
            choice = str(other["choice"].iloc[0]) if "choice" in other else projection
            for row in fidelity_rows(NAME, other.drop(columns=["projection", "choice"], errors="ignore"),
                                     {NAME: projection}, f" ({choice}: {projection} projection)"):
                rows.append({**row, "table": name})
        return rows
    rows: list[dict] = []
    tt, L, first, last = rule_frame(t)
    if name == "refinement" and "residual_agreement" in t:
        a0, a1 = first_last(t, "residual_agreement")
        separated = ("residual_agreement_ci_high" not in t
                     or float(last["residual_agreement_ci_low"]) > float(first["residual_agreement_ci_high"]))
        rule = "the top layer's residual agreement exceeds layer 1's, the 95% intervals apart"
        ok, chance = bool(a1 > a0 and separated), ""
        if "residual_agreement_minus_chance" in tt:
            rule += ", and lies above chance there (95% interval of observed - chance above 0)"
            ok = ok and float(last["residual_agreement_minus_chance_ci_low"]) > 0
            chance = (f"chance {pct(first.residual_agreement_chance)} (layer 1), "
                      f"{pct(last.residual_agreement_chance)} (layer {L}; another example's final prediction); "
                      f"top layer observed - chance {diff(last, 'residual_agreement')}")
        rows.append(verdict_row("refinement_agreement", "Figure 9",
                                f"residual agreement {pct(a0)} (layer 1) -> {pct(a1)} (layer {L})", rule, ok,
                                n_of(tt, "n_examples"), chance))
    if name == "refinement" and "mean_confidence" in t:
        c0, c1 = first_last(t, "mean_confidence")
        rule = "the residual's mean probability of the final prediction is higher in the top layer than in layer 1"
        ok, chance = bool(c1 > c0), ""
        if "mean_confidence_minus_chance" in tt:
            rule += ", and above chance there (95% interval of observed - chance above 0)"
            ok = ok and float(last["mean_confidence_minus_chance_ci_low"]) > 0
            chance = (f"chance {float(last.mean_confidence_chance):.3f} in layer {L} (another example's final "
                      "prediction)")
        rows.append(verdict_row("refinement_confidence", "Figure 10",
                                f"mean p(final prediction) {c0:.3f} (layer 1) -> {c1:.3f} (layer {L})", rule, ok,
                                n_of(tt, "n_examples"), chance))
    if name == "refinement" and {"kept", "override", "composition"} <= set(t.columns):
        kept = float(t["kept"].min())
        over, comp = float(t["override"].mean()), float(t["composition"].mean())
        chance = ""
        if "override_chance" in tt:
            chance = (f"override at chance {pct(float(tt['override_chance'].mean()))} on average (another example's "
                      f"FF prediction); observed - chance in layer {L}: {diff(last, 'override')}")
        rows.append(verdict_row(
            "refinement", "Figure 11",
            f"kept in at least {pct(kept)} per layer; on average override {pct(over)}, composition "
            f"{pct(comp)}",
            "the residual's prediction is kept in at least half the examples in every layer, and where it "
            "changes, a compromise (y ∉ {r, f}) is at least as common as the FF's own prediction",
            bool(kept >= 0.5 and comp >= over), n_of(tt, "n_examples"), chance))
    return verdict_rows(rows, {k: f.finding for k, f in FINDINGS.items()}, name, projections.get(name, ""), label)



EXPERIMENT = Experiment(
    name=NAME, title="Refinement across layers (paper Section 5.2)", section="paper Section 5.2, Figures 9-11, Table 3",
    order=5, compute=compute, draw=draw, held_out=True, held_out_reader=EvalReader, after=("translators",),
    encoder=Encoder(True, "Figures 9-11, Table 3", "at the masked held-out position; residuals through the MLM head "
                    "(transform, then decoder); o is the MLM head's prediction of the masked token"),
    findings=FINDINGS, fidelity_tables=(NAME, f"{NAME}_projections"), fidelity=fidelity_rows, reading=reading,
    reading_rows={f"{NAME}_last_layer": 10},
    latents="not applicable: it reads each layer's whole FF output against the residual, not its memories; how "
            "far the dictionary's reconstruction stands in for that output is its fidelity (latents_beside_dictionary)",
    module=__name__)
