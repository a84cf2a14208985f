"""Local modifications of trigger prefixes (docs/definitions.md; paper Figure 3).

For a seeded sample of keys per layer (10 by default), each of the key's top-t trigger
prefixes gets three variants: its first token removed, its last token removed, one
uniformly random token removed (special tokens such as BOS are never removed and do not
count). The key's coefficient is recomputed at the last position of each prefix,
original and modified, the same way (the prefix run alone, in padded batches), and the
relative change (m' - m) / m is averaged per layer and variant. Prefixes whose original
coefficient is not positive (the relative change would flip sign) or that would become
empty are left out and counted.

For a run indexed with a sparse dictionary (docs/definitions.md), the same for a seeded sample of the latents that
fired in each dictionary layer (a dead latent has no trigger prefix), their activation a_j recomputed the same
way in a pass of their own (the neurons' batches, and so their tables, stay as they were):
``ablations_latents`` sets each variant's mean change for the latents beside the same layer's neurons.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd
import torch

from ffkv.experiments.common import RunContext, as_numpy, progress_bar
from ffkv.experiments.figures import COLORS, legend_outside, layer_axis, new_figure
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.parallel import gather_rows
from ffkv.presentation.findings import layer_ends, n_of, n_range, pct, rule_frame, verdict_row, verdict_rows
from ffkv.presentation.intervals import mean_difference_interval

NAME = "ablations"
KEYS_PER_LAYER = 10
VARIANTS = ("first", "last", "random")


def sample_keys(n_layers: int, d_m: int, per_layer: int, seed: int) -> list[tuple[int, int]]:
    """Seeded sample of `per_layer` distinct keys in each layer (all keys when d_m is smaller)."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in range(n_layers):
        keys = np.sort(rng.choice(d_m, size=min(per_layer, d_m), replace=False))
        out.extend((layer, int(k)) for k in keys)
    return out


def modified(prefix: np.ndarray, variant: str, special: frozenset, rng: np.random.Generator) -> tuple[np.ndarray | None, int]:
    """The prefix with one non-special token removed, and the removed index (-1 if impossible)."""
    removable = [i for i, t in enumerate(prefix) if int(t) not in special]
    if len(removable) < 2:  # removing the only real token leaves nothing to read the key at
        return None, -1
    if variant == "first":
        i = removable[0]
    elif variant == "last":
        i = removable[-1]
    else:
        i = removable[int(rng.integers(len(removable)))]
    return np.delete(prefix, i), i


@torch.no_grad()
def coefficients_at_last(ctx: RunContext, prefixes: list[np.ndarray], layers: np.ndarray, keys: np.ndarray,
                         latents=None) -> np.ndarray:
    """m_key^layer at the last position of each prefix (each run alone; padding never reaches a result); with
    `latents` (`ffkv.memories.sets.Latents`), latent `key`'s activation a_j there instead, encoded from what the
    layer's latents read (the FF input of a transcoder, the FF output of an SAE).

    Each padded batch (`RunContext.batches`: by length) stops after the deepest layer its own rows read; the layers
    above it cannot change what it read, so every value has the bits of the batch run through every layer.

    Under torchrun each rank runs its share of the batches; every rank gets every prefix's value.
    """
    view = ctx.view
    values = np.full(len(prefixes), np.nan, dtype=np.float64)
    state: dict = {}
    needed = sorted(set(int(l) for l in layers))

    def sink(name: str, layer: int, t: torch.Tensor) -> None:
        sel = state["by_layer"].get(layer)
        if sel is None or (latents is not None and name != latents.reads(layer)):
            return
        rows, last, key = sel
        if latents is None:
            state["out"][layer] = t[rows, last, key].float()
        else:
            a = latents.coefficients(layer, t[rows, last])
            state["out"][layer] = a[torch.arange(len(rows), device=a.device), key].float()

    quantities = ("coefficients",) if latents is None else tuple(sorted({latents.reads(x) for x in needed}))
    mine = ctx.batches(list(enumerate(prefixes)))
    bar = progress_bar(ctx.progress, len(mine.rows), "ablations" if latents is None else "ablations (latents)",
                       "prefix")
    for idx, batch in mine:
        last = batch.attention_mask.sum(-1) - 1
        lay = torch.as_tensor(layers[idx], device=view.device)
        key = torch.as_tensor(keys[idx], device=view.device)
        state["by_layer"] = {}
        for layer in needed:
            r = torch.nonzero(lay == layer)[:, 0]
            if len(r):
                state["by_layer"][layer] = (r, last[r], key[r])
        state["out"] = {}
        with view.capture(quantities, layers=sorted(state["by_layer"]), sink=sink, stop_early=True):
            view.forward(batch.input_ids, batch.attention_mask)
        for layer, (r, _, _) in state["by_layer"].items():
            values[idx[as_numpy(r)]] = as_numpy(state["out"][layer])
        bar.update(len(idx))
    bar.close()
    return gather_rows(values, mine.rows)


def prefix_table(ctx: RunContext, keys_per_layer: int = KEYS_PER_LAYER) -> dict[str, pd.DataFrame]:
    """Per layer and per prefix variant: the coefficients of the sampled keys on their trigger prefixes, original
    and with one token removed."""
    view = ctx.view
    chosen = sample_keys(view.n_layers, view.d_m, keys_per_layer, ctx.seed)
    out = _modified_prefixes(ctx, ctx.triggers(), chosen)
    return {"per_layer": per_layer(out, view.n_layers), "prefixes": out}


def sample_latents(triggers: pd.DataFrame, layers, per_layer: int, seed: int) -> list[tuple[int, int]]:
    """Seeded sample of `per_layer` distinct latents in each dictionary layer among those with trigger examples
    (all of them when fewer fired)."""
    out = []
    for layer in layers:
        fired = np.unique(triggers.loc[triggers["layer"] == layer, "key"].to_numpy())
        rng = np.random.default_rng([seed, 46, int(layer)])
        keys = np.sort(rng.choice(fired, size=min(per_layer, len(fired)), replace=False)) if len(fired) else []
        out.extend((int(layer), int(k)) for k in keys)
    return out


def latent_prefix_table(ctx: RunContext, latents, keys_per_layer: int = KEYS_PER_LAYER) -> pd.DataFrame:
    """`prefix_table`'s rows for a seeded sample of each dictionary layer's latents that fired (`sample_latents`),
    their activations a_j recomputed on the prefixes (`coefficients_at_last` with `latents`)."""
    triggers = ctx.triggers(source="latents")
    chosen = sample_latents(triggers, latents.layers, keys_per_layer, ctx.seed)
    return _modified_prefixes(ctx, triggers, chosen, latents)


def _modified_prefixes(ctx: RunContext, triggers: pd.DataFrame, chosen: list[tuple[int, int]],
                       latents=None) -> pd.DataFrame:
    """The trigger prefixes of the `chosen` (layer, key) pairs and their three modified copies, each's coefficient
    (or latent activation, with `latents`) recomputed at its last position: one row per prefix and variant."""
    special = ctx.special_ids
    trig = triggers.set_index(["layer", "key"]).sort_index()
    records, prefixes, layers, keys = [], [], [], []
    for layer, key in chosen:
        if (layer, key) not in trig.index:
            continue
        for t in trig.loc[[(layer, key)]].itertuples():
            base = ctx.prefix(t.example_id, t.position)
            rng = np.random.default_rng([ctx.seed, layer, key, int(t.rank)])
            for variant in ("original", *VARIANTS):
                if variant == "original":
                    p, removed = base, -1
                else:
                    p, removed = modified(base, variant, special, rng)
                records.append({"layer": layer, "key": key, "rank": int(t.rank), "example_id": int(t.example_id),
                                "position": int(t.position), "variant": variant, "removed_index": removed,
                                "stored_coefficient": float(t.coefficient)})
                if p is not None:
                    prefixes.append(p)
                    layers.append(layer)
                    keys.append(key)
                    records[-1]["_row"] = len(prefixes) - 1
    m = coefficients_at_last(ctx, prefixes, np.array(layers, dtype=np.int64), np.array(keys, dtype=np.int64),
                             latents)
    df = pd.DataFrame(records, columns=["layer", "key", "rank", "example_id", "position", "variant",
                                        "removed_index", "stored_coefficient", "_row"])
    df["coefficient_recomputed"] = [m[int(r)] if pd.notna(r) else math.nan for r in df["_row"]]
    original = df[df["variant"] == "original"].set_index(["layer", "key", "rank"])["coefficient_recomputed"]
    out = df[df["variant"] != "original"].drop(columns=["_row"], errors="ignore").copy()
    out["coefficient"] = original.reindex(pd.MultiIndex.from_frame(out[["layer", "key", "rank"]])).to_numpy()
    out = out.rename(columns={"coefficient_recomputed": "coefficient_modified"})
    ok = (out["coefficient"] > 0) & out["coefficient_modified"].notna()
    out["relative_change"] = np.where(ok, (out["coefficient_modified"] - out["coefficient"]) / out["coefficient"], np.nan)
    out["excluded"] = np.where(out["coefficient_modified"].isna(), "empty after removal",
                               np.where(out["coefficient"] <= 0, "coefficient not positive", ""))
    out = out.astype({"layer": np.int16, "key": np.int32, "rank": np.int16, "position": np.int32,
                      "removed_index": np.int32})
    cols = ["layer", "key", "rank", "example_id", "position", "variant", "removed_index", "stored_coefficient",
            "coefficient", "coefficient_modified", "relative_change", "excluded"]
    return out[cols].reset_index(drop=True)


def per_layer(prefixes: pd.DataFrame, n_layers: int) -> pd.DataFrame:
    rows = []
    for layer in range(n_layers):
        g = prefixes[prefixes["layer"] == layer]
        row = {"layer": layer, "n_keys": int(g["key"].nunique()), "n_prefixes": int(g[["key", "rank"]].drop_duplicates().shape[0])}
        for variant in VARIANTS:
            v = g.loc[g["variant"] == variant, "relative_change"].dropna().to_numpy()
            row[f"mean_change_{variant}"] = float(v.mean()) if len(v) else math.nan
            row[f"sem_{variant}"] = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
            row[f"n_{variant}"] = int(len(v))
        rows.append(row)
    return pd.DataFrame(rows)


def latents_beside(latent_prefixes: pd.DataFrame, neuron_prefixes: pd.DataFrame, neurons: pd.DataFrame,
                   latents) -> pd.DataFrame:
    """metrics/ablations_latents: per dictionary layer and variant, the latents' mean relative change of a_j with
    its standard error and n (`per_layer` of their prefixes), the same layer's neurons' beside it (`neurons`, their
    `per_layer`), and the difference latents − neurons with its 95% interval (`mean_difference_interval` of the two
    kinds' prefixes)."""
    mine = per_layer(latent_prefixes, max(latents.layers) + 1 if latents.layers else 0).set_index("layer")
    theirs = neurons.set_index("layer")
    rows = []
    for layer in latents.layers:
        for variant in VARIANTS:
            lat, neu = mine.loc[layer], theirs.loc[layer]
            changes = [t.loc[(t["layer"] == layer) & (t["variant"] == variant), "relative_change"].to_numpy()
                       for t in (latent_prefixes, neuron_prefixes)]
            difference, low, high = mean_difference_interval(*changes)
            rows.append({"layer": int(layer), "kind": latents.dictionaries[layer].kind, "variant": variant,
                         "n_latents": int(lat["n_keys"]), "mean_change_latents": lat[f"mean_change_{variant}"],
                         "sem_latents": lat[f"sem_{variant}"], "n_latents_prefixes": int(lat[f"n_{variant}"]),
                         "n_neurons": int(neu["n_keys"]), "mean_change_neurons": neu[f"mean_change_{variant}"],
                         "sem_neurons": neu[f"sem_{variant}"], "n_neurons_prefixes": int(neu[f"n_{variant}"]),
                         "difference": difference, "ci_low": low, "ci_high": high})
    return pd.DataFrame(rows)


def draw(result: Result) -> Figures:
    """Figure 3: the mean relative change of the coefficient per layer and variant, with its standard error."""
    per_layer_df = result.tables[NAME]
    fig, ax = new_figure()
    x = per_layer_df["layer"].to_numpy()
    for i, variant in enumerate(VARIANTS):
        ax.errorbar(x + (i - 1) * 0.08, 100 * per_layer_df[f"mean_change_{variant}"],
                    yerr=100 * per_layer_df[f"sem_{variant}"].fillna(0), fmt="o-", ms=4, capsize=2,
                    color=COLORS[variant], label=f"{variant} token removed")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_ylabel("mean relative change of m (%)")
    ax.set_title("Coefficient change when a token is removed (paper Fig. 3)")
    layer_axis(ax, result.n_layers)
    legend_outside(ax)
    return {NAME: fig}


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/ablations (per layer) and ablations_prefixes (per prefix and variant)."""
    keys_per_layer = KEYS_PER_LAYER
    found = prefix_table(ctx, keys_per_layer)
    meta = {"keys_per_layer": keys_per_layer, "seed": ctx.seed, "top_t": ctx.top_k,
            "relative_change": "(m' - m) / m, m recomputed on the prefix alone; m <= 0 left out"}
    result = Result(ctx.view.n_layers, record=dict(meta))
    result.add(NAME, found["per_layer"], **meta)
    result.add(f"{NAME}_prefixes", found["prefixes"], **meta)
    latents, unread = ctx.latents_for(f"{NAME}_latents")
    if unread:  # the dictionary is gone or changed: the neurons' tables stand, and say why the latents' are missing
        result.meta[NAME] = {**meta, "warnings": unread}
    if latents is not None:
        prefixes = latent_prefix_table(ctx, latents, keys_per_layer)
        about = {**meta, "relative_change": "(a' - a) / a, the latent's activation a_j recomputed on the prefix "
                                            "alone; a <= 0 left out",
                 "sample": "per dictionary layer, a seeded sample of the latents with trigger examples",
                 "difference": "latents minus the same layer's neurons, 95% interval: normal approximation to "
                               "Welch's"}
        result.add(f"{NAME}_latents", latents_beside(prefixes, found["prefixes"], found["per_layer"], latents),
                   **about)
        result.add(f"{NAME}_latents_prefixes", prefixes, **about)
    return result


# ------------------------------------------------ ablations: the paper's findings, its reading and fidelity rules
#: Table or figure name -> the paper's finding shown beside it (exact names: `ffkv.experiments.registry`).
FINDINGS: dict[str, Finding] = {
    "ablations": Finding("Figure 3", (
        "Removing the last token of a trigger prefix lowers the key's coefficient most; less so in upper "
        "layers. Removing the first or a random token matters much less.")),
}
# The other tables and figures of the study stand beside the finding they belong to.
FINDINGS.update({"ablations_prefixes": FINDINGS["ablations"]})


def reading(name: str, table: pd.DataFrame) -> str | None:
    """Figure 3 on this model: the mean change of the coefficient when the last, the first or a random
    token of the trigger prefix is removed, over the layers; None for its other tables. Layers count from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "ablations" and "mean_change_last" in t:
        def variant(v: str) -> str:
            mean, sem = t[f"mean_change_{v}"], t.get(f"sem_{v}")
            ci = f", 95% CIs within ±{pct(1.96 * sem.max())}" if sem is not None else ""
            return f"{pct(mean.mean())} (per layer {pct(mean.min())} to {pct(mean.max())}{ci})"
        n = f"; n = {n_range(t['n_last'])} prefixes per layer" if "n_last" in t else ""
        return (f"In this model removing the last token changes the key's coefficient by {variant('last')} on "
                f"average over layers, the first token by {variant('first')}, a random one by "
                f"{variant('random')}{n}.")
    return None


def fidelity_rows(name: str, t: pd.DataFrame, projections: Mapping[str, str], label: str = "") -> list[dict]:
    """Figure 3's row of metrics/fidelity.parquet: removing a trigger prefix's last token lowers the
    coefficient more than removing its first or a random one (`ffkv.presentation.findings.verdict_row`)."""
    rows: list[dict] = []
    tt, L, first, last = rule_frame(t)
    if name == "ablations" and {"mean_change_last", "mean_change_first", "mean_change_random"} <= set(t.columns):
        last_, first_, rand = (float(t[c].mean()) for c in ("mean_change_last", "mean_change_first",
                                                              "mean_change_random"))
        rows.append(verdict_row(
            "ablations", "Figure 3",
            f"mean change removing the last token {pct(last_)}, the first {pct(first_)}, a random one "
            f"{pct(rand)} (mean over layers)",
            "removing the last token lowers the coefficient more than removing the first or a random one "
            "(means over layers)", bool(last_ < first_ and last_ < rand), n_of(tt, "n_last"),
            "removing the first or a random token is the comparison", "trigger prefixes"))
    return verdict_rows(rows, {k: f.finding for k, f in FINDINGS.items()}, name, projections.get(name, ""), label)



EXPERIMENT = Experiment(
    name=NAME, title="Local modifications of trigger prefixes (paper Figure 3)", section="paper Section 3.2, Figure 3",
    order=2, compute=compute, draw=draw,
    own_pass="the sampled keys' trigger prefixes and their modified copies, each run alone: text no other study runs",
    encoder=Encoder(False, "Figure 3", "not computed: it recomputes the coefficient on the prefix alone and removes "
                    "its last token, but an encoder's trigger coefficient is read over the whole example and its last "
                    "prefix token is the trigger token itself; the figure measures nothing the paper's does"),
    latents="ablations_latents, ablations_latents_prefixes: Figure 3 for a seeded sample of the latents that fired "
            "(their activation recomputed on each trigger prefix with its first, last or a random token removed), "
            "each variant's mean change beside the same layer's neurons, with the difference and its 95% interval",
    findings=FINDINGS, fidelity_tables=(NAME,), fidelity=fidelity_rows, reading=reading,
    reading_rows={f"{NAME}_latents": 30}, module=__name__)
