"""Refinement across layers (SPEC section 8; paper Section 5.2, Figures 9-11, Table 3).

Same examples and positions as composition (one shared forward pass). o is the model's
final prediction. Per layer: residual agreement argmax p(resid_mid) = o, the probability
p(resid_mid) gives to o, and with r = argmax p(resid_mid), f = argmax p(ff_out),
y = argmax p(resid_post): kept (y = r), FF override (y = f ≠ r), composition (y ∉ {r, f}).
r, y and the confidence use the residual projection (final normalization by default);
f uses the projection of values and sub-updates (identity by default), the same f as in
composition. Table 3: a seeded sample of examples where the last layer changes r.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ffkv.experiments.common import RunContext
from ffkv.experiments.figures import COLORS, layer_axis, new_figure, save_figure
from ffkv.experiments.heldout import capture_eval

NAME = "refinement"
N_LAST_LAYER = 50
KEPT, OVERRIDE, COMPOSITION = "kept", "override", "composition"


def categories(r: np.ndarray, f: np.ndarray, y: np.ndarray) -> np.ndarray:
    """kept where y = r, override where y = f ≠ r, composition where y ∉ {r, f}."""
    return np.where(y == r, KEPT, np.where(y == f, OVERRIDE, COMPOSITION))


def compute(ctx: RunContext) -> dict[str, pd.DataFrame]:
    cap = capture_eval(ctx)
    held = ctx.held_out()
    N, L = cap.resid_top.shape
    o = cap.final[:, None]
    cat = categories(cap.resid_top, cap.ff_top, cap.post_top)
    rows = []
    for layer in range(L):
        c = cat[:, layer]
        rows.append({
            "layer": layer, "residual_agreement": float((cap.resid_top[:, layer] == cap.final).mean()),
            "mean_confidence": float(cap.confidence[:, layer].mean()),
            "median_confidence": float(np.median(cap.confidence[:, layer])),
            "kept": float((c == KEPT).mean()), "override": float((c == OVERRIDE).mean()),
            "composition": float((c == COMPOSITION).mean()),
            "post_agreement": float((cap.post_top[:, layer] == cap.final).mean()), "n_examples": N,
        })
    examples = pd.DataFrame({
        "example_id": np.repeat(held.example_ids, L), "position": np.repeat(held.positions, L).astype(np.int32),
        "layer": np.tile(np.arange(L, dtype=np.int16), N),
        "resid_top_id": cap.resid_top.ravel().astype(np.int32), "ff_top_id": cap.ff_top.ravel().astype(np.int32),
        "post_top_id": cap.post_top.ravel().astype(np.int32),
        "final_id": np.repeat(cap.final, L).astype(np.int32), "target_id": np.repeat(held.targets, L).astype(np.int32),
        "residual_agrees": (cap.resid_top == o).ravel(), "confidence": cap.confidence.ravel(),
        "category": cat.ravel(),
    })
    return {"per_layer": pd.DataFrame(rows), "examples": examples, "last_layer": last_layer_cases(ctx, cap, cat)}


def last_layer_cases(ctx: RunContext, cap, cat: np.ndarray, n: int = N_LAST_LAYER) -> pd.DataFrame:
    """Table 3: up to n examples (seeded) where the last layer's FF changes the residual's prediction."""
    held = ctx.held_out()
    last = cap.resid_top.shape[1] - 1
    changed = np.flatnonzero(cat[:, last] != KEPT)
    rng = np.random.default_rng(ctx.seed)
    chosen = np.sort(rng.choice(changed, size=min(n, len(changed)), replace=False)) if len(changed) else changed
    rows = []
    for i in chosen:
        e, j = held.examples[i], int(held.positions[i])
        ids = [int(t) for t in e.token_ids[: j + 1]]
        r, f, y = int(cap.resid_top[i, last]), int(cap.ff_top[i, last]), int(cap.post_top[i, last])
        rows.append({"example_id": int(e.example_id), "position": j, "prefix": ctx.tokenizer.decode(ids),
                     "text": e.text, "residual_top": ctx.token(r), "ff_top": ctx.token(f), "layer_top": ctx.token(y),
                     "final": ctx.token(int(cap.final[i])), "target": ctx.token(int(held.targets[i])),
                     "category": cat[i, last], "residual_top_id": r, "ff_top_id": f, "layer_top_id": y,
                     "final_id": int(cap.final[i]), "target_id": int(held.targets[i])})
    return pd.DataFrame(rows, columns=["example_id", "position", "prefix", "text", "residual_top", "ff_top",
                                       "layer_top", "final", "target", "category", "residual_top_id", "ff_top_id",
                                       "layer_top_id", "final_id", "target_id"])


def draw(ctx: RunContext, per_layer: pd.DataFrame) -> None:
    L = ctx.view.n_layers
    x = per_layer["layer"].to_numpy()
    fig, ax = new_figure()
    ax.plot(x, 100 * per_layer["residual_agreement"], "o-", color="#4C72B0")
    ax.set_ylim(0, 100)
    ax.set_ylabel("% examples: residual's top token = final prediction")
    ax.set_title("Residual agreement with the model's prediction (paper Fig. 9)")
    layer_axis(ax, L)
    save_figure(fig, ctx.run.path, f"{NAME}_agreement")

    fig, ax = new_figure()
    ax.plot(x, per_layer["mean_confidence"], "o-", color="#DD8452", label="mean")
    ax.plot(x, per_layer["median_confidence"], "s--", color="#DD8452", alpha=0.6, label="median")
    ax.set_ylim(0, 1)
    ax.set_ylabel("p(resid_mid) of the final prediction")
    ax.set_title("Residual's probability of the final prediction (paper Fig. 10)")
    layer_axis(ax, L)
    ax.legend(frameon=False)
    save_figure(fig, ctx.run.path, f"{NAME}_confidence")

    fig, ax = new_figure()
    bottom = np.zeros(len(x))
    for name, label in ((KEPT, "residual kept (y = r)"), (OVERRIDE, "FF override (y = f ≠ r)"),
                        (COMPOSITION, "composition (y ∉ {r, f})")):
        ax.bar(x, 100 * per_layer[name], bottom=bottom, color=COLORS[name], label=label)
        bottom += 100 * per_layer[name].to_numpy()
    ax.set_ylim(0, 100)
    ax.set_ylabel("% examples")
    ax.set_title("How the FF layer changes the residual's prediction (paper Fig. 11)")
    layer_axis(ax, L)
    ax.legend(frameon=False, fontsize=7, loc="lower left")
    save_figure(fig, ctx.run.path, NAME)


def run(ctx: RunContext) -> dict:
    result = compute(ctx)
    held = ctx.held_out()
    meta = {"projection": ctx.projections.residuals, "residual_projection": ctx.projections.residuals,
            "ff_out_projection": ctx.projections.values, "final_prediction": "the model's LM head (bias included)",
            "resid_mid": ctx.view.resid_mid_definition, "n_examples": len(held.examples),
            "eval_corpus": held.spec.to_dict(), "position_seed": ctx.seed}
    ctx.write_table(NAME, result["per_layer"], **meta)
    ctx.write_table(f"{NAME}_examples", result["examples"], **meta)
    ctx.write_table(f"{NAME}_last_layer", result["last_layer"], **meta)
    draw(ctx, result["per_layer"])
    ctx.record(NAME, tables=[NAME, f"{NAME}_examples", f"{NAME}_last_layer"],
               figures=[NAME, f"{NAME}_agreement", f"{NAME}_confidence"], **meta)
    return result
