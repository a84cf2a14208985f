"""Composition inside a layer (SPEC section 7; paper Section 5.1, Figures 7 and 8).

On the held-out examples, one seeded position each, every layer: the number of active
memories (m_i > 0), and whether the FF layer's top prediction argmax p(ff_out) differs
from the top prediction of every active memory's sub-update argmax p(m_i·v_i)
("composition"). Variant (the paper's released code): resid_post instead of ff_out, under
the same projection as the sub-updates. Under the identity projection the sub-update's
top token is the value's own top token (m_i > 0 scales the logits), which is exact and
cheap; under a normalization every active sub-update is projected (slow at scale).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ffkv.experiments.common import RunContext
from ffkv.experiments.figures import COLORS, layer_axis, new_figure, save_figure
from ffkv.experiments.heldout import capture_eval

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
        "n_active": cap.n_active.ravel(), "ff_top_id": cap.ff_top.ravel().astype(np.int32),
        "ff_matches_memory": cap.ff_matches.ravel(),
        "resid_post_top_id": cap.post_top_values.ravel().astype(np.int32),
        "resid_post_matches_memory": cap.post_matches.ravel(),
    })
    rows = []
    for layer in range(L):
        active = cap.n_active[:, layer]
        rows.append({
            "layer": layer, "composition_rate": float(1 - cap.ff_matches[:, layer].mean()),
            "composition_rate_resid_post": float(1 - cap.post_matches[:, layer].mean()),
            "mean_active": float(active.mean()), "median_active": float(np.median(active)),
            "p25_active": float(np.quantile(active, 0.25)), "p75_active": float(np.quantile(active, 0.75)),
            "share_active": float(active.mean() / d_m), "d_m": d_m, "n_examples": N,
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


def draw(ctx: RunContext, per_layer: pd.DataFrame) -> None:
    L = ctx.view.n_layers
    x = per_layer["layer"].to_numpy()
    fig, ax = new_figure()
    ax.bar(x, per_layer["mean_active"], color="#4C72B0", label="mean")
    ax.errorbar(x, per_layer["median_active"],
                yerr=[per_layer["median_active"] - per_layer["p25_active"], per_layer["p75_active"] - per_layer["median_active"]],
                fmt="o", color="black", ms=3, lw=0.8, label="median, 25-75%")
    ax.set_ylabel(f"active memories (m > 0) of {ctx.view.d_m}")
    ax.set_title("Active memories per layer (paper Fig. 7)")
    layer_axis(ax, L)
    ax.legend(frameon=False)
    save_figure(fig, ctx.run.path, f"{NAME}_active")

    fig, ax = new_figure()
    ax.bar(x - 0.2, 100 * per_layer["composition_rate"], width=0.4, color=COLORS["composition"], label="FF output")
    ax.bar(x + 0.2, 100 * per_layer["composition_rate_resid_post"], width=0.4, color="#8172B3",
           label="layer output (resid_post)")
    ax.set_ylim(0, 100)
    ax.set_ylabel("% examples: top token ≠ every active memory's")
    ax.set_title("Layer prediction is a composition (paper Fig. 8)")
    layer_axis(ax, L)
    ax.legend(frameon=False, loc="lower right")
    save_figure(fig, ctx.run.path, NAME)


def run(ctx: RunContext) -> dict:
    result = compute(ctx)
    held = ctx.held_out()
    meta = {"projection": ctx.projections.values, "resid_post_variant_projection": ctx.projections.values,
            "active": "m_i > 0", "n_examples": len(held.examples), "eval_corpus": held.spec.to_dict(),
            "position_seed": ctx.seed}
    ctx.write_table(NAME, result["per_layer"], **meta)
    ctx.write_table(f"{NAME}_examples", result["examples"], **meta)
    ctx.write_table(f"{NAME}_matches", result["matches"], **meta)
    draw(ctx, result["per_layer"])
    ctx.record(NAME, tables=[NAME, f"{NAME}_examples", f"{NAME}_matches"], figures=[NAME, f"{NAME}_active"], **meta)
    return result
