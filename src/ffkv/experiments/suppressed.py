"""Suppressed memories (docs/definitions.md): an active memory "knew" the gold token, yet the model got it wrong.

On the held-out examples at their seeded position (the positions of docs/definitions.md), with g the
gold token (the next token; the masked token for an encoder) and o the model's prediction:

- a memory i of layer l **knows** g when it is active (`ffkv.memories.active`, the same s_l as
  composition: the RMS at the analysed positions) and its own sub-update m_i·v_i, sign kept,
  ranks g first: argmax N(m_i·v_i)·Eᵀ = g under the values projection (a negative memory's top
  token is the bottom token of v_i·Eᵀ);
- **suppressed rate** of a layer: the share of examples with o ≠ g where some memory of the layer
  knows g (n = those examples, a 95% Wilson interval); the same share where o = g is given beside
  it, as the base rate;
- **delta_p** of a knowing memory: how much its update alone moves the gold token at its layer,
  p(resid_mid + m_i·v_i)[g] - p(resid_mid)[g], both under the residual projection (final
  normalization by default; docs/definitions.md says why this and not a switched-off forward pass).

A separate pass of its own (coefficients, resid_mid and the LM head's input at the seeded positions),
reduced at once: per example and layer, the number of knowing memories and, for the strongest
(largest delta_p), its key, coefficient and delta_p.

**Latents** (a run indexed with ``--dictionary``): `LatentKnowingReader` reads the same pass at the layers the
dictionary covers: a firing latent (a_j > 0) knows the gold token when its a_j·d_j ranks it first. As for the
neurons there is no random-direction control here; the null of each kind is its own base rate where the model
is right, and latents and neurons are set side by side on the same wrong examples (a paired difference).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ffkv.experiments.common import RunContext, as_numpy, sample_size_warnings, share_with_interval
from ffkv.experiments.figures import interval_bars, layer_axis, legend_outside, new_figure
from ffkv.experiments.heldout import active_threshold, memory_predictions, read_held_out
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.experiments.values import latent_value_tokens, value_tokens
from ffkv.memories.active import RULE, active, active_fraction
from ffkv.memories.projection import final_logits
from ffkv.memories.projection import logits as project
from ffkv.parallel import gather_rows
from ffkv.presentation.findings import layer_ends, pct, share_ci
from ffkv.presentation.intervals import paired_mean_interval
from ffkv.presentation.style import layer_number

NAME = "suppressed"
#: Rows of the examples table (the strongest knowing memory of each wrong example and layer), most delta_p first.
N_EXAMPLES = 200


@torch.no_grad()
def knowing(view, layer: int, m: torch.Tensor, active_mask: torch.Tensor, gold: torch.Tensor, projection: str,
            tops: torch.Tensor | None = None, bottoms: torch.Tensor | None = None, memories=None) -> torch.Tensor:
    """(B, d_m) whether each active memory's signed sub-update m_i·v_i has the gold token as its top token.

    Under the identity projection the top token of m_i·v_i·Eᵀ is v_i's top token (m_i > 0) or bottom token
    (m_i < 0): `tops`, `bottoms` (d_m,); under a normalization, or without them, each active sub-update is
    projected. `memories`: whose values (default the neurons; a dictionary's `Latents`)."""
    if projection == "identity" and tops is not None:
        return active_mask & torch.where(m > 0, tops[None, :] == gold[:, None], bottoms[None, :] == gold[:, None])
    out = torch.zeros_like(active_mask)
    for b in range(m.shape[0]):
        keys = torch.nonzero(active_mask[b])[:, 0]
        if len(keys):
            out[b, keys] = memory_predictions(view, layer, m[b], keys, projection, memories) == gold[b]
    return out


@torch.no_grad()
def delta_p(view, layer: int, resid_mid: torch.Tensor, m: torch.Tensor, keys: torch.Tensor, gold: int,
            projection: str, memories=None) -> torch.Tensor:
    """p(resid_mid + m_i·v_i)[gold] - p(resid_mid)[gold] for each memory of `keys`, one position (`memories`:
    whose values, default the neurons)."""
    values = (memories or view).values(layer)
    base = torch.softmax(project(view, resid_mid[None, :], projection), -1)[0, gold]
    moved = resid_mid[None, :] + m[keys, None].to(values.dtype) * values[keys]
    return torch.softmax(project(view, moved, projection), -1)[:, gold] - base


class KnowingReader:
    """The study's reduction of the shared held-out pass (`ffkv.experiments.heldout.read_held_out`): per held-out
    example (rows) and layer (columns) the knowing memories, the strongest one and its delta_p; per example the
    model's prediction, its probability of gold and gold's rank."""

    quantities = ("coefficients", "resid_mid", "resid_post", "head_in")

    def __init__(self, ctx: RunContext) -> None:
        view, held = ctx.view, ctx.held_out()
        L, N = view.n_layers, len(held.examples)
        self.view, self.held, self.L = view, held, L
        self.pv, self.pr = ctx.projections.values, ctx.projections.residuals
        self.threshold = active_threshold(ctx)
        self.tokens = [value_tokens(ctx, layer) for layer in range(L)] if self.pv == "identity" else None
        self.out = {"n_knowing": np.zeros((N, L), np.int32), "best_key": np.full((N, L), -1, np.int32),
                    "best_coefficient": np.zeros((N, L), np.float32),
                    "best_delta_p": np.full((N, L), np.nan, np.float32),
                    "sum_delta_p": np.zeros((N, L), np.float64), "n_active": np.zeros((N, L), np.int32),
                    "final": np.zeros(N, np.int64), "gold_prob": np.zeros(N, np.float32),
                    "gold_rank": np.zeros(N, np.int64)}

    @torch.no_grad()
    def read(self, idx: np.ndarray, state: dict) -> None:
        """One batch of the pass: `state` holds its examples' analysed positions."""
        view, out, L, tokens = self.view, self.out, self.L, self.tokens
        z = final_logits(view, state.get(("head_in", -1)), state[("resid_post", L - 1)])
        gold = torch.as_tensor(self.held.targets[idx], device=view.device)
        out["final"][idx] = as_numpy(z.argmax(-1))
        out["gold_prob"][idx] = as_numpy(torch.softmax(z, -1).gather(1, gold[:, None])[:, 0])
        out["gold_rank"][idx] = as_numpy((z > z.gather(1, gold[:, None])).sum(-1) + 1)
        for layer in range(L):
            m = state[("coefficients", layer)]
            act = active(m, float(self.threshold[layer]))
            tops = bottoms = None
            if tokens is not None:
                tops = torch.as_tensor(tokens[layer][0], device=view.device)
                bottoms = torch.as_tensor(tokens[layer][1], device=view.device)
            know = knowing(view, layer, m, act, gold, self.pv, tops, bottoms)
            out["n_active"][idx, layer] = as_numpy(act.sum(-1))
            out["n_knowing"][idx, layer] = as_numpy(know.sum(-1))
            for b in torch.nonzero(know.any(-1))[:, 0].tolist():
                keys = torch.nonzero(know[b])[:, 0]
                dp = delta_p(view, layer, state[("resid_mid", layer)][b], m[b], keys, int(gold[b]), self.pr)
                best = int(dp.argmax())
                row = idx[b]
                out["best_key"][row, layer] = int(keys[best])
                out["best_coefficient"][row, layer] = float(m[b, keys[best]])
                out["best_delta_p"][row, layer] = float(dp[best])
                out["sum_delta_p"][row, layer] = float(dp.double().sum())

    def result(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """What `capture` returns, once every batch is read (`rows`: this rank's examples)."""
        out = gather_rows(self.out, rows)
        out["threshold"] = np.asarray(self.threshold, dtype=float)
        return out


class LatentKnowingReader:
    """The study for a dictionary's latents, from the same shared held-out pass: per held-out example (rows) and
    dictionary layer, the firing latents (a_j > 0, docs/definitions.md) whose own sub-update a_j·d_j ranks the gold
    token first, and the largest delta_p among them. A run without latents, or whose dictionary is gone or changed
    (`unread` says why), reads nothing."""

    def __init__(self, ctx: RunContext) -> None:
        view, held = ctx.view, ctx.held_out()
        self.view, self.held = view, held
        self.latents, self.unread = ctx.latents_for(f"{NAME}_latents")
        self.layers = self.latents.layers if self.latents is not None else []
        self.quantities = tuple(dict.fromkeys(("resid_mid", *(self.latents.reads(layer) for layer in self.layers))))\
            if self.layers else ()
        self.pv, self.pr = ctx.projections.values, ctx.projections.residuals
        # a_j > 0: under the identity a firing latent's sub-update has its decoder row's top token
        self.tops = {layer: torch.as_tensor(latent_value_tokens(ctx, self.latents, layer), device=view.device)
                     for layer in self.layers} if self.pv == "identity" else {}
        N = len(held.examples)
        self.out = {}
        for layer in self.layers:
            self.out[f"{layer}/n_knowing"] = np.zeros(N, np.int32)
            self.out[f"{layer}/n_active"] = np.zeros(N, np.int32)
            self.out[f"{layer}/best_delta_p"] = np.full(N, np.nan, np.float32)

    @torch.no_grad()
    def read(self, idx: np.ndarray, state: dict) -> None:
        view, out = self.view, self.out
        gold = torch.as_tensor(self.held.targets[idx], device=view.device)
        for layer in self.layers:
            a = self.latents.coefficients(layer, state[(self.latents.reads(layer), layer)])
            act = a > 0
            tops = self.tops.get(layer)
            know = knowing(view, layer, a, act, gold, self.pv, tops, tops, memories=self.latents)
            out[f"{layer}/n_active"][idx] = as_numpy(act.sum(-1))
            out[f"{layer}/n_knowing"][idx] = as_numpy(know.sum(-1))
            for b in torch.nonzero(know.any(-1))[:, 0].tolist():
                keys = torch.nonzero(know[b])[:, 0]
                dp = delta_p(view, layer, state[("resid_mid", layer)][b], a[b], keys, int(gold[b]), self.pr,
                             memories=self.latents)
                out[f"{layer}/best_delta_p"][idx[b]] = float(dp.max())

    def result(self, rows: np.ndarray) -> tuple[dict[int, dict[str, np.ndarray]], list[str]]:
        """(dictionary layer -> {n_knowing, n_active, best_delta_p} per example, the lines saying why nothing was
        read)."""
        got = gather_rows(self.out, rows) if self.out else {}
        return {layer: {k: got[f"{layer}/{k}"] for k in ("n_knowing", "n_active", "best_delta_p")}
                for layer in self.layers}, self.unread


def latent_table(ctx: RunContext, cap: dict[str, np.ndarray]) -> tuple[pd.DataFrame, list[str]]:
    """Per dictionary layer, the suppressed rate of the latents beside the same layer's neurons on the same
    examples: each kind's rate where the model is wrong and its base rate where it is right (95% Wilson), and
    latents minus neurons on the wrong examples (paired, mean +- 1.96 standard errors)."""
    found, unread = read_held_out(ctx, LatentKnowingReader)
    gold = ctx.held_out().targets
    wrong = cap["final"] != gold
    rows = []
    for layer, got in found.items():
        mine, theirs = got["n_knowing"] > 0, cap["n_knowing"][:, layer] > 0
        best = got["best_delta_p"][wrong & mine]
        mean, low, high = paired_mean_interval(mine[wrong].astype(np.float64) - theirs[wrong])
        rows.append({"layer": int(layer), "n_latents": int(ctx.memories("latents").size(layer)),
                     **share_with_interval(mine[wrong], "suppressed_rate"),
                     **share_with_interval(mine[~wrong], "knowing_rate_correct"),
                     **share_with_interval(theirs[wrong], "suppressed_rate_neurons"),
                     **share_with_interval(theirs[~wrong], "knowing_rate_correct_neurons"),
                     "suppressed_rate_minus_neurons": mean, "suppressed_rate_minus_neurons_ci_low": low,
                     "suppressed_rate_minus_neurons_ci_high": high,
                     "n_wrong": int(wrong.sum()), "n_correct": int((~wrong).sum()),
                     "mean_knowing": float(got["n_knowing"][wrong].mean()) if wrong.any() else float("nan"),
                     "mean_best_delta_p": float(best.mean()) if len(best) else float("nan"),
                     "mean_active": float(got["n_active"].mean()), "n_examples": int(len(wrong))})
    return pd.DataFrame(rows), unread


def capture(ctx: RunContext) -> dict[str, np.ndarray]:
    """Per held-out example (rows) and layer (columns): knowing memories, the strongest one, its delta_p;
    per example the model's prediction, its probability of gold and gold's rank. Read from the held-out pass that
    composition and refinement read too (`read_held_out`): one forward pass for all of them."""
    return read_held_out(ctx, KnowingReader)


def per_layer(cap: dict[str, np.ndarray], gold: np.ndarray) -> pd.DataFrame:
    wrong = cap["final"] != gold
    N, L = cap["n_knowing"].shape
    rows = []
    for layer in range(L):
        knows = cap["n_knowing"][:, layer] > 0
        n_know = cap["n_knowing"][wrong, layer]
        total = int(n_know.sum())
        best = cap["best_delta_p"][wrong & knows, layer]
        rows.append({
            "layer": layer, **share_with_interval(knows[wrong], "suppressed_rate"), "n_wrong": int(wrong.sum()),
            **share_with_interval(knows[~wrong], "knowing_rate_correct"), "n_correct": int((~wrong).sum()),
            "mean_knowing": float(n_know.mean()) if len(n_know) else float("nan"),
            "n_knowing_memories": total,
            "mean_delta_p": float(cap["sum_delta_p"][wrong, layer].sum() / total) if total else float("nan"),
            "mean_best_delta_p": float(best.mean()) if len(best) else float("nan"),
            "median_best_delta_p": float(np.median(best)) if len(best) else float("nan"),
            "mean_active": float(cap["n_active"][:, layer].mean()), "active_threshold": float(cap["threshold"][layer]),
            "n_examples": N,
        })
    return pd.DataFrame(rows)


def examples(ctx: RunContext, cap: dict[str, np.ndarray], n: int = N_EXAMPLES) -> pd.DataFrame:
    """The strongest knowing memory of each (wrong example, layer), most delta_p first, for reading."""
    held = ctx.held_out()
    wrong = cap["final"] != held.targets
    rows = []
    for i, layer in zip(*np.nonzero(wrong[:, None] & (cap["n_knowing"] > 0))):
        e, j = held.examples[i], int(held.positions[i])
        rows.append({"example_id": int(e.example_id), "position": j, "layer": int(layer),
                     "key": int(cap["best_key"][i, layer]), "coefficient": float(cap["best_coefficient"][i, layer]),
                     "delta_p": float(cap["best_delta_p"][i, layer]),
                     "n_knowing": int(cap["n_knowing"][i, layer]),
                     "gold_id": int(held.targets[i]), "prediction_id": int(cap["final"][i]),
                     "gold_rank": int(cap["gold_rank"][i]), "gold_prob": float(cap["gold_prob"][i]),
                     "ids": e.token_ids, "j": j})
    columns = ["example_id", "position", "layer", "key", "coefficient", "delta_p", "n_knowing", "gold_id",
               "prediction_id", "gold_rank", "gold_prob"]
    if not rows:
        return pd.DataFrame(columns=["prefix", "gold", "prediction", *columns])
    table = pd.DataFrame(rows).sort_values(["delta_p", "example_id", "layer"], ascending=[False, True, True],
                                           kind="stable").head(n).reset_index(drop=True)
    table.insert(0, "prefix", [_decode(ctx, ids[:j + 1]) for ids, j in zip(table["ids"], table["j"])])
    table.insert(1, "gold", ctx.tokens(table["gold_id"]))
    table.insert(2, "prediction", ctx.tokens(table["prediction_id"]))
    return table[["prefix", "gold", "prediction", *columns]].astype({"key": np.int32, "layer": np.int16})


def _decode(ctx: RunContext, ids) -> str:
    try:
        return ctx.tokenizer.decode([int(t) for t in ids])
    except Exception:  # noqa: BLE001
        return "".join(ctx.tokens(ids))


def draw(result: Result) -> Figures:
    """Per layer: how often an active memory ranked the gold token first, where the model was wrong and where it
    was right (the base rate)."""
    table, L = result.tables[NAME], result.n_layers
    x = table["layer"].to_numpy()
    fig, ax = new_figure()
    ax.bar(x - 0.2, 100 * table["suppressed_rate"], width=0.4, color="#C44E52", label="model wrong")
    interval_bars(ax, x - 0.2, table, "suppressed_rate")
    ax.bar(x + 0.2, 100 * table["knowing_rate_correct"], width=0.4, color="#4C72B0", label="model right (base rate)")
    interval_bars(ax, x + 0.2, table, "knowing_rate_correct")
    ax.set_ylabel("% examples: an active memory's\nsub-update ranks the gold token first")
    n_wrong = int(table["n_wrong"].iloc[0]) if len(table) else 0
    ax.set_title(f"Suppressed memories ({result.meta[NAME]['projection']} projection; n = {n_wrong:,} wrong, "
                 f"{int(table['n_correct'].iloc[0]) if len(table) else 0:,} right examples)")
    layer_axis(ax, L)
    legend_outside(ax)
    return {NAME: fig}


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/suppressed (per layer) and suppressed_examples."""
    cap = capture(ctx)
    held = ctx.held_out()
    table = per_layer(cap, held.targets)
    tau = active_fraction(ctx.view)
    n_wrong = int((cap["final"] != held.targets).sum())
    meta = {"projection": ctx.projections.values, "residual_projection": ctx.projections.residuals,
            "projection_choice": ctx.projections.name,
            "active": "m_i > 0 (tau = 0: no coefficient of this model can be negative)" if tau == 0 else
            f"{RULE}; tau = {tau:g}", "active_threshold": [float(t) for t in cap["threshold"]],
            "memory_prediction": "argmax of N(m_i·v_i)·Eᵀ, sign kept, values projection",
            "suppressed": "share of held-out examples whose model prediction is not the gold token where some active "
                          "memory of the layer ranks the gold token first (n = n_wrong)",
            "delta_p": "p(resid_mid + m_i·v_i)[gold] - p(resid_mid)[gold] under the residual projection, at the "
                       "memory's own layer",
            "final_prediction": "argmax of the model's own output logits",
            "interval": "95% Wilson score interval", "n_examples": len(held.examples), "n_wrong": n_wrong,
            "eval_corpus": held.spec.to_dict(), "position_seed": ctx.seed,
            "warnings": sample_size_warnings(NAME, n_wrong, "examples the model gets wrong")}
    result = Result(ctx.view.n_layers, record={k: v for k, v in meta.items() if k != "warnings"})
    result.add(NAME, table, **meta)
    result.add(f"{NAME}_examples", examples(ctx, cap), **meta)
    if ctx.has_latents:
        table, unread = latent_table(ctx, cap)
        if unread:  # the dictionary's files are gone or changed: the neurons' tables stand, and say so
            result.meta[NAME] = {**meta, "warnings": [*meta["warnings"], *unread]}
        else:
            meta_lat = {
                **meta, "memories": "the latents of the dictionary the run was indexed with (key: encoder row, value: "
                                    "decoder row), only the layers it covers, read in the shared held-out pass",
                "active": f"latents: a_j > 0 (docs/definitions.md); neurons: {meta['active']}",
                "memory_prediction": "argmax of N(a_j·d_j)·Eᵀ for a latent, of N(m_i·v_i)·Eᵀ, sign kept, for a "
                                     "neuron; values projection",
                "beside_neurons": "*_neurons: the same layer's neurons on the same examples; "
                                  "suppressed_rate_minus_neurons: latents minus neurons over the wrong examples "
                                  "(paired, mean +- 1.96 standard errors); the base rate where the model is right "
                                  "(knowing_rate_correct*) is each kind's null"}
            result.add(f"{NAME}_latents", table, **meta_lat)
    return result


# ------------------------------------------------ suppressed: the paper's findings, its reading and fidelity rules
#: The paper's finding (or the reference's) beside its figure and every table of the study.
FINDING = Finding("Beyond the paper", (
    "The paper names it as open. Where the model's prediction is wrong, how often an "
    "active memory's own sub-update ranked the gold next token first, and how much it moved the gold "
    "token's probability."))
FINDINGS = {NAME: FINDING, f"{NAME}_examples": FINDING, f"{NAME}_latents": Finding("Beyond the paper", (
    "The same question for the latents of a sparse dictionary of the layer, beside the neurons of that layer on "
    "the same examples, each against its own base rate where the model is right."))}


def reading(name: str, table: pd.DataFrame) -> str | None:
    """Suppressed memories on this model: where the prediction is wrong, how often an active memory's
    sub-update ranked the gold token first, in the first and last layers; None for its other tables. Layers count
    from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "suppressed" and "suppressed_rate" in t:
        top = t.loc[t["suppressed_rate"].idxmax()]
        return (f"In this model, where the prediction is wrong, an active memory's sub-update ranks the gold token "
                f"first in {share_ci(first.suppressed_rate, first.n_wrong)} of examples in {n_first} and "
                f"{share_ci(last.suppressed_rate, last.n_wrong)} in {n_last} (highest: layer "
                f"{layer_number(top.layer)}, {pct(top.suppressed_rate)}).")
    if name == f"{NAME}_latents" and "suppressed_rate_neurons" in t:
        return " ".join(
            f"Layer {layer_number(r.layer)}, where the prediction is wrong a firing latent ranks the gold token first "
            f"in {share_ci(r.suppressed_rate, r.n_wrong)} of examples (where it is right: "
            f"{pct(r.knowing_rate_correct)}); an active neuron in {share_ci(r.suppressed_rate_neurons, r.n_wrong)} "
            f"(where right: {pct(r.knowing_rate_correct_neurons)}); latents minus neurons "
            f"{100 * r.suppressed_rate_minus_neurons:+.1f} points "
            f"[{100 * r.suppressed_rate_minus_neurons_ci_low:+.1f}, {100 * r.suppressed_rate_minus_neurons_ci_high:+.1f}]."
            for r in t.itertuples(index=False))
    return None


EXPERIMENT = Experiment(
    name=NAME, title="Suppressed memories: an active memory knew the gold token (beyond the paper)",
    section="beyond the paper", order=7, compute=compute, draw=draw, held_out=True,
    held_out_reader=(KnowingReader, LatentKnowingReader),
    latents=("suppressed_latents: how often a firing latent's own sub-update ranks the gold token first where the "
             "model is wrong, beside its base rate where it is right and beside the layer's neurons on the same "
             "examples"),
    encoder=Encoder(True, "suppressed memories (beyond the paper)", "at the masked held-out position, the gold token "
                    "being the masked one"),
    findings=FINDINGS, reading=reading, reading_rows={f"{NAME}_examples": 12}, module=__name__)
