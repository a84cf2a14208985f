"""Confidence-regulation and GLU classes of memories (beyond the paper: Stolfo et al. 2024; Gerstner and Schütze 2025).

Built on the vocabulary moments and null-space shares of `ffkv.experiments.vocabulary_classes` (their owner: read
from its per-key table, never computed again). For each memory i of layer l, v_i its value:

- **entropy memories** (Stolfo et al. 2024). A *candidate* has a large value (‖v_i‖ above the layer's
  `NORM_QUANTILE` quantile), a low variance of its vocabulary cosines (below the layer's `VARIANCE_QUANTILE`
  quantile) and most of its value in the unembedding's null space (share above `NULL_SPACE_MOST` in the k ≈ d/100
  bottom singular directions). Up to `MAX_MEASURED` candidates per layer (largest ‖v_i‖ · share first) are then
  measured on the held-out examples, at each one's analysed position, under mean ablation (m_i set to its mean over
  those positions, at every position): the **total effect** TE = mean |Δ loss| of the whole model, and the
  **direct effect** DE = mean |Δ loss| when only the final residual changes by (m̄_i − m_i)·v_i, read through the
  final normalization with its scale frozen at the clean value. An entropy memory is a candidate with
  TE ≥ `EFFECT_RATIO` · DE: most of its effect goes through the normalization's scale, not through the logits'
  directions.
- **token-frequency memories** (Stolfo et al. 2024): cos(v_i, f), f the unigram log-frequency direction: the
  counts of the run's corpus tokens, log(1 + count) centred over the vocabulary, mapped into the residual space by
  the prepared unembedding (f = Σ_j (log(1 + c_j) − mean)·u_j). A memory is one when |cos| is above the
  `FREQUENCY_QUANTILE` quantile of the same cosine of the null's random directions (``moves_unigram``); the sign of
  ``unigram_cos`` says whether it raises (+) or lowers (−) the frequent tokens.
- **GLU classes** (Gerstner and Schütze 2025, gated FF layers only), from c_g = cos(gate_i, v_i) and
  c_in = cos(up_i, v_i), a cosine counting as non-zero when |c| > τ = `GLU_Z` / √d (what an isotropic random pair
  exceeds 1% of the time). Read as what the memory does to an input along its own value direction (the gate then
  opens when c_g > 0): ``enrichment`` (c_g > τ, c_in > τ: it adds to that direction), ``depletion`` (c_g > τ,
  c_in < −τ: it removes it), ``conditional enrichment`` (c_g < −τ, c_in < −τ) and ``conditional depletion``
  (c_g < −τ, c_in > τ) (the gate nearly closed there: it acts in that direction only on other inputs),
  ``proportional change`` (|c_g| ≤ τ, |c_in| > τ: the gate does not see the direction, the linear part scales
  it), ``orthogonal output`` (|c_in| ≤ τ).

Every per-layer share has its 95% Wilson interval and stands beside the same rule on `vocabulary_classes`'s null:
random mixtures of the layer's values (for the entropy memories, the candidate rule only: a random direction has no
coefficient to ablate; for the GLU classes, the random direction in place of v_i).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

from ffkv.errors import FfkvError
from ffkv.experiments import vocabulary_classes as vc
from ffkv.experiments import common
from ffkv.experiments.common import (RunContext, as_numpy, excess_beside_neurons, progress_bar, sample_size_warnings,
                                     share_with_interval)
from ffkv.experiments.figures import kinds_beside, share_curves
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, KeyColumn, Result
from ffkv.memories.controls import layer_generator
from ffkv.memories.interventions import Intervention, intervene
from ffkv.memories.projection import final_logits
from ffkv.memories.sets import Latents, MemorySet, Neurons
from ffkv.memories.view import MemoryView
from ffkv.parallel import gather_rows
from ffkv.presentation.findings import layer_ends, pct, share_ci

NAME = "confidence_neurons"
LATENTS = f"{NAME}_latents"
#: Large value: ‖v_i‖ above this quantile of the layer's value norms (ffkv's judgment: Stolfo et al. 2024 pick the
#: entropy neurons among the largest norms of the last layer without a number).
NORM_QUANTILE = 0.9
#: Low vocabulary variance: below this quantile of the layer's (ffkv's judgment, same reason).
VARIANCE_QUANTILE = 0.5
#: "Most of w_out in the unembedding's null space" (the issue's reading of Stolfo et al. 2024): a share above it.
NULL_SPACE_MOST = 0.5
#: Candidates measured on text per layer (the largest ‖v_i‖ · null-space share first).
MAX_MEASURED = 8
#: Entropy memory: total effect at least this many times the direct one (ffkv's judgment of Stolfo et al.'s
#: "far above": at least half of the effect goes through the final normalization, 1 - DE/TE ≥ 0.5).
EFFECT_RATIO = 2.0
#: Token-frequency memory: |cos(v_i, f)| above this quantile of the null's (ffkv's judgment).
FREQUENCY_QUANTILE = 0.99
#: GLU classes: a cosine is non-zero above GLU_Z / sqrt(d) (an isotropic random pair exceeds it 1% of the time;
#: ffkv's judgment, Gerstner and Schütze's own cut-off not confirmed).
GLU_Z = 2.576
CLASSES = ("entropy", "token_frequency")
GLU_CLASSES = ("enrichment", "depletion", "conditional enrichment", "conditional depletion", "proportional change",
               "orthogonal output")


# ------------------------------------------------------------------ weights
def unigram_counts(paths: Iterable, vocab_size: int) -> np.ndarray:
    """(|V|,) how often each token id occurs in the ``token_ids`` column of the given examples tables, read a
    record batch at a time (memory independent of the corpus); ids outside 0..|V|-1 are refused."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(columns=["token_ids"]):
            ids = batch.column(0).flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            bad = ids[(ids < 0) | (ids >= vocab_size)]
            if len(bad):
                raise FfkvError(f"{path}: token id {int(bad[0])} outside the model's vocabulary of {vocab_size}")
            counts += np.bincount(ids, minlength=vocab_size)
    return counts


@torch.no_grad()
def frequency_direction(units: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """(d,) float64 unit vector: Σ_j (log(1 + c_j) − mean)·u_j, `units` the prepared unembedding
    (`vocabulary_classes.prepared_unembedding`)."""
    f = np.log1p(counts.astype(np.float64))
    f = torch.as_tensor(f - f.mean(), dtype=torch.float64)
    direction = torch.zeros(units.shape[1], dtype=torch.float64)
    rows = max(1, vc.BLOCK_ELEMENTS // units.shape[1])
    for start in range(0, units.shape[0], rows):
        block = units[start:start + rows].double().cpu()
        direction += block.T @ f[start:start + rows]
    return direction / direction.norm().clamp_min(1e-300)


def _cos(rows: torch.Tensor, direction: torch.Tensor) -> np.ndarray:
    rows = rows.detach().double().cpu()
    return (rows @ direction / rows.norm(dim=1).clamp_min(1e-300)).numpy()


def glu_classes(c_gate: np.ndarray, c_in: np.ndarray, tau: float) -> np.ndarray:
    """Each memory's GLU class (`GLU_CLASSES`) from cos(gate_i, v_i), cos(up_i, v_i) and the non-zero cut-off τ."""
    c_gate, c_in = np.asarray(c_gate), np.asarray(c_in)
    return np.select([np.abs(c_in) <= tau, np.abs(c_gate) <= tau,
                      (c_gate > 0) & (c_in > 0), (c_gate > 0) & (c_in < 0),
                      (c_gate < 0) & (c_in < 0), (c_gate < 0) & (c_in > 0)],
                     ["orthogonal output", "proportional change", *GLU_CLASSES[:4]], default="orthogonal output")


def glu_tau(d_model: int) -> float:
    """The GLU classes' non-zero cut-off for cosines in d dimensions."""
    return GLU_Z / float(np.sqrt(d_model))


def candidates(keys: pd.DataFrame) -> np.ndarray:
    """Whether each row of one layer's per-key table (value_norm, vocab_var, null_space_share) passes the entropy
    memories' weight rule; the quantiles are the layer's own."""
    norm_cut = np.quantile(keys["value_norm"], NORM_QUANTILE)
    var_cut = np.quantile(keys["vocab_var"], VARIANCE_QUANTILE)
    return ((keys["value_norm"] > norm_cut) & (keys["vocab_var"] < var_cut)
            & (keys["null_space_share"] > NULL_SPACE_MOST)).to_numpy()


# ------------------------------------------------------------------ effects on text
def _frozen_norm(view: MemoryView):
    """delta -> the change of N(h) when h changes by delta with N's scale frozen at h (a function of (h, y, delta)),
    or None where the final normalization is not a LayerNorm or an RMSNorm (its scale cannot be frozen)."""
    norm = view.arch.final_norm(view.model)
    if norm is None:
        return lambda h, y, delta: delta
    weight = getattr(norm, "weight", None)
    if not isinstance(norm, torch.nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    centred = isinstance(norm, torch.nn.LayerNorm)
    if not centred and "rms" not in type(norm).__name__.lower():
        return None
    gamma = weight.detach().double()
    bias = getattr(norm, "bias", None)
    beta = bias.detach().double() if isinstance(bias, torch.Tensor) else 0.0

    def change(h: torch.Tensor, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        h, y, delta = h.double(), y.double(), delta.double()
        if centred:
            h, delta = h - h.mean(-1, keepdim=True), delta - delta.mean(-1, keepdim=True)
        a = gamma * h                                   # y - beta = a / sigma: sigma read from the model's own output
        sigma = (a * a).sum(-1, keepdim=True) / (a * (y - beta)).sum(-1, keepdim=True).clamp_min(1e-300)
        return gamma * delta / sigma
    return change


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none")


@torch.no_grad()
def ablation_effects(ctx: RunContext, memories: list[tuple[int, int]], source: MemorySet | None = None
                     ) -> pd.DataFrame:
    """The total and direct effects of mean-ablating each memory (layer, key) on the held-out examples' loss at
    their analysed positions (module docstring): a coefficient pass for the means, a clean pass for the loss and
    the direct effects, then one pass per memory for the total effect. `source`: whose memories (default the
    model's neurons; a dictionary's `Latents`: a_j set to its mean, the layer's output then the reconstruction
    with that edit plus the dictionary's error term, `ffkv.memories.interventions`).

    Returns one row per memory: layer, key, mean_coefficient, total_effect, direct_effect, n_examples, why; the
    direct effect is NaN (and `why` says why) where the final normalization's scale cannot be frozen or the LM head
    does not read the normalized last residual."""
    from ffkv.experiments.heldout import analysed_positions, held_out_rows

    view, held = ctx.view, ctx.held_out()
    L, N, C = view.n_layers, len(held.examples), len(memories)
    columns = ["layer", "key", "mean_coefficient", "total_effect", "direct_effect", "n_examples", "why"]
    if not memories:
        return pd.DataFrame(columns=columns)
    source = source or Neurons(view)
    frozen = _frozen_norm(view)
    targets = torch.as_tensor(held.targets, device=view.device)
    values = torch.stack([source.values(layer)[key] for layer, key in memories]).double()
    unembedding = view.unembedding.double()
    mine = ctx.batches(held_out_rows(ctx))

    m = np.zeros((N, C))
    reads = tuple(dict.fromkeys(source.reads(layer) for layer, _ in memories))
    for idx, got in analysed_positions(ctx, mine, reads, f"{NAME}: coefficients"):
        m[idx] = as_numpy(torch.stack([source.coefficients(layer, got[(source.reads(layer), layer)])[:, key]
                                       for layer, key in memories], dim=1))
    m = gather_rows(m, mine.rows)
    means = m.mean(axis=0)

    clean, direct, ok = np.zeros(N), np.zeros((N, C)), np.ones(N, dtype=bool)
    for idx, got in analysed_positions(ctx, mine, ("resid_post", "head_in"), f"{NAME}: clean", with_head=True):
        head_in, h = got.get(("head_in", -1)), got[("resid_post", L - 1)]
        logits = final_logits(view, head_in, h).double()
        loss = _loss(logits, targets[idx])
        clean[idx] = as_numpy(loss)
        y = view.final_norm(h.to(view.unembedding.dtype))
        if head_in is not None:  # the head reads N(last residual): what the direct effect assumes
            ok[idx] = as_numpy(torch.isclose(y.double(), head_in.double(), rtol=1e-3, atol=1e-4).all(-1))
        if frozen is None:
            continue
        for c in range(C):
            delta = torch.as_tensor(means[c] - m[idx, c], device=view.device)[:, None] * values[c]
            shifted = logits + frozen(h, y, delta) @ unembedding.T
            direct[idx, c] = as_numpy((_loss(shifted, targets[idx]) - loss).abs())
    found = gather_rows({"clean": clean, "direct": direct, "ok": ok}, mine.rows)

    total = np.zeros((N, C))
    bar = progress_bar(ctx.progress, C, f"{NAME}: mean ablations", "memory")
    attached = source.attached() if isinstance(source, Latents) else contextlib.nullcontext()
    with attached:
        for c, (layer, key) in enumerate(memories):
            kind = source.dictionaries[layer].kind if isinstance(source, Latents) else "neuron"
            with intervene(view, [Intervention(layer, key, "set", float(means[c]), kind)]):
                for idx, got in analysed_positions(ctx, mine, ("resid_post", "head_in"), f"{NAME}: {layer}:{key}",
                                                   with_head=True):
                    ablated = _loss(final_logits(view, got.get(("head_in", -1)), got[("resid_post", L - 1)]),
                                    targets[idx])
                    total[idx, c] = np.abs(as_numpy(ablated) - found["clean"][idx])
            bar.update(1)
    bar.close()
    total = gather_rows(total, mine.rows)
    why = ("the final normalization is neither a LayerNorm nor an RMSNorm: its scale cannot be frozen"
           if frozen is None else "" if found["ok"].all() else "the LM head does not read the normalized last residual")
    return pd.DataFrame([{"layer": layer, "key": key, "mean_coefficient": float(means[c]),
                          "total_effect": float(total[:, c].mean()),
                          "direct_effect": float("nan") if why else float(found["direct"][:, c].mean()),
                          "n_examples": N, "why": why} for c, (layer, key) in enumerate(memories)], columns=columns)


# ------------------------------------------------------------------ the tables
def _slug(name: str) -> str:
    return name.replace(" ", "_")


def confidence_classes(view: MemoryView, vocab_keys: pd.DataFrame, counts: np.ndarray,
            effects: Callable[[list[tuple[int, int]]], pd.DataFrame] | None = None, seed: int = 0,
            n_control: int = vc.N_CONTROL, progress: bool = False,
            memories: MemorySet | None = None) -> dict[str, pd.DataFrame]:
    """The per-key table (``keys``), the per-layer table (``layers``), the measured candidates (``measured``), and
    per layer the null's random directions judged by the same rules (``controls``: layer -> {"entropy_candidate",
    "token_frequency"} boolean arrays).

    Args:
        vocab_keys: `vocabulary_classes`'s per-key table of these memories (its moments, norms, cosines, shares).
        counts: (|V|,) unigram counts (`unigram_counts`).
        effects: measures candidates on text (`ablation_effects` bound to a run); None: none is measured, so no
            memory is called an entropy memory (the candidates are still marked).
        memories: whose values (default the model's neurons; a dictionary's `Latents`: its decoder rows on the layers
            it covers, the null random mixtures of them, and no GLU classes, which read a gated layer's own rows).
    """
    memories = memories or Neurons(view)
    neurons = isinstance(memories, Neurons)
    units = vc.prepared_unembedding(view)
    basis = vc.null_space(units)
    frequency = frequency_direction(units, counts)
    tau = glu_tau(view.d_model)
    keys_out, layers_out, chosen, null = [], [], [], {}
    bar = progress_bar(progress, len(memories.layers), NAME, "layer")
    for layer in memories.layers:
        size = memories.size(layer)
        own = vocab_keys[vocab_keys["layer"] == layer].sort_values("key").reset_index(drop=True)
        if len(own) != size:
            raise FfkvError(f"{NAME}: the vocabulary classes' table has {len(own)} rows for layer {layer}, not "
                            f"{size}; run `ffkv analyze RUN --only vocabulary_classes,{NAME}`")
        values = memories.values(layer)
        is_candidate = candidates(own)
        cos_f = _cos(values, frequency)
        controls = vc.random_directions(values, layer, n_control, seed)
        control_cos_f = _cos(controls, frequency)
        f_cut = float(np.quantile(np.abs(control_cos_f), FREQUENCY_QUANTILE))
        control_candidate = ((controls.norm(dim=1).numpy() > np.quantile(own["value_norm"], NORM_QUANTILE))
                             & (vc.moments(controls, units)[:, 1] < np.quantile(own["vocab_var"], VARIANCE_QUANTILE))
                             & (vc.null_space_share(controls, basis) > NULL_SPACE_MOST))
        null[layer] = {"entropy_candidate": control_candidate, "token_frequency": np.abs(control_cos_f) > f_cut}
        table = pd.DataFrame({"layer": layer, "key": np.arange(size), "entropy_candidate": is_candidate,
                              "unigram_cos": cos_f, "moves_unigram": np.abs(cos_f) > f_cut,
                              "glu_class": pd.Series([None] * size, dtype=object)})
        ranked = np.flatnonzero(is_candidate)
        ranked = ranked[np.argsort(-(own["value_norm"].to_numpy() * own["null_space_share"].to_numpy())[ranked],
                                   kind="stable")][:MAX_MEASURED]
        chosen += [(layer, int(k)) for k in ranked]
        row = {"layer": layer, "n_keys": size, "n_control": n_control, "unigram_cos_cut": f_cut}
        row.update(share_with_interval(is_candidate, "entropy_candidate_share"))
        row.update(share_with_interval(control_candidate, "entropy_candidate_share_control"))
        row.update(share_with_interval(table["moves_unigram"].to_numpy(), "token_frequency_share"))
        row.update(share_with_interval(np.abs(control_cos_f) > f_cut, "token_frequency_share_control"))
        if view.gated and neurons:
            kinds = glu_classes(own["cos_key_value"], own["cos_up_value"], tau)
            pick = torch.randint(0, view.d_m, (n_control,), generator=layer_generator(seed, layer, salt=31))
            control_kinds = glu_classes(vc._cos_rows(view.keys(layer)[pick], controls),
                                        vc._cos_rows(view.up(layer)[pick], controls), tau)
            table["glu_class"] = kinds
            row["glu_tau"] = tau
            for kind in GLU_CLASSES:
                row.update(share_with_interval(kinds == kind, f"{_slug(kind)}_share"))
                row.update(share_with_interval(control_kinds == kind, f"{_slug(kind)}_share_control"))
        keys_out.append(table)
        layers_out.append(row)
        bar.update(1)
    bar.close()
    keys = pd.concat(keys_out, ignore_index=True)
    measured = effects(chosen) if effects is not None and chosen else pd.DataFrame(
        columns=["layer", "key", "mean_coefficient", "total_effect", "direct_effect", "n_examples", "why"])
    measured = measured.assign(entropy=(measured["total_effect"] >= EFFECT_RATIO * measured["direct_effect"])
                               & (measured["total_effect"] > 0))
    keys = keys.merge(measured[["layer", "key", "total_effect", "direct_effect", "entropy"]], on=["layer", "key"],
                      how="left")
    keys["entropy"] = keys["entropy"].fillna(False).astype(bool)
    keys["class"] = np.select([keys["entropy"], keys["moves_unigram"]], list(CLASSES), default="none")
    layers = pd.DataFrame(layers_out)
    for i, layer in enumerate(layers["layer"]):
        own = keys[keys["layer"] == layer]
        for k, v in share_with_interval(own["entropy"].to_numpy(), "entropy_share").items():
            layers.loc[i, k] = v
        layers.loc[i, "n_measured"] = int(own["total_effect"].notna().sum())
    layers["n_measured"] = layers["n_measured"].astype(int)
    return {"keys": keys, "layers": layers, "measured": measured, "controls": null}


def draw(result: Result) -> Figures:
    """The entropy-candidate, entropy and token-frequency shares per layer with 95% intervals, the null dashed; for a
    gated model the GLU classes' shares."""
    layers = result.tables[NAME]
    figures = {NAME: share_curves(layers, [("entropy_candidate_share", "entropy candidates (weights)", "tab:orange"),
                                           ("entropy_share", "entropy (measured)", "tab:red"),
                                           ("token_frequency_share", "token frequency", "tab:blue")],
                                  "Confidence-regulation memories (Stolfo et al. 2024)",
                                  null="random mixtures of values")}
    if "enrichment_share" in layers:
        colors = ("tab:green", "tab:red", "tab:olive", "tab:purple", "tab:gray", "tab:cyan")
        figures[f"{NAME}_glu"] = share_curves(
            layers, [(f"{_slug(k)}_share", k, c) for k, c in zip(GLU_CLASSES, colors)],
            "GLU classes from cos(gate, value) and cos(up, value) (Gerstner and Schütze 2025)")
    if LATENTS in result.tables and not result.tables[LATENTS].empty:
        figures[LATENTS] = kinds_beside(
            result.tables[LATENTS],
            tuple((kind, f"token_frequency_share_{kind}", f"token_frequency_share_{kind}_control", None)
                  for kind in ("neurons", "latents")),
            "% token-frequency memories",
            "Token-frequency values (|cos(value, unigram direction)| above the null's 99%):\nneurons vs. the "
            "dictionary's latents, each beside random mixtures of its values")
    return figures


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/confidence_neurons (per layer), confidence_neurons_keys and confidence_neurons_measured."""
    # this call's own result where it computed it (every rank has it; under torchrun only rank 0 writes the table)
    vocab_keys = ctx.once((vc.NAME, "keys"), lambda: ctx.need(vc.NAME, f"{vc.NAME}_keys"))
    ctx.run.require_table("examples.parquet")
    counts = unigram_counts([ctx.run.table("examples")], ctx.view.vocab_size)
    found = confidence_classes(ctx.view, vocab_keys, counts, lambda chosen: ablation_effects(ctx, chosen), ctx.seed,
                               progress=ctx.progress)
    meta = {"rule": f"entropy candidate: value norm above the layer's {NORM_QUANTILE:.0%} quantile, vocabulary "
                    f"variance below its {VARIANCE_QUANTILE:.0%} quantile, null-space share above "
                    f"{NULL_SPACE_MOST:g}; entropy: a candidate (the {MAX_MEASURED} largest per layer measured) whose "
                    f"total effect under mean ablation is at least {EFFECT_RATIO:g} times its direct effect (mean "
                    f"|change of the loss| on the held-out examples); token frequency: |cos(value, unigram "
                    f"log-frequency direction)| above the {FREQUENCY_QUANTILE:.0%} quantile of the null's; GLU "
                    f"classes: cosines non-zero above {GLU_Z:g}/sqrt(d)",
            "frequency": f"log(1 + count) of the {int(counts.sum())} tokens of the run's corpus, centred, through "
                         "the prepared unembedding",
            "control": f"{vc.N_CONTROL} random mixtures of the layer's values per layer (vocabulary_classes' null), "
                       f"seed {ctx.seed}",
            "warnings": sample_size_warnings(NAME, ctx.view.d_m, "memories")}
    result = Result(ctx.view.n_layers, record=dict(meta))
    result.add(NAME, found["layers"], **meta)
    result.add(f"{NAME}_keys", found["keys"], **meta)
    result.add(f"{NAME}_measured", found["measured"], **meta)
    latents, unread = ctx.latents_for(LATENTS)
    if unread:  # the dictionary's files are gone or changed: the neurons' tables stand, and say so
        result.meta[NAME] = {**meta, "warnings": [*meta["warnings"], *unread]}
    if latents is not None:
        latent_keys = ctx.need(vc.NAME, f"{vc.NAME}_latents_keys")
        mine = confidence_classes(ctx.view, latent_keys, counts,
                                  lambda chosen: ablation_effects(ctx, chosen, latents), ctx.seed, memories=latents)
        meta_latents = {**meta, "memories": "the decoder rows of the dictionary the run was indexed with, on the "
                        "layers it covers, by the same rules with the latent layer's own quantiles; the null: random "
                        "mixtures of its decoder rows; a candidate measured with a_j set to its mean (the layer's "
                        "output the reconstruction with that edit plus the dictionary's error term)",
                        "neurons": "*_neurons: the same layer's neurons, each kind beside its own null; "
                                   "excess_*_latents_minus_neurons: the latents' excess over their null minus the "
                                   "neurons' over theirs (MOVER 95% interval)", "warnings": []}
        result.add(LATENTS, beside_neurons(mine, found), **meta_latents)
        result.add(f"{LATENTS}_keys", mine["keys"].drop(columns=["glu_class"]), **meta_latents)
        result.add(f"{LATENTS}_measured", mine["measured"], **meta_latents, **(
            {"empty_because": "no latent passed the entropy candidates' weight rule, so none was measured on text"}
            if mine["measured"].empty else {}))
    return result


def beside_neurons(latents: dict, neurons: dict) -> pd.DataFrame:
    """confidence_neurons_latents: per dictionary layer, the latents' entropy-candidate and token-frequency shares
    and the neurons' of that layer, each beside its own null, with the excess difference and its verdict
    (`ffkv.experiments.common.excess_beside_neurons`); the measured entropy memories' shares beside each other."""
    rows = []
    for layer, null in latents["controls"].items():
        mine = latents["keys"][latents["keys"]["layer"] == layer]
        theirs = neurons["keys"][neurons["keys"]["layer"] == layer]
        row = {"layer": int(layer), "n_latents": len(mine), "n_neurons": len(theirs),
               "n_measured_latents": int(mine["total_effect"].notna().sum()),
               "n_measured_neurons": int(theirs["total_effect"].notna().sum())}
        for name, column in (("entropy_candidate", "entropy_candidate"), ("token_frequency", "moves_unigram")):
            row.update(excess_beside_neurons(mine[column].to_numpy(bool), null[name], theirs[column].to_numpy(bool),
                                             neurons["controls"][layer][name], f"{name}_share"))
        row.update(share_with_interval(mine["entropy"].to_numpy(bool), "entropy_share"))
        row.update(common.beside_neurons(mine["entropy"].to_numpy(bool), theirs["entropy"].to_numpy(bool),
                                         "entropy_share"))
        rows.append(row)
    return pd.DataFrame(rows)


FINDING = Finding("Beyond the paper", (
    "Stolfo et al. 2024: entropy neurons (large norm, most of the value in the unembedding's "
    "null space, acting through the final normalization's scale) sit in the last layer (GPT-2 small: 11.584, "
    "11.2378, 11.2870, 11.2123, 11.1611, 11.2910); token-frequency neurons move the prediction along the unigram "
    "log-frequency direction. Gerstner and Schütze 2025: in gated FF layers enrichment neurons dominate the early "
    "and middle layers, depletion neurons the late ones."))
FINDING_LATENTS = Finding("Beyond the paper", (
    "The same confidence-regulation classes for a sparse dictionary's decoder rows, beside the layer's neurons: "
    "does the dictionary isolate entropy or token-frequency directions more often than the neurons do, each kind "
    "beyond random mixtures of its own values?"))
FINDINGS = {NAME: FINDING, f"{NAME}_keys": FINDING, f"{NAME}_measured": FINDING, f"{NAME}_glu": FINDING,
            LATENTS: FINDING_LATENTS, f"{LATENTS}_keys": FINDING_LATENTS, f"{LATENTS}_measured": FINDING_LATENTS}


def reading(name: str, table: pd.DataFrame) -> str | None:
    """The entropy and token-frequency shares of the last layer against the null's (and the GLU classes' ends)."""
    if name == LATENTS and "token_frequency_share_latents" in table:
        return " ".join(
            f"Layer {int(r.layer) + 1}: token-frequency latents {share_ci(r.token_frequency_share_latents, r.n_latents)}"
            f" (their null {pct(r.token_frequency_share_latents_control)}) against neurons "
            f"{share_ci(r.token_frequency_share_neurons, r.n_neurons)} (null {pct(r.token_frequency_share_neurons_control)})"
            f": {r.verdict_token_frequency_share}; entropy candidates {pct(r.entropy_candidate_share_latents)} of latents "
            f"against {pct(r.entropy_candidate_share_neurons)} of neurons: {r.verdict_entropy_candidate_share}; "
            f"measured entropy memories {int(round(r.entropy_share * r.n_latents))} of {int(r.n_measured_latents)} "
            f"latents measured, {int(round(r.entropy_share_neurons * r.n_neurons))} of {int(r.n_measured_neurons)} "
            "neurons." for r in table.sort_values("layer").itertuples())
    if name != NAME or "entropy_share" not in table:
        return None
    t, first, last, n_first, n_last = layer_ends(table)
    text = (f"In {n_last} of this model {share_ci(last.entropy_share, last.n_keys)} of the memories are entropy "
            f"memories ({int(last.n_measured)} measured; candidates by the weights: "
            f"{share_ci(last.entropy_candidate_share, last.n_keys)}, random mixtures of values: "
            f"{pct(last.entropy_candidate_share_control)}) and "
            f"{share_ci(last.token_frequency_share, last.n_keys)} token-frequency memories (null: "
            f"{pct(last.token_frequency_share_control)}).")
    if "enrichment_share" in table:
        text += (f" Enrichment: {share_ci(first.enrichment_share, first.n_keys)} in {n_first}, "
                 f"{share_ci(last.enrichment_share, last.n_keys)} in {n_last}; depletion: "
                 f"{share_ci(first.depletion_share, first.n_keys)} and {share_ci(last.depletion_share, last.n_keys)}.")
    return text


EXPERIMENT = Experiment(
    name=NAME, title="Entropy, token-frequency and GLU classes of memories (beyond the paper)",
    section="beyond the paper: Stolfo et al. 2024, Gerstner and Schütze 2025", order=6.6, compute=compute, draw=draw,
    own_pass=("one held-out pass per measured candidate with that memory mean-ablated (its total effect): a changed "
              "model each time"),
    needs=("vocabulary_classes",), held_out=True,
    encoder=Encoder(False, "confidence classes (beyond the paper)", "not computed: they read the vocabulary classes, "
                    "which an encoder does not have"),
    latents=(f"{LATENTS}, {LATENTS}_keys, {LATENTS}_measured: the decoder rows' entropy candidates, measured entropy memories and "
             "token-frequency directions, each kind beside its own null and the neurons of the layer"),
    findings=FINDINGS, reading=reading, how=("rule", "frequency", "control"),
    key_columns=(KeyColumn(f"{NAME}_keys", "class", "confidence class", "confidence class"),
                 KeyColumn(f"{NAME}_keys", "glu_class", "GLU class", "GLU class")),
    module=__name__)
