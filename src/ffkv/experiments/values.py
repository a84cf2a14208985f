"""Values as distributions over the vocabulary (docs/definitions.md; paper Section 4, Figures 4-5, Table 2).

``p_i^l = softmax(N(v_i^l)·Eᵀ)``, N the identity by default. Per key: the top token and
its probability, the entropy, the top 10 tokens, and the rank and probability of the
*trigger target* of the key's top-1 trigger example (`ffkv.memories.targets`: its next
token for a causal LM, the token at the trigger position for a masked-LM encoder).
Values are projected in chunks of keys (`ffkv.memories.projection.scan_values`), never
L x d_m x |V| at once.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd

from ffkv.experiments import common
from ffkv.experiments.common import (MIN_N, RunContext, control_with_interval, progress_bar, sample_size_warnings,
                                     share_with_interval)
from ffkv.experiments.figures import COLORS, interval_bars, kinds_beside, layer_axis, legend_outside, new_figure
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.memories.projection import chunk_size, scan_values
from ffkv.memories.targets import TARGET_DESCRIPTION
from ffkv.parallel import gather_rows, owned
from ffkv.presentation.findings import (diff, first_last, layer_ends, n_of, pct, rule_frame, share_ci, verdict_row,
                                        verdict_rows)

NAME = "values"
N_CONFIDENT = 100
TRIGGERS_SHOWN = 5


def value_tokens(ctx: RunContext, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(argmax p_i, argmin p_i) for every key of a layer under the values projection (shared with
    composition): what the memory predicts with a positive coefficient, and with a negative one."""
    def compute() -> tuple[np.ndarray, np.ndarray]:
        stats = scan_values(ctx.view, layer, ctx.projections.values, np.full(ctx.view.d_m, -1), top=1)
        return stats["top_token_id"].astype(np.int64), stats["bottom_token_id"].astype(np.int64)
    return ctx.once(("value_tokens", layer), compute)


def latent_value_tokens(ctx: RunContext, latents, layer: int) -> np.ndarray:
    """argmax p(d_j) of every latent of a dictionary layer under the values projection: what a firing latent
    (a_j > 0) predicts."""
    def compute() -> np.ndarray:
        n = latents.size(layer)
        stats = scan_values(ctx.view, layer, ctx.projections.values, np.full(n, -1), top=1, memories=latents)
        return stats["top_token_id"].astype(np.int64)
    return ctx.once(("latent_value_tokens", layer), compute)


def figure_tables(ctx: RunContext, direction: int = 1, projection: str | None = None) -> dict[str, pd.DataFrame]:
    """Figures 4-5 (and Table 2 for direction +1) for the trigger examples of one direction: +1 compares
    p_i = p(v_i) with the key's top trigger (largest m_i), -1 compares p(-v_i), what a negative coefficient
    writes, with the key's most negative trigger. `projection` overrides the values projection (the
    translators experiment reads Figures 4-5 under each projection)."""
    view = ctx.view
    projection = projection or ctx.projections.values
    L, d_m, V = view.n_layers, view.d_m, view.vocab_size
    trig = ctx.trigger_targets(direction)
    first = trig[trig["rank"] == 0]
    targets = np.full((L, d_m), -1, dtype=np.int64)
    targets[first["layer"].to_numpy(int), first["key"].to_numpy(int)] = first["target"].to_numpy()
    mine = owned(range(L))  # under torchrun each rank scans its layers, then every rank has all
    stats: dict[str, np.ndarray] = {}
    bar = progress_bar(ctx.progress, len(mine), "values", "layer")
    for layer in mine:
        for name, v in ctx.value_scan(layer, projection, targets[layer], sign=direction).items():
            if name not in stats:
                stats[name] = np.zeros((L, *v.shape), v.dtype)
            stats[name][layer] = v
        bar.update(1)
    bar.close()
    stats = gather_rows(stats, mine)
    keys = []
    for layer in range(L):
        s = {name: v[layer] for name, v in stats.items()}
        if direction == 1 and projection == ctx.projections.values:
            ctx.once(("value_tokens", layer), lambda: (s["top_token_id"].astype(np.int64),
                                                       s["bottom_token_id"].astype(np.int64)))
        keys.append(_keys_frame(layer, s, targets[layer]))
    keys = pd.concat(keys, ignore_index=True)
    keys["top_token"] = ctx.tokens(keys["top_token_id"])
    control = control_keys(ctx, direction, projection) if ctx.has_control else None
    result = {"keys": keys, "per_layer": per_layer(keys, V, control)}
    if control is not None:
        result["control"] = control
    if direction == 1:
        result["confident"] = most_confident(ctx, keys, trig)
    return result


def _keys_frame(layer: int, s: Mapping[str, np.ndarray], targets: np.ndarray) -> pd.DataFrame:
    """One layer's rows of NAME_keys from its `scan_values` statistics and each memory's trigger target."""
    n = len(targets)
    return pd.DataFrame({
        "layer": np.full(n, layer, np.int16), "key": np.arange(n, dtype=np.int32),
        "top_token_id": s["top_token_id"].astype(np.int32), "top_prob": s["top_prob"].astype(np.float32),
        "entropy": s["entropy"].astype(np.float32),
        "trigger_target_id": targets.astype(np.int32),
        "agrees": (targets >= 0) & (s["top_token_id"] == targets),
        "target_rank": s["target_rank"].astype(np.int64),
        "target_prob": s["target_prob"].astype(np.float32),
        "top_token_ids": list(s["top_token_ids"].astype(np.int32)),
        "top_probs": list(s["top_probs"].astype(np.float32)),
    })


def _control_frame(layer: int, s: Mapping[str, np.ndarray], targets: np.ndarray, sources: np.ndarray
                   ) -> pd.DataFrame:
    """One layer's rows of the control's table: each control memory's borrowed value against its own target."""
    n = len(targets)
    return pd.DataFrame({
        "layer": np.full(n, layer, np.int16), "key": np.arange(n, dtype=np.int32),
        "source_key": sources.astype(np.int32), "top_token_id": s["top_token_id"].astype(np.int32),
        "trigger_target_id": targets.astype(np.int32),
        "agrees": (targets >= 0) & (s["top_token_id"] == targets),
        "target_rank": s["target_rank"].astype(np.int64)})


def _first_targets(trig: pd.DataFrame, layer: int, n: int) -> np.ndarray:
    """(n,) the target of each memory's top trigger example in `layer` (-1 where it has none)."""
    first = trig[(trig["rank"] == 0) & (trig["layer"] == layer)]
    targets = np.full(n, -1, dtype=np.int64)
    targets[first["key"].to_numpy(int)] = first["target"].to_numpy()
    return targets


def latent_tables(ctx: RunContext, projection: str | None = None) -> dict[str, pd.DataFrame]:
    """Figures 4-5 for the latents of the dictionary the run was indexed with (`ffkv.memories.sets.Latents`), as
    for the neurons: each latent's value (decoder row) under the values projection against the target of its
    top trigger example, with chance (1/|V|, the layer's pairing shuffled) and the control latents (each with a
    real latent's encoder norm, bias and value: their borrowed value against their own top trigger); per layer
    the neurons' agreement of that layer beside it, with the difference's 95% interval (Newcombe)."""
    view, latents = ctx.view, ctx.memories("latents")
    projection = projection or ctx.projections.values
    trig = ctx.trigger_targets(1, source="latents")
    sources = ctx.latent_control_sources() if ctx.has_latent_control else None
    control_trig = ctx.trigger_targets(1, control=True, source="latents") if sources is not None else None
    keys, control = [], []
    for layer in latents.layers:
        targets = _first_targets(trig, layer, latents.size(layer))
        keys.append(_keys_frame(layer, scan_values(view, layer, projection, targets, memories=latents), targets))
        if sources is not None and layer in sources:
            own = _first_targets(control_trig, layer, len(sources[layer]))
            s = scan_values(view, layer, projection, own, top=1, keys=sources[layer], memories=latents)
            control.append(_control_frame(layer, s, own, sources[layer]))
    keys = pd.concat(keys, ignore_index=True)
    keys["top_token"] = ctx.tokens(keys["top_token_id"])
    control_df = pd.concat(control, ignore_index=True) if control else None
    table = per_layer(keys, view.vocab_size, control_df)
    return {"keys": keys, "per_layer": table, **({"control": control_df} if control_df is not None else {})}


def beside_neurons(latent_layers: pd.DataFrame, latent_keys: pd.DataFrame, neuron_keys: pd.DataFrame,
                   neuron_layers: pd.DataFrame) -> pd.DataFrame:
    """`latent_layers` with, per layer, the neurons' agreement there (agreement_rate_neurons and its interval, with
    their own nulls: chance_rate_shuffled_neurons, agreement_rate_neurons_control) and the latents' minus the
    neurons' (agreement_rate_minus_neurons: Newcombe's 95% interval), over the memories of each kind whose top
    trigger has a target."""
    nulls = neuron_layers.set_index("layer")
    rows = []
    for layer in latent_layers["layer"]:
        mine = latent_keys[(latent_keys["layer"] == layer) & (latent_keys["trigger_target_id"] >= 0)]
        theirs = neuron_keys[(neuron_keys["layer"] == layer) & (neuron_keys["trigger_target_id"] >= 0)]
        got = common.beside_neurons(mine["agrees"].to_numpy(bool), theirs["agrees"].to_numpy(bool), "agreement_rate")
        rows.append({"layer": int(layer), **got,
                     "n_neurons_with_target": int(len(theirs)),
                     "chance_rate_shuffled_neurons": float(nulls.at[layer, "chance_rate_shuffled"]),
                     "agreement_rate_neurons_control": float(nulls.at[layer, "agreement_rate_control"])
                     if "agreement_rate_control" in nulls else float("nan")})
    return latent_layers.merge(pd.DataFrame(rows), on="layer", how="left")


def control_keys(ctx: RunContext, direction: int, projection: str) -> pd.DataFrame:
    """Figures 4-5 for the random control memories (`ffkv.memories.controls`): each one's borrowed value (the value
    of its source key) against the target of its own top trigger example."""
    view = ctx.view
    trig = ctx.trigger_targets(direction, control=True)
    n = ctx.manifest.control_keys
    sources = ctx.control_sources()
    rows = []
    for layer in range(view.n_layers):
        targets = _first_targets(trig, layer, n)
        s = scan_values(view, layer, projection, targets, top=1, sign=direction, keys=sources[layer])
        rows.append(_control_frame(layer, s, targets, sources[layer]))
    return pd.concat(rows, ignore_index=True)


def per_layer(keys: pd.DataFrame, vocab_size: int, control: pd.DataFrame | None = None) -> pd.DataFrame:
    """Figure 4 and 5 numbers: agreement rate (with chance: 1/|V| and the layer's pairing shuffled, exactly in
    expectation; and beside the random control memories where `control` is given), and the target rank's
    distribution."""
    rows = []
    for layer, g in keys.groupby("layer", sort=True):
        with_target = g[g["trigger_target_id"] >= 0]
        n = len(with_target)
        ranks = with_target["target_rank"].to_numpy(float)
        # Chance under random pairing of this layer's top tokens with its targets.
        top_share = with_target["top_token_id"].value_counts(normalize=True)
        target_share = with_target["trigger_target_id"].value_counts(normalize=True)
        paired = float((top_share * target_share.reindex(top_share.index, fill_value=0)).sum()) if n else math.nan
        q = np.quantile(ranks, [0.1, 0.25, 0.5, 0.75, 0.9]) if n else [math.nan] * 5
        observed = share_with_interval(with_target["agrees"].to_numpy(bool), "agreement_rate")
        chance = max(paired, 1.0 / vocab_size) if n else math.nan
        row = {
            "layer": int(layer), **observed,
            "chance_rate": 1.0 / vocab_size, "chance_rate_shuffled": paired,
            # The observed share against the larger chance level, with the observed share's interval.
            "agreement_rate_minus_chance": observed["agreement_rate"] - chance,
            "agreement_rate_minus_chance_ci_low": observed["agreement_rate_ci_low"] - chance,
            "agreement_rate_minus_chance_ci_high": observed["agreement_rate_ci_high"] - chance,
            "n_keys": int(len(g)), "n_keys_with_target": n,
            "mean_top_prob": float(g["top_prob"].mean()), "mean_entropy": float(g["entropy"].mean()),
            "rank_p10": q[0], "rank_p25": q[1], "rank_median": q[2], "rank_p75": q[3], "rank_p90": q[4],
            "mean_log10_rank": float(np.log10(ranks).mean()) if n else math.nan,
            **share_with_interval(ranks <= 10, "share_rank_top10"),
        }
        if control is not None:
            c = control[(control["layer"] == layer) & (control["trigger_target_id"] >= 0)]
            c_ranks = c["target_rank"].to_numpy(float)
            row.update({**control_with_interval(with_target["agrees"].to_numpy(bool), c["agrees"].to_numpy(bool),
                                                "agreement_rate"),
                        "rank_median_control": float(np.median(c_ranks)) if len(c_ranks) else math.nan,
                        **control_with_interval(ranks <= 10, c_ranks <= 10, "share_rank_top10"),
                        "n_control_keys": int(len(c))})
        rows.append(row)
    return pd.DataFrame(rows)


def most_confident(ctx: RunContext, keys: pd.DataFrame, trig: pd.DataFrame, n: int = N_CONFIDENT) -> pd.DataFrame:
    """Table 2: the n values with the highest max p over all layers and keys, and whether a trigger agrees."""
    best = keys.sort_values(["top_prob", "layer", "key"], ascending=[False, True, True], kind="stable").head(n)
    by_key = {k: g for k, g in trig.groupby(["layer", "key"], sort=False)}
    rows = []
    for r in best.itertuples(index=False):
        g = by_key.get((int(r.layer), int(r.key)))
        g = g.sort_values("rank") if g is not None else trig.iloc[:0]
        hits = g["target"].to_numpy() == int(r.top_token_id)
        shown = g.head(TRIGGERS_SHOWN)
        rows.append({
            "layer": int(r.layer), "key": int(r.key), "top_token_id": int(r.top_token_id), "top_token": r.top_token,
            "top_prob": float(r.top_prob), "any_trigger_agrees": bool(hits.any()),
            "n_triggers_agree": int(hits.sum()), "n_triggers": int(len(g)),
            "first_agreeing_rank": int(g["rank"].to_numpy()[hits][0]) if hits.any() else -1,
            "trigger_example_ids": [int(e) for e in shown["example_id"]],
            "trigger_positions": [int(p) for p in shown["position"]],
            "trigger_prefixes": [ctx.prefix_text(e, p) for e, p in zip(shown["example_id"], shown["position"])],
            "trigger_targets": ctx.tokens(shown["target"]),
        })
    return pd.DataFrame(rows)


def draw(result: Result) -> Figures:
    """Figures 4 and 5 (values, values_rank), and for a run indexed with both signs the same for the most negative
    triggers (values_negative, values_negative_rank)."""
    figures: dict = {}
    for name in (NAME, f"{NAME}_negative"):
        if name in result.tables:
            figures.update(draw_direction(result.tables[name], result.tables[f"{name}_keys"], result.n_layers,
                                          result.meta[name]["projection"], name))
    if f"{NAME}_latents" in result.tables:
        figures[f"{NAME}_latents"] = draw_beside(result.tables[f"{NAME}_latents"], result.meta[NAME]["projection"])
    return figures


def draw_beside(latents: pd.DataFrame, projection: str):
    """Figure 4 for the neurons and the latents of each layer the dictionary covers, on one axis, each kind beside
    its own random directions and its own shuffled pairs (`ffkv.experiments.figures.kinds_beside`)."""
    return kinds_beside(latents, (("neurons", "agreement_rate_neurons", "agreement_rate_neurons_control",
                                   "chance_rate_shuffled_neurons"),
                                  ("latents", "agreement_rate", "agreement_rate_control", "chance_rate_shuffled")),
                        "% memories: top token =\ntrigger's next token",
                        f"Neurons vs. the dictionary's latents (Fig. 4; {projection} projection)")


def draw_direction(per_layer_df: pd.DataFrame, keys: pd.DataFrame, L: int, projection: str, name: str) -> Figures:
    """Figures 4 and 5 for the trigger examples of one direction: NAME and NAME_rank."""
    negative = name != NAME
    which = "; most negative triggers, p(-v_i)" if negative else ""
    fig, ax = new_figure()
    x = per_layer_df["layer"].to_numpy()
    ax.bar(x - 0.2, 100 * per_layer_df["agreement_rate"], width=0.4, label="agreement rate", color="#4C72B0")
    interval_bars(ax, x - 0.2, per_layer_df, "agreement_rate")
    ax.bar(x + 0.2, 100 * per_layer_df["chance_rate_shuffled"], width=0.4, label="chance (shuffled pairs)",
           color=COLORS["chance"])
    if "agreement_rate_control" in per_layer_df:
        ax.plot(x, 100 * per_layer_df["agreement_rate_control"], color="black", ls="--", marker="_", ms=10, lw=1.1,
                label="random key directions (their borrowed values)")
    ax.axhline(100 * per_layer_df["chance_rate"].iloc[0], color="black", lw=0.8, ls=":", label="chance 1/|V|")
    ax.set_ylabel("% keys: top token =\ntrigger's next token")
    ax.set_title(f"Value top token vs. top trigger example (paper Fig. 4; {projection} projection"
                 f"{which})")
    layer_axis(ax, L)
    legend_outside(ax)
    agreement = fig

    fig, ax = new_figure()
    data = [keys.loc[(keys["layer"] == l) & (keys["trigger_target_id"] >= 0), "target_rank"].to_numpy()
            for l in range(L)]
    ax.boxplot([d if len(d) else [np.nan] for d in data], positions=range(L), showfliers=False, widths=0.6)
    if "rank_median_control" in per_layer_df:
        ax.plot(per_layer_df["layer"], per_layer_df["rank_median_control"], color="black", ls="--", marker="_",
                ms=10, lw=1.1, label="median, random key directions")
        legend_outside(ax)
    ax.set_yscale("log")
    ax.set_ylabel("rank of trigger's next token in p_i (1 = top)")
    ax.set_title(f"Rank of the trigger's next token (paper Fig. 5; {projection} projection{which})")
    layer_axis(ax, L)
    return {name: agreement, f"{name}_rank": fig}


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/values, values_keys and values_confident (Figures 4-5, Table 2); for a run indexed with both signs,
    values_negative and values_negative_keys too."""
    found = figure_tables(ctx)
    n = int(found["per_layer"]["n_keys_with_target"].min()) if len(found["per_layer"]) else 0
    meta = {"projection": ctx.projections.values, "projection_choice": ctx.projections.name,
            "vocab_size": ctx.view.vocab_size, "interval": "95% Wilson score interval",
            "warnings": sample_size_warnings(NAME, n, "keys with a trigger target"),
            "target": TARGET_DESCRIPTION[ctx.view.encoder],
            "rank": "1 + number of tokens with a strictly higher logit", "direction": 1,
            "control": (f"{ctx.manifest.control_keys} random key directions per layer, each with a real key's norm, "
                        "bias and value (ffkv.memories.controls); *_minus_control: Newcombe's 95% interval"
                        if ctx.has_control else "none: the run holds no random-key control (index again)")}
    result = Result(ctx.view.n_layers, record={**meta, "chunk_keys": chunk_size(ctx.view.vocab_size)})
    result.add(NAME, found["per_layer"], **meta)
    result.add(f"{NAME}_keys", found["keys"], **meta)
    result.add(f"{NAME}_confident", found["confident"], **meta)
    lat = f"{NAME}_latents"
    latents, unread = ctx.latents_for(lat)  # the dictionary's latents, beside the neurons of their layer
    if unread:
        result.meta[NAME] = {**meta, "warnings": [*meta["warnings"], *unread]}
    if latents is not None:
        latent = latent_tables(ctx)
        n_lat = int(latent["per_layer"]["n_keys_with_target"].min()) if len(latent["per_layer"]) else 0
        meta_lat = {**meta, "memories": "the latents of the dictionary the run was indexed with (key: encoder row, "
                    "value: decoder row; `ffkv.memories.sets.Latents`), only the layers it covers",
                    "warnings": sample_size_warnings(lat, n_lat, "latents with a trigger target"),
                    "control": (f"{ctx.manifest.control_keys} control latents per layer, each with a real latent's "
                                "encoder norm, bias and value (ffkv.memories.latent_keys)" if ctx.has_latent_control
                                else "none: the run holds no control latents"),
                    "neurons": "agreement_rate_neurons: the same layer's neurons (metrics/values); "
                               "*_minus_neurons: latents minus neurons, Newcombe's 95% interval"}
        result.add(lat, beside_neurons(latent["per_layer"], latent["keys"], found["keys"], found["per_layer"]),
                   **meta_lat)
        result.add(f"{lat}_keys", latent["keys"], **meta_lat)
    if len(ctx.triggers(-1)):  # a run indexed with both signs: Figures 4-5 for the most negative triggers too
        negative = figure_tables(ctx, -1)
        neg = f"{NAME}_negative"
        meta_neg = {**meta, "direction": -1, "distribution": "p(-v_i) = softmax(N(-v_i)·Eᵀ): what a negative "
                    "coefficient writes, against the key's most negative trigger examples"}
        result.add(neg, negative["per_layer"], **meta_neg)
        result.add(f"{neg}_keys", negative["keys"], **meta_neg)
    return result


# ------------------------------------------------ values: the paper's findings, its reading and fidelity rules
#: Table or figure name -> the paper's finding shown beside it (exact names: `ffkv.experiments.registry`).
FINDINGS: dict[str, Finding] = {
    "values": Finding("Figure 4", (
        "The agreement between a value's top token and the next token of its key's top trigger example is "
        "near zero in layers 1-10 and rises to about 3.5% by layer 16, far above the chance rate 1/|V|.")),
    "values_rank": Finding("Figure 5", (
        "The rank of the top trigger example's next token in the value's distribution improves (gets lower) "
        "through the layers.")),
    "values_keys": Finding("Figure 4", (
        "Per key: the value's distribution over the vocabulary.")),
    "values_negative": Finding("Beyond the paper, beside Figure 4", (
        "The paper's ReLU coefficients are never negative. The same agreement for the most "
        "negative trigger examples: the top token of p(-v_i), what a negative coefficient writes, against the "
        "next token of the key's most negative trigger example.")),
    "values_negative_rank": Finding("Beyond the paper, beside Figure 5", (
        "The rank of the most negative trigger example's next token in p(-v_i).")),
    "values_confident": Finding("Table 2", (
        "Of the 100 most confident values (highest max p), almost half have a top trigger example whose next "
        "token is the value's top token.")),
}
FINDINGS["values_latents"] = Finding("Beyond the paper, beside Figure 4", (
    "The same agreement for the latents of a sparse dictionary of the layer (a transcoder's or an SAE's decoder "
    "rows against the next token of each latent's top trigger example), beside the neurons of that layer: are "
    "the latents better key-value memories than the neurons?"))
# The other tables and figures of the study stand beside the finding they belong to.
FINDINGS.update({"values_negative_keys": FINDINGS["values_negative"], "values_latents_keys": FINDINGS["values_latents"]})


def reading(name: str, table: pd.DataFrame) -> str | None:
    """Figure 4 on this model: the agreement rate in the first and last layers (n, 95% intervals), beside
    1/|V|, shuffled pairs and the random key directions; None for its other tables. Layers count from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "values" and "agreement_rate" in t:
        n = "n_keys_with_target" if "n_keys_with_target" in t else "n_keys" if "n_keys" in t else None
        control = (f"; random key directions with the same values agree in {pct(first.agreement_rate_control)} "
                   f"({n_first}) and {pct(last.agreement_rate_control)} ({n_last})"
                   if "agreement_rate_control" in t else "")
        return (f"In this model the agreement rate goes from {share_ci(first.agreement_rate, first[n] if n else None)} "
                f"in {n_first} to {share_ci(last.agreement_rate, last[n] if n else None)} in {n_last} "
                f"(n: keys whose top trigger has a next token); chance is {pct(first.chance_rate)} (1/|V|), "
                f"{pct(t['chance_rate_shuffled'].mean())} for shuffled pairs{control}.")
    if name == "values_latents" and "agreement_rate_neurons" in t:
        return " ".join(_beside_text(row) for row in t.itertuples(index=False))
    return None


def _beside_text(row) -> str:
    """One layer of values_latents in words: each kind's agreement with its n and interval, each beside its own
    nulls, and which kind agrees more where the difference's 95% interval excludes 0."""
    control = (f", their control latents {pct(row.agreement_rate_control)}"
               if "agreement_rate_control" in row._fields else "")
    low, high = row.agreement_rate_minus_neurons_ci_low, row.agreement_rate_minus_neurons_ci_high
    fewest = min(row.n_keys_with_target, row.n_neurons_with_target)
    verdict = (f"no verdict: {int(fewest)} memories of one kind have a target, fewer than {MIN_N}" if fewest < MIN_N
               else "the latents agree more" if low > 0 else "the neurons agree more" if high < 0
               else "the data cannot say which kind agrees more")
    return (f"Layer {int(row.layer) + 1}: latents {share_ci(row.agreement_rate, row.n_keys_with_target)} "
            f"(shuffled pairs {pct(row.chance_rate_shuffled)}{control}); neurons "
            f"{share_ci(row.agreement_rate_neurons, row.n_neurons_with_target)}; difference "
            f"{100 * row.agreement_rate_minus_neurons:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}]: {verdict}.")


def fidelity_rows(name: str, t: pd.DataFrame, projections: Mapping[str, str], label: str = "") -> list[dict]:
    """The rows of Figures 4-5 and Table 2 in metrics/fidelity.parquet: agreement and rank improve with depth,
    above chance and the random key directions; confident values agree (`ffkv.presentation.findings.verdict_row`)."""
    rows: list[dict] = []
    tt, L, first, last = rule_frame(t)
    if name == "values" and {"agreement_rate", "chance_rate_shuffled"} <= set(t.columns):
        a0, a1 = first_last(t, "agreement_rate")
        low = float(last["agreement_rate_ci_low"]) if "agreement_rate_ci_low" in tt else a1
        chance_level = max(float(t["chance_rate_shuffled"].max()), float(t["chance_rate"].max()))
        rule = ("the top layer's agreement exceeds layer 1's, and its 95% interval lies above chance (1/|V| and "
                "shuffled pairs)")
        ok = bool(a1 > a0 and low > chance_level)
        chance = f"chance at most {pct(chance_level)} (1/|V|, shuffled pairs)"
        if "agreement_rate_minus_control" in tt:
            rule += ", and above the random key directions' agreement (95% interval of the difference above 0)"
            ok = ok and float(last["agreement_rate_minus_control_ci_low"]) > 0
            chance += (f"; random key directions {pct(last.agreement_rate_control)} in layer {L}, difference "
                       f"{diff(last, 'agreement_rate', 'control')}")
        rows.append(verdict_row("values", "Figure 4", f"agreement {pct(a0)} (layer 1) -> {pct(a1)} (layer {L}); top "
                                f"layer's 95% interval from {pct(low)}", rule, ok,
                                n_of(tt, "n_keys_with_target", "n_keys"), chance, "keys"))
    if name == "values" and "rank_median" in t:
        r0, r1 = first_last(t, "rank_median")
        rule = "the median rank of the trigger's next token is lower in the top layer than in layer 1"
        ok, chance = bool(r1 < r0), ""
        if "rank_median_control" in tt and np.isfinite(float(last["rank_median_control"])):
            rule += ", and lower than the random key directions' median rank there"
            ok = ok and r1 < float(last["rank_median_control"])
            chance = f"random key directions: median rank {float(last['rank_median_control']):g} in layer {L}"
        rows.append(verdict_row(
            "values_rank", "Figure 5", f"median rank {r0:g} (layer 1) -> {r1:g} (layer {L})", rule, ok,
            n_of(tt, "n_keys_with_target", "n_keys"), chance, "keys"))
    if name == "values_confident" and "any_trigger_agrees" in t:
        share = float(t["any_trigger_agrees"].mean()) if len(t) else math.nan
        rows.append(verdict_row(
            "values_confident", "Table 2", f"{pct(share)} of the {len(t)} most confident values",
            "at least a quarter of the most confident values have a trigger example whose target is the "
            "value's top token (paper: almost half)", bool(share >= 0.25), len(t), unit="values"))
    return verdict_rows(rows, {k: f.finding for k, f in FINDINGS.items()}, name, projections.get(name, ""), label)



EXPERIMENT = Experiment(
    name=NAME, title="Values as distributions over the vocabulary (paper Section 4)",
    section="paper Section 4, Figures 4-5, Table 2", order=3, compute=compute, draw=draw,
    encoder=Encoder(True, "Figures 4-5, Table 2", "the trigger target is the token at the trigger position; values "
                    "are projected with the MLM head's decoder weights (its transform only under --projection "
                    "final-norm)"),
    latents=("values_latents, values_latents_keys: Figures 4-5 for the decoder rows against each latent's top "
             "trigger, with chance and the control latents, beside the layer's neurons"),
    findings=FINDINGS, fidelity_tables=(NAME, f"{NAME}_confident"), fidelity=fidelity_rows, reading=reading,
    reading_rows={f"{NAME}_confident": 10}, module=__name__)
