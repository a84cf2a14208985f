"""Composition inside a layer (SPEC section 7; paper Section 5.1, Figures 7 and 8).

On the held-out examples, one seeded position each, every layer: the number of active
memories (`ffkv.memories.active`: |m_i| > tau·s_l, which is m_i > 0 for ReLU), positive and
negative counted apart, and whether the FF layer's top prediction argmax p(ff_out) differs
from the top prediction of every active memory's signed sub-update argmax p(m_i·v_i)
("composition"; a negative memory predicts the bottom of v_i·Eᵀ). Variant (the paper's
released code): resid_post instead of ff_out. Every vector of the figure (ff_out, resid_post,
the sub-updates) goes through the values projection. Under the identity projection the
sub-update's top token is the value's own top (m_i > 0) or bottom (m_i < 0) token, which is
exact and cheap; under a normalization every active sub-update is projected (slow at scale).
Each share carries its n and a 95% Wilson interval.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ffkv.experiments.common import RunContext, sample_size_warnings, share_with_interval
from ffkv.experiments.figures import COLORS, legend_outside, interval_bars, layer_axis, new_figure, save_figure
from ffkv.experiments.heldout import capture_eval
from ffkv.memories.active import RULE

NAME = "composition"
TOP_MATCH_TOKENS = 20


def compute(ctx: RunContext) -> dict[str, pd.DataFrame]:
    cap = capture_eval(ctx)
    held = ctx.held_out()
    N, L = cap.n_active.shape
    d_m = ctx.view.d_m
    examples = pd.DataFrame({
        "example_id": np.repeat(held.example_ids, L), "position": np.repeat(held.positions, L).astype(np.int32),
        "layer": np.tile(np.arange(L, dtype=np.int16), N),
        "n_active": cap.n_active.ravel(), "n_positive": cap.n_positive.ravel(),
        "n_negative": cap.n_negative.ravel(), "ff_top_id": cap.ff_top.ravel().astype(np.int32),
        "ff_matches_memory": cap.ff_matches.ravel(),
        "resid_post_top_id": cap.post_top_values.ravel().astype(np.int32),
        "resid_post_matches_memory": cap.post_matches.ravel(),
    })
    rows = []
    for layer in range(L):
        active = cap.n_active[:, layer]
        rows.append({
            "layer": layer, **share_with_interval(~cap.ff_matches[:, layer], "composition_rate"),
            **share_with_interval(~cap.post_matches[:, layer], "composition_rate_resid_post"),
            "mean_active": float(active.mean()), "median_active": float(np.median(active)),
            "p25_active": float(np.quantile(active, 0.25)), "p75_active": float(np.quantile(active, 0.75)),
            "mean_positive": float(cap.n_positive[:, layer].mean()),
            "mean_negative": float(cap.n_negative[:, layer].mean()),
            "share_active": float(active.mean() / d_m), "active_threshold": float(cap.threshold[layer]),
            "d_m": d_m, "n_examples": N,
        })
    matches = []
    for variant, top, hit in (("ff_out", cap.ff_top, cap.ff_matches), ("resid_post", cap.post_top_values, cap.post_matches)):
        for layer in range(L):
            tokens = top[hit[:, layer], layer]
            if not len(tokens):
                continue
            ids, counts = np.unique(tokens, return_counts=True)
            order = np.lexsort((ids, -counts))[:TOP_MATCH_TOKENS]
            for i in order:
                matches.append({"layer": layer, "variant": variant, "token_id": int(ids[i]),
                                "token": ctx.token(int(ids[i])), "count": int(counts[i]),
                                "share_of_matches": float(counts[i] / len(tokens))})
    matches = pd.DataFrame(matches, columns=["layer", "variant", "token_id", "token", "count", "share_of_matches"])
    return {"per_layer": pd.DataFrame(rows), "examples": examples, "matches": matches}


def draw(ctx: RunContext, per_layer: pd.DataFrame, tau: float) -> None:
    L = ctx.view.n_layers
    x = per_layer["layer"].to_numpy()
    projection = ctx.projections.values
    fig, ax = new_figure()
    if tau > 0:
        ax.bar(x, per_layer["mean_positive"], color="#4C72B0", label="mean, m > 0")
        ax.bar(x, per_layer["mean_negative"], bottom=per_layer["mean_positive"], color="#C44E52",
               label="mean, m < 0")
        rule = f"|m| > {tau:g}·RMS(m)"
    else:
        ax.bar(x, per_layer["mean_active"], color="#4C72B0", label="mean")
        rule = "m > 0"
    ax.errorbar(x, per_layer["median_active"],
                yerr=[per_layer["median_active"] - per_layer["p25_active"], per_layer["p75_active"] - per_layer["median_active"]],
                fmt="o", color="black", ms=3, lw=0.8, label="median, 25-75%")
    ax.set_ylabel(f"active memories ({rule}) of {ctx.view.d_m}")
    ax.set_title(f"Active memories per layer (paper Fig. 7), n = {int(per_layer['n_examples'].iloc[0]):,}")
    layer_axis(ax, L)
    ax.set_ylim(0, 1.3 * max(1.0, float(per_layer["p75_active"].max()), float(per_layer["mean_active"].max())))
    legend_outside(ax)
    save_figure(fig, ctx.run.path, f"{NAME}_active")

    fig, ax = new_figure()
    for shift, column, color, label in ((-0.2, "composition_rate", COLORS["composition"], "FF output"),
                                        (0.2, "composition_rate_resid_post", "#8172B3", "layer output (resid_post)")):
        ax.bar(x + shift, 100 * per_layer[column], width=0.4, color=color, label=label)
        interval_bars(ax, x + shift, per_layer, column)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% examples: top token ≠\nevery active memory's")
    ax.set_title(f"Layer prediction is a composition (paper Fig. 8; {projection} projection)")
    layer_axis(ax, L)
    legend_outside(ax)
    save_figure(fig, ctx.run.path, NAME)


def run(ctx: RunContext) -> dict:
    result = compute(ctx)
    held = ctx.held_out()
    cap = capture_eval(ctx)
    n = len(held.examples)
    meta = {"projection": ctx.projections.values, "resid_post_variant_projection": ctx.projections.values,
            "projection_choice": ctx.projections.name,
            "active": "m_i > 0 (tau = 0: no coefficient of this model can be negative)" if cap.tau == 0 else
            f"{RULE}; tau = {cap.tau:g}", "active_tau": cap.tau,
            "active_threshold": [float(t) for t in cap.threshold],
            "memory_prediction": "argmax of m_i·v_i·Eᵀ, sign kept (a negative memory predicts the bottom of v_i·Eᵀ)",
            "interval": "95% Wilson score interval", "n_examples": n, "eval_corpus": held.spec.to_dict(),
            "position_seed": ctx.seed, "warnings": sample_size_warnings(NAME, n)}
    ctx.write_table(NAME, result["per_layer"], **meta)
    ctx.write_table(f"{NAME}_examples", result["examples"], **meta)
    ctx.write_table(f"{NAME}_matches", result["matches"], **meta)
    draw(ctx, result["per_layer"], cap.tau)
    ctx.record(NAME, tables=[NAME, f"{NAME}_examples", f"{NAME}_matches"], figures=[NAME, f"{NAME}_active"], **meta)
    return result
