"""Composition inside a layer (docs/definitions.md; paper Section 5.1, Figures 7 and 8).

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

**Latents** (a run indexed with ``--dictionary``): `LatentReader` reads the same held-out pass (a second reader of
it, never a pass of its own) at the layers the dictionary covers: the latents that fire (a_j > 0) and whether the
FF output's top token is some firing latent's a_j·d_j top token. Decisions: the target is the model's own FF
output, as for the neurons, not the dictionary's reconstruction (whose agreement with it is reported beside, as
``reconstruction_agrees``); chance pairs each example with the same partner as the neurons' chance level; the two
kinds are compared on the same examples, so their differences are paired (mean +- 1.96 standard errors), and the
measure set beside the neurons is the excess over chance, latents minus neurons; a verdict only on `MIN_N` paired
examples. An SAE's latents are read the same way: they decompose the FF output they read.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from typing import Mapping

from ffkv.experiments.common import (MIN_N, RunContext, as_numpy, chance_with_interval, sample_size_warnings,
                                     share_with_interval)
from ffkv.experiments.figures import (COLORS, chance_line, interval_bars, kinds_beside, layer_axis, legend_outside,
                                      new_figure)
from ffkv.experiments.heldout import TAU_CURVE, EvalReader, _partners, active_scale, capture_eval, read_held_out
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.experiments.values import latent_value_tokens
from ffkv.memories.active import MASSIVE_FACTOR, RULE, active_fraction
from ffkv.memories.projection import logits as project
from ffkv.parallel import gather_rows
from ffkv.presentation.findings import diff, layer_ends, n_of, pct, rule_frame, share_ci, verdict_row, verdict_rows
from ffkv.presentation.intervals import paired_mean_interval
from ffkv.presentation.style import layer_number

NAME = "composition"
TOP_MATCH_TOKENS = 20
#: The paper's lowest composition rate over layers (Figure 8).
PAPER_LOWEST = 0.68
#: How the chance level of Figure 8 is made, for tables and figures.
CHANCE = ("permutation chance level: each example's active memories against the FF output's top token of another "
          "example (a seeded cyclic shift within each batch of the held-out pass, whose examples have similar "
          "lengths); *_minus_chance is observed - chance over the same examples, mean +- 1.96 standard errors")


def figure_tables(ctx: RunContext) -> dict[str, pd.DataFrame]:
    """Figures 7-8 from the held-out pass: per layer, per example, the tokens of the matches, the tau curve, s_l."""
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
        # The chance level's pairing: the partner example, and whether its FF top token is an active memory's here.
        "partner_example_id": np.repeat(held.example_ids[cap.partner], L),
        "ff_matches_partner": cap.ff_matches_chance.ravel(),
    })
    rows = []
    for layer in range(L):
        active = cap.n_active[:, layer]
        rows.append({
            "layer": layer, **share_with_interval(~cap.ff_matches[:, layer], "composition_rate"),
            **chance_with_interval(~cap.ff_matches[:, layer], ~cap.ff_matches_chance[:, layer], "composition_rate",
                                   cap.paired),
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
    return {"per_layer": pd.DataFrame(rows), "examples": examples, "matches": matches,
            "tau": tau_curve(cap, d_m), **scale_tables(ctx)}


def tau_curve(cap, d_m: int) -> pd.DataFrame:
    """Figure 7 as a curve over tau (signed models): per layer and tau of `TAU_CURVE`, the mean share of memories
    active and the mean and median share of ‖FF(x)‖ (less b_V) that the inactive memories write, with the
    interval of the mean. Empty for ReLU models, whose rule has no tau."""
    rows = []
    if cap.tau > 0:
        for layer in range(cap.n_active.shape[1]):
            for c, t in enumerate(TAU_CURVE):
                left = cap.tau_left_out[:, layer, c].astype(np.float64)
                share = cap.tau_active[:, layer, c] / d_m
                mean, low, high = paired_mean_interval(left)
                rows.append({"layer": layer, "tau": t, "chosen": bool(np.isclose(t, cap.tau)),
                             "mean_share_active": float(share.mean()), "median_share_active": float(np.median(share)),
                             "mean_left_out": mean, "mean_left_out_ci_low": low, "mean_left_out_ci_high": high,
                             "median_left_out": float(np.median(left)), "n_examples": len(left)})
    return pd.DataFrame(rows, columns=["layer", "tau", "chosen", "mean_share_active", "median_share_active",
                                       "mean_left_out", "mean_left_out_ci_low", "mean_left_out_ci_high",
                                       "median_left_out", "n_examples"])


def scale_tables(ctx: RunContext) -> dict[str, pd.DataFrame]:
    """s_l per layer with and without the massive-activation positions, and those positions with their tokens
    (`ffkv.experiments.heldout.active_scale`); empty where the model's rule has no scale (ReLU)."""
    if active_fraction(ctx.view) == 0:
        return {"scale": pd.DataFrame(columns=SCALE_COLUMNS), "massive": pd.DataFrame(columns=MASSIVE_COLUMNS)}
    found = active_scale(ctx)
    counts = found.massive.groupby("layer").size() if len(found.massive) else pd.Series(dtype=int)
    scale = pd.DataFrame({"layer": np.arange(len(found.scale)), "scale": found.scale,
                          "scale_all_positions": found.all_positions,
                          "n_massive": [int(counts.get(layer, 0)) for layer in range(len(found.scale))],
                          "n_positions": found.n_positions})
    massive = found.massive.assign(token=[ctx.token(int(t)) for t in found.massive["token_id"]])
    return {"scale": scale[list(SCALE_COLUMNS)], "massive": massive[list(MASSIVE_COLUMNS)]}


class LatentReader:
    """Figures 7-8 for a dictionary's latents, read from the shared held-out pass (`read_held_out`) that the
    neurons' `EvalReader` reads: per held-out example (rows) and dictionary layer, the latents that fire
    (a_j > 0, docs/definitions.md), the FF output's top token, whether some firing latent's sub-update a_j·d_j has
    it as top token (and the partner example's: the same permutation chance level as the neurons'), and the
    top token of the dictionary's reconstruction. A run without latents, or whose dictionary is gone or changed
    (`unread` says why), reads nothing."""

    def __init__(self, ctx: RunContext) -> None:
        view = ctx.view
        self.ctx, self.view = ctx, view
        self.latents, self.unread = ctx.latents_for(f"{NAME}_latents")
        self.layers = self.latents.layers if self.latents is not None else []
        self.quantities = tuple(dict.fromkeys(("ff_out", *(self.latents.reads(layer) for layer in self.layers))))\
            if self.layers else ()
        self.pv = ctx.projections.values
        N = len(ctx.held_out().examples)
        self.tops = {layer: torch.as_tensor(latent_value_tokens(ctx, self.latents, layer), device=view.device)
                     for layer in self.layers} if self.pv == "identity" else {}
        self.out = {}
        for layer in self.layers:
            for k, dt in (("n_active", np.int32), ("ff_top", np.int64), ("matches", bool),
                          ("matches_chance", bool), ("reconstruction_top", np.int64)):
                self.out[f"{layer}/{k}"] = np.zeros(N, dtype=dt)

    @torch.no_grad()
    def read(self, idx: np.ndarray, state: dict) -> None:
        """One batch of the pass: `state` holds its examples' analysed positions."""
        view, out, pv = self.view, self.out, self.pv
        shift = torch.as_tensor(_partners(len(idx), self.ctx.seed, int(idx[0])), device=view.device)
        for layer in self.layers:
            d = self.latents.dictionaries[layer]
            x = state[(self.latents.reads(layer), layer)]
            a = d.encode(x)
            active = a > 0
            ff = project(view, state[("ff_out", layer)], pv).argmax(-1)
            if pv == "identity":  # a_j > 0: the sub-update's top token is the decoder row's own
                def hit(t: torch.Tensor) -> torch.Tensor:
                    return ((self.tops[layer][None, :] == t[:, None]) & active).any(-1)
                same, same_chance = hit(ff), hit(ff[shift])
            else:  # a normalization is not scale-free: project each firing latent's sub-update
                same = torch.zeros(len(idx), dtype=torch.bool, device=view.device)
                same_chance = torch.zeros_like(same)
                for b in range(len(idx)):
                    keys = torch.nonzero(active[b])[:, 0]
                    if len(keys):
                        sub = a[b, keys, None].to(d.decoder.dtype) * d.decoder[keys]
                        best = project(view, sub, pv).argmax(-1)
                        same[b], same_chance[b] = bool((best == ff[b]).any()), bool((best == ff[shift][b]).any())
            values = {"n_active": active.sum(-1), "ff_top": ff, "matches": same, "matches_chance": same_chance,
                      "reconstruction_top": project(view, d.decode(a, x).float(), pv).argmax(-1)}
            for k, v in values.items():
                out[f"{layer}/{k}"][idx] = as_numpy(v)

    def result(self, rows: np.ndarray) -> tuple[dict[int, dict[str, np.ndarray]], list[str]]:
        """(dictionary layer -> {n_active, ff_top, matches, matches_chance, reconstruction_top} per example,
        the lines saying why nothing was read)."""
        got = gather_rows(self.out, rows) if self.out else {}
        return {layer: {k: got[f"{layer}/{k}"] for k in ("n_active", "ff_top", "matches", "matches_chance",
                                                         "reconstruction_top")} for layer in self.layers}, self.unread


def latent_tables(ctx: RunContext, cap) -> tuple[pd.DataFrame, list[str]]:
    """Figures 7-8 for the latents of each dictionary layer beside the same layer's neurons, on the same held-out
    examples: active memories, the composition rate with its chance level, the rate minus the neurons' (paired, the
    same examples) and the excess over chance of the latents minus the neurons' (paired: (latents - their chance)
    - (neurons - their chance) per example, mean +- 1.96 standard errors, over the paired examples); and how often
    the dictionary's reconstruction has the FF output's top token. Returns it with the lines saying why it is
    empty (the dictionary's files gone or changed)."""
    found, unread = read_held_out(ctx, LatentReader)
    rows = []
    for layer, got in found.items():
        n = ctx.memories("latents").size(layer)
        mine, mine_chance = ~got["matches"], ~got["matches_chance"]
        theirs, theirs_chance = ~cap.ff_matches[:, layer], ~cap.ff_matches_chance[:, layer]
        active = got["n_active"]
        row = {"layer": int(layer), "n_latents": int(n), "n_examples": int(len(active)),
               **share_with_interval(mine, "composition_rate"),
               **chance_with_interval(mine, mine_chance, "composition_rate", cap.paired),
               **share_with_interval(theirs, "composition_rate_neurons"),
               **chance_with_interval(theirs, theirs_chance, "composition_rate_neurons", cap.paired)}
        diff_mean, diff_low, diff_high = paired_mean_interval(mine.astype(np.float64) - theirs)
        row.update({"composition_rate_minus_neurons": diff_mean, "composition_rate_minus_neurons_ci_low": diff_low,
                    "composition_rate_minus_neurons_ci_high": diff_high})
        row.update(excess_composition(got["matches"], got["matches_chance"], cap.ff_matches[:, layer],
                                      cap.ff_matches_chance[:, layer], cap.paired))
        row.update({"mean_active": float(active.mean()), "median_active": float(np.median(active)),
                    "p25_active": float(np.quantile(active, 0.25)), "p75_active": float(np.quantile(active, 0.75)),
                    "share_active": float(active.mean() / n),
                    "mean_active_neurons": float(cap.n_active[:, layer].mean()),
                    "share_active_neurons": float(cap.n_active[:, layer].mean() / ctx.view.d_m)})
        row.update(share_with_interval(got["reconstruction_top"] == got["ff_top"], "reconstruction_agrees"))
        rows.append(row)
    return pd.DataFrame(rows), unread


def excess_composition(latents: np.ndarray, latents_chance: np.ndarray, neurons: np.ndarray,
                       neurons_chance: np.ndarray, paired: np.ndarray) -> dict:
    """The latents' excess composition over chance minus the neurons', per paired example, with its 95% interval
    and `composition_verdict`. Arguments: per example, whether the layer's top token is one firing latent's
    (neuron's) own top token ("matches"; composed is its negation), and the same with the pairing shuffled
    (chance); `paired`: the examples with a chance partner."""
    composed = [~np.asarray(m, dtype=bool)[paired] for m in (latents, latents_chance, neurons, neurons_chance)]
    excess = (composed[0].astype(np.float64) - composed[1]) - (composed[2].astype(np.float64) - composed[3])
    mean, low, high = paired_mean_interval(excess)
    n = int(np.asarray(paired, dtype=bool).sum())
    return {"excess_composition_latents_minus_neurons": mean, "excess_composition_latents_minus_neurons_ci_low": low,
            "excess_composition_latents_minus_neurons_ci_high": high, "n_paired": n,
            "verdict_composition": composition_verdict(low, high, n)}


def composition_verdict(low: float, high: float, n: int) -> str:
    """Which kind's top prediction is one memory's more often beyond chance, from the 95% interval of the
    latents' excess *composition* over chance minus the neurons' (read only on at least `MIN_N` paired examples).
    Composition is the top token being no single firing memory's, so a difference below 0 (the latents composed
    less, beyond chance, than the neurons) means the top prediction is one latent's more often."""
    if n < MIN_N:
        return f"no verdict: {n} paired examples, fewer than {MIN_N}"
    if not (np.isfinite(low) and np.isfinite(high)):
        return "no verdict: no chance level"
    if high < 0:  # the latents' excess composition over chance is below the neurons'
        return "the layer's top prediction is one latent's more often, beyond chance, than one neuron's"
    if low > 0:
        return "the layer's top prediction is one neuron's more often, beyond chance, than one latent's"
    return "undecided: the interval of the difference holds 0"


SCALE_COLUMNS = ("layer", "scale", "scale_all_positions", "n_massive", "n_positions")
MASSIVE_COLUMNS = ("layer", "example_id", "position", "token_id", "token", "rms", "max_abs", "times_median")


def draw(result: Result) -> Figures:
    """Figure 7 (composition_active), Figure 8 (composition) and, for a signed model, Figure 7 over tau."""
    figures = dict(draw_layers(result.tables[NAME], result.n_layers, result.meta[NAME]["active_tau"],
                               result.meta[NAME]["projection"]))
    if f"{NAME}_latents" in result.tables:  # the dictionary's latents beside the layer's neurons
        figures[f"{NAME}_latents"] = kinds_beside(
            result.tables[f"{NAME}_latents"],
            (("neurons", "composition_rate_neurons", None, "composition_rate_neurons_chance"),
             ("latents", "composition_rate", None, "composition_rate_chance")),
            "% examples: top token ≠\nevery firing memory's",
            f"Neurons vs. the dictionary's latents (Fig. 8; {result.meta[NAME]['projection']} projection)")
    if not result.tables[f"{NAME}_tau"].empty:
        figures[f"{NAME}_tau"] = draw_tau(result.tables[f"{NAME}_tau"], result.n_layers,
                                          int(result.tables[NAME]["d_m"].iloc[0]))
    return figures


def draw_layers(per_layer: pd.DataFrame, L: int, tau: float, projection: str) -> Figures:
    """Figure 7 (the active memories per layer) and Figure 8 (the composition rate)."""
    x = per_layer["layer"].to_numpy()
    d_m = int(per_layer["d_m"].iloc[0]) if len(per_layer) else 0
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
    ax.set_ylabel(f"active memories ({rule}) of {d_m}")
    ax.set_title(f"Active memories per layer (paper Fig. 7), n = {int(per_layer['n_examples'].iloc[0]):,}")
    layer_axis(ax, L)
    ax.set_ylim(0, 1.3 * max(1.0, float(per_layer["p75_active"].max()), float(per_layer["mean_active"].max())))
    legend_outside(ax)
    active = fig

    fig, ax = new_figure()
    for shift, column, color, label in ((-0.2, "composition_rate", COLORS["composition"], "FF output"),
                                        (0.2, "composition_rate_resid_post", "#8172B3", "layer output (resid_post)")):
        ax.bar(x + shift, 100 * per_layer[column], width=0.4, color=color, label=label)
        interval_bars(ax, x + shift, per_layer, column)
    chance_line(ax, x - 0.2, per_layer, "composition_rate", "chance (FF output of another example)")
    ax.axhline(100 * PAPER_LOWEST, color="grey", ls=":", lw=1, label=f"paper's lowest layer ({PAPER_LOWEST:.0%})")
    ax.set_ylim(0, 100)
    ax.set_ylabel("% examples: top token ≠\nevery active memory's")
    ax.set_title(f"Layer prediction is a composition (paper Fig. 8; {projection} projection)")
    layer_axis(ax, L)
    legend_outside(ax)
    return {NAME: fig, f"{NAME}_active": active}


def draw_tau(curve: pd.DataFrame, L: int, d_m: int):
    """Figure 7 over tau (signed models): share of memories active, and share of ‖FF(x)‖ the others write, per
    layer, one line per tau, the rule's tau drawn bold."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(5.5, 6.4), constrained_layout=True, sharex=True)
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(TAU_CURVE)))
    for (t, g), color in zip(curve.groupby("tau"), colors):
        g = g.sort_values("layer")
        chosen = bool(g["chosen"].iloc[0])
        style = {"color": color, "lw": 2.6 if chosen else 1.2, "marker": "o" if chosen else ".",
                 "label": f"tau = {t:g}" + (" (the rule)" if chosen else "")}
        axes[0].plot(g["layer"], 100 * g["mean_share_active"], **style)
        axes[1].plot(g["layer"], 100 * g["mean_left_out"], **style)
    axes[0].set_ylabel(f"% of the {d_m:,} memories active")
    axes[1].set_ylabel("% of ‖FF(x)‖ written by\nthe memories counted inactive")
    axes[0].set_ylim(0, 100)
    axes[1].set_ylim(0, max(5.0, 110 * float(curve["mean_left_out"].max())))
    for ax in axes:
        layer_axis(ax, L)
    axes[0].set_xlabel("")
    axes[0].set_title(f"Active memories over tau (paper Fig. 7), n = {int(curve['n_examples'].iloc[0]):,}",
                      loc="left")
    legend_outside(axes[1])
    return fig


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/composition (per layer) and its _examples, _matches, _tau, _scale and _massive tables."""
    found = figure_tables(ctx)
    held = ctx.held_out()
    cap = capture_eval(ctx)
    n = len(held.examples)
    meta = {"projection": ctx.projections.values, "resid_post_variant_projection": ctx.projections.values,
            "projection_choice": ctx.projections.name,
            "active": "m_i > 0 (tau = 0: no coefficient of this model can be negative)" if cap.tau == 0 else
            f"{RULE}; tau = {cap.tau:g}", "active_tau": cap.tau,
            "active_threshold": [float(t) for t in cap.threshold],
            "memory_prediction": "argmax of m_i·v_i·Eᵀ, sign kept (a negative memory predicts the bottom of v_i·Eᵀ)",
            "chance": CHANCE,
            "n_paired": int(cap.paired.sum()), "massive_factor": MASSIVE_FACTOR,
            "interval": "95% Wilson score interval", "n_examples": n, "eval_corpus": held.spec.to_dict(),
            "position_seed": ctx.seed, "warnings": sample_size_warnings(NAME, n)}
    result = Result(ctx.view.n_layers, record=dict(meta))
    result.add(NAME, found["per_layer"], **meta)
    for part in ("examples", "matches", "tau", "scale", "massive"):
        why = {"empty_because": empty_because(part, cap.tau)} if found[part].empty else {}
        result.add(f"{NAME}_{part}", found[part], **meta, **why)
    if ctx.has_latents:
        table, unread = latent_tables(ctx, cap)
        if unread:  # the dictionary's files are gone or changed: the neurons' tables stand, and say so
            result.meta[NAME] = {**meta, "warnings": [*meta["warnings"], *unread]}
        else:
            meta_lat = {**meta, "memories": "the latents of the dictionary the run was indexed with (key: encoder "
                        "row, value: decoder row), only the layers it covers, read in the shared held-out pass",
                        "active": f"latents: a_j > 0 (docs/definitions.md); neurons: {meta['active']}",
                        "memory_prediction": "argmax of a_j·d_j·Eᵀ for a latent (a_j > 0), of m_i·v_i·Eᵀ, sign "
                                             "kept, for a neuron; both against argmax p(ff_out), the model's own FF "
                                             "output",
                        "beside_neurons": "composition_rate_minus_neurons: latents minus neurons on the same examples "
                                          "(paired, mean +- 1.96 standard errors); excess_composition_latents_minus_"
                                          "neurons: (latents - their chance) - (neurons - their chance) per paired "
                                          f"example, likewise; verdict_composition read on at least {MIN_N} paired "
                                          "examples",
                        "reconstruction": "reconstruction_agrees: the share of examples where the dictionary's "
                                          "reconstruction of the FF output has the FF output's top token"}
            result.add(f"{NAME}_latents", table, **meta_lat)
    return result


def empty_because(part: str, tau: float) -> str:
    """Why the table composition_PART holds no rows (the report says it instead of a bare header row)."""
    if part in ("tau", "scale", "massive") and tau == 0:
        return ("not applicable to this model: its coefficients are never negative (ReLU), so a memory is active "
                "when m_i > 0, with no threshold tau, no scale s_l and no massive positions to leave out of it")
    return {"massive": f"nothing found: no held-out position's coefficients have an RMS over {MASSIVE_FACTOR:g} "
                       "times the median position's",
            "matches": "nothing found: in no held-out example is the FF output's top token that of an active memory",
            }.get(part, "nothing found on these held-out examples")


# ------------------------------------------------ composition: the paper's findings, its reading and fidelity rules
#: Table or figure name -> the paper's finding shown beside it (exact names: `ffkv.experiments.registry`).
FINDINGS: dict[str, Finding] = {
    "composition": Finding("Figure 8", (
        "In at least ~68% of examples in every layer, the FF layer's top prediction differs from that of "
        "every active memory: the output is a composition. The matching cases are mostly stop words.")),
    "composition_active": Finding("Figure 7", (
        "Hundreds of the 4,096 memories of a layer are active (m > 0) for one prefix, with a drop around "
        "layer 10.")),
    "composition_tau": Finding("Beyond the paper, beside Figure 7", (
        "The paper's ReLU coefficients are zero when inactive. For signed coefficients 'active' "
        "needs a threshold |m_i| > tau·s_l: the share counted active and the share of the FF output the "
        "others write, over tau; the verdict of Figure 7 uses the rule's tau.")),
    "composition_scale": Finding("Beyond the paper, beside Figure 7", (
        "s_l, the scale of the active rule, per layer, with the positions that carry "
        "massive activations (Sun et al. 2024) left out, beside what every position would give.")),
    "composition_massive": Finding("Beyond the paper, beside Figure 7", (
        "Positions whose coefficients are massive (their RMS more than 20 times the "
        "median position's; Sun et al. 2024 found such first-token outliers in most large models): named, and "
        "left out of the active rule's scale.")),
    "composition_matches": Finding("Figure 8", (
        "Where the FF output's top token equals an active memory's, the token is mostly a stop word.")),
}
# The other tables and figures of the study stand beside the finding they belong to.
FINDINGS.update({"composition_examples": FINDINGS["composition"]})
FINDINGS["composition_latents"] = Finding("Beyond the paper, beside Figure 8", (
    "The same question for the latents of a sparse dictionary of the layer, each kind against its own chance "
    "level: is the layer's top prediction one latent's more often, beyond chance, than one neuron's?"))


def reading(name: str, table: pd.DataFrame) -> str | None:
    """Figure 8 on this model: the share of examples whose FF output's top token is no active memory's,
    beside chance, and how many memories are active; None for its other tables. Layers count from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "composition" and "composition_rate" in t:
        low = t.loc[t["composition_rate"].idxmin()]
        n = low["n_examples"] if "n_examples" in t else None
        out = (f"In this model the FF output's top token differs from every active memory's in "
               f"{pct(t['composition_rate'].min())}-{pct(t['composition_rate'].max())} of examples per layer; "
               f"the lowest, layer {layer_number(low.layer)}: {share_ci(low.composition_rate, n)}")
        if "composition_rate_chance" in t:
            out += (f"; with another example's FF output (chance) "
                    f"{pct(t['composition_rate_chance'].min())}-{pct(t['composition_rate_chance'].max())}")
        if "mean_active" in t:
            of = f" of {int(first.d_m):,}" if "d_m" in t else ""
            out += f"; {t['mean_active'].min():.0f}-{t['mean_active'].max():.0f}{of} memories are active on average"
            if "mean_negative" in t and t["mean_negative"].max() > 0:
                out += (f" ({t['mean_positive'].min():.0f}-{t['mean_positive'].max():.0f} with m > 0, "
                        f"{t['mean_negative'].min():.0f}-{t['mean_negative'].max():.0f} with m < 0)")
        return out + "."
    if name == f"{NAME}_latents" and "excess_composition_latents_minus_neurons" in t:
        return " ".join(_latents_text(row) for row in t.to_dict("records"))
    return None


def _latents_text(row: dict) -> str:
    """One layer of composition_latents in words: each kind's composition rate beside its chance level, how many of
    each fire, and which kind's top prediction is one memory's more often beyond chance, where n carries it."""
    def kind(name: str, suffix: str) -> str:
        return (f"{name} {share_ci(row[f'composition_rate{suffix}'], row['n_examples'])} (chance "
                f"{pct(row[f'composition_rate{suffix}_chance'])})")
    low, high = (row[f"excess_composition_latents_minus_neurons{s}"] for s in ("_ci_low", "_ci_high"))
    return (f"Layer {layer_number(row['layer'])}, the FF output's top token is no firing memory's: "
            f"{kind('latents', '')}; {kind('neurons', '_neurons')}; excess over chance, latents minus neurons "
            f"{100 * row['excess_composition_latents_minus_neurons']:+.1f} points [{100 * low:+.1f}, "
            f"{100 * high:+.1f}]: {row['verdict_composition']}; {row['mean_active']:.1f} of {int(row['n_latents']):,} "
            f"latents fire on average, {row['mean_active_neurons']:.1f} neurons are active; the dictionary's "
            f"reconstruction has the FF output's top token in {pct(row['reconstruction_agrees'])}.")


def fidelity_rows(name: str, t: pd.DataFrame, projections: Mapping[str, str], label: str = "") -> list[dict]:
    """The rows of Figures 7-8 in metrics/fidelity.parquet: a minority of memories is active, and the FF
    output is a composition, not one memory's prediction (`ffkv.presentation.findings.verdict_row`)."""
    rows: list[dict] = []
    tt, L, first, last = rule_frame(t)
    if name == "composition" and "share_active" in t:
        low, high = float(t["share_active"].min()), float(t["share_active"].max())
        rows.append(verdict_row(
            "composition_active", "Figure 7", f"{pct(low)}-{pct(high)} of the memories active per layer",
            "a minority of memories is active: under 50% of the layer's memories on average in every layer "
            "(paper: hundreds of 4,096, 2-10%)", bool(high < 0.5), n_of(tt, "n_examples")))
    if name == "composition" and "composition_rate" in t:
        low = float(t["composition_rate"].min())
        rule = ("the FF output's top token differs from every active memory's in at least 68% of examples in every "
                "layer (the paper's lowest layer)")
        ok, chance = bool(low >= 0.68), ""
        if "composition_rate_minus_chance" in tt and tt["composition_rate_minus_chance"].isna().all():
            chance = "no chance level: the permutation needs at least 2 held-out examples in a batch"
        elif "composition_rate_minus_chance" in tt:
            rule += (", and in no layer is it a single memory's more often than an unrelated example's top token would "
                     "be (the 95% interval of observed - chance reaches 0 or above)")
            ok = ok and bool((tt["composition_rate_minus_chance_ci_high"] >= 0).all())
            worst = tt.loc[tt["composition_rate_minus_chance"].idxmin()]
            chance = (f"chance {pct(tt['composition_rate_chance'].min())}-{pct(tt['composition_rate_chance'].max())}"
                      f" per layer (FF output of another example); observed - chance lowest in layer "
                      f"{layer_number(worst.layer)}: {diff(worst, 'composition_rate')}")
        rows.append(verdict_row(
            "composition", "Figure 8", f"composition in {pct(low)}-{pct(t['composition_rate'].max())} "
            "of examples per layer", rule, ok, n_of(tt, "n_examples"), chance))
    return verdict_rows(rows, {k: f.finding for k, f in FINDINGS.items()}, name, projections.get(name, ""), label)



EXPERIMENT = Experiment(
    name=NAME, title="Composition inside a layer (paper Section 5.1)", section="paper Section 5.1, Figures 7-8",
    order=4, compute=compute, draw=draw, held_out=True, held_out_reader=(EvalReader, LatentReader),
    after=("translators",),  # the held-out pass it shares with refinement then reads the fitted translators too
    encoder=Encoder(True, "Figures 6-8", "at the masked held-out position; sub-updates and the FF output through "
                    "the values projection (the decoder weights)"),
    latents=("composition_latents: Figures 7-8 for the latents from the shared held-out pass (how many fire; whether "
             "the FF output's top token is one firing latent's), each kind beside its own permutation chance level, "
             "and the difference"),
    findings=FINDINGS, fidelity_tables=(NAME,), fidelity=fidelity_rows, reading=reading,
    reading_rows={f"{NAME}_matches": 12, f"{NAME}_massive": 20, f"{NAME}_tau": 5 * 64}, module=__name__)
