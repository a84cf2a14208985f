"""Projection spaces: where the shared vocabulary space holds (docs/definitions.md, fitted translators).

Fits a per-layer affine translator (the tuned lens, `ffkv.memories.translators`) on the run's own
indexed examples (its training split; a seeded subset of `N_TRAIN`, every position), saves it in
RUN/translators/translators.npz, then on the held-out examples:

- translators (table and figure translators_kl): per layer, KL(p_final || p_l) of resid_mid[l] under
  the identity, final-norm and translator projections, the mean over held-out examples of each
  example's mean over its positions, with a 95% normal interval over examples;
- translators_spaces: Figures 4 and 9-11's per-layer numbers (value agreement and its target rank;
  residual agreement, confidence, kept / override / composition) under the three projections side by
  side, each from the experiment's own code path with the projection as a parameter
  (`ffkv.experiments.values.compute`, the shared held-out pass of `ffkv.experiments.heldout`);
- translators_findings: the fidelity rules (`ffkv.experiments.fidelity`) of Figures 4, 9-11
  evaluated under each projection, and whether the verdict changes under the translators.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

from ffkv.batching import row_batches
from ffkv.experiments import refinement, values
from ffkv.experiments.common import RunContext, progress_bar, sample_size_warnings
from ffkv.experiments.fidelity import fidelity
from ffkv.experiments.figures import legend_outside, layer_axis, new_figure
from ffkv.experiments.heldout import capture_eval
from ffkv.experiments.registry import Encoder, Experiment, Figures, Result
from ffkv.memories.projection import PROJECTIONS, TRANSLATOR, chunk_size, unembed_logits
from ffkv.memories.projection import logits as project
from ffkv.memories.translators import (EPOCHS, LEARNING_RATE, MIN_STEPS, RUN_FILE, Translators, fit_translators,
                                       kl_rows, mean_interval)
from ffkv.parallel import is_writer
from ffkv.store.atomic import write_json

NAME = "translators"
#: Training examples (a seeded subset of the run's indexed examples).
N_TRAIN = 1000
#: Projections compared, in the order shown.
SPACES = (*PROJECTIONS, TRANSLATOR)
#: Chunk of positions whose |V| logits are made at once while fitting (a sixth of the projection's
#: budget: the autograd graph of one chunk holds a few such buffers).
FIT_CHUNK_BYTES = 64 * 2**20
COLORS = {"identity": "#8C8C8C", "final-norm": "#4C72B0", TRANSLATOR: "#C44E52"}


def translators_path(ctx: RunContext):
    return ctx.run.path / RUN_FILE


def _train_rows(ctx: RunContext) -> tuple[list[tuple[int, np.ndarray]], np.ndarray]:
    """(row, token ids) of a seeded subset of the run's indexed examples, and their example ids."""
    table = pq.read_table(ctx.run.table("examples"), columns=["example_id", "token_ids"])
    ids = table.column("example_id").to_numpy()
    rng = np.random.default_rng(ctx.seed)
    keep = np.sort(rng.choice(len(ids), size=min(N_TRAIN, len(ids)), replace=False))
    tokens = table.column("token_ids").to_pylist()
    return [(i, np.asarray(tokens[j], dtype=np.int64)) for i, j in enumerate(keep)], ids[keep]


def _stream(ctx: RunContext, rows, every_rank: bool):
    """Per batch: (row indices, row of each position, resid_mid (L, n, d) at every real position, head_in (n, d))."""
    view = ctx.view
    L = view.n_layers
    state: dict = {}

    def sink(name: str, layer: int, t: torch.Tensor) -> None:
        state[(name, layer)] = t[state["mask"]]

    batches = row_batches(rows, ctx.tokenizer.pad_id, ctx.special_ids, view.device, every_rank=every_rank)
    with view.capture(("resid_mid", "head_in"), sink=sink):
        for idx, batch in batches:
            state.clear()
            state["mask"] = batch.attention_mask.bool()
            view.forward(batch.input_ids, batch.attention_mask, with_head=True)
            owner = torch.arange(len(idx), device=view.device)[:, None].expand_as(state["mask"])[state["mask"]]
            resid = torch.stack([state[("resid_mid", layer)].float() for layer in range(L)])
            yield idx, owner, resid, state[("head_in", -1)]


def fit(ctx: RunContext) -> Translators:
    """Fit the translators on the training subset and save them in the run (rank 0 writes)."""
    view = ctx.view
    rows, example_ids = _train_rows(ctx)
    chunk = chunk_size(view.vocab_size, FIT_CHUNK_BYTES)
    n_tokens = sum(len(t) for _, t in rows)
    n_batches = len(row_batches(rows, ctx.tokenizer.pad_id, ctx.special_ids, view.device, every_rank=True).groups)
    epochs = max(EPOCHS, math.ceil(MIN_STEPS / max(n_batches, 1)))
    bar = progress_bar(ctx.progress, epochs * n_tokens, "translators: fit", "tok")

    def stream():
        for _, _, resid, head_in in _stream(ctx, rows, every_rank=True):
            yield resid, (lambda part, h=head_in: view.final_logits(h[part]))

    try:
        fitted = fit_translators(stream, lambda x: unembed_logits(view, x.to(view.unembedding.dtype), True),
                                 view.n_layers, view.d_model, chunk, epochs, LEARNING_RATE, view.device,
                                 progress=bar.update)
    finally:
        bar.close()
    fitted.info.update({
        "fitted_on": {"table": "examples", "n_examples": len(rows), "seed": ctx.seed,
                      "example_ids_first": [int(i) for i in example_ids[:20]], "positions": "every position",
                      "corpus": ctx.manifest.identity.corpus},
        "model_id": ctx.loaded.model_id, "weights_sha256": ctx.manifest.identity.weights_sha256,
        "final_norm_after_translator": True, "chunk_positions": chunk,
        "values": "updates (values, sub-updates, FF outputs) use A_l without b_l"})
    if is_writer():
        paths = [fitted.save(translators_path(ctx)), translators_path(ctx).with_suffix(".json")]
        write_json(paths[1], fitted.info)
        manifest = ctx.run.manifest()
        for path in paths:  # recorded as a figure is: `ffkv status` and the explorer check them
            ctx.run.record_file(manifest, path, NAME)
        ctx.run.write_manifest(manifest)
    return fitted


@torch.no_grad()
def kl_to_final(ctx: RunContext) -> tuple[pd.DataFrame, np.ndarray]:
    """Per layer and projection: the mean KL(p_final || p_l(resid_mid)) over held-out examples (each example's
    mean over its positions) with a 95% interval; and the per-example means (N, projections, L)."""
    view, held = ctx.view, ctx.held_out()
    L, N = view.n_layers, len(held.examples)
    rows = [(i, np.asarray(e.token_ids, dtype=np.int64)) for i, e in enumerate(held.examples)]
    sums = np.zeros((N, len(SPACES), L))
    counts = np.zeros(N)
    chunk = chunk_size(view.vocab_size)
    bar = progress_bar(ctx.progress, N, "translators: KL", "ex")
    for idx, owner, resid, head_in in _stream(ctx, rows, every_rank=True):
        owner_np = owner.cpu().numpy()
        counts[idx] += np.bincount(owner_np, minlength=len(idx))
        for start in range(0, len(owner_np), chunk):
            part = slice(start, start + chunk)
            target = view.final_logits(head_in[part])
            who = idx[owner_np[part]]
            for p, name in enumerate(SPACES):
                for layer in range(L):
                    kl = kl_rows(target, project(view, resid[layer, part], name, layer=layer)).cpu().numpy()
                    np.add.at(sums[:, p, layer], who, kl)
        bar.update(len(idx))
    bar.close()
    per_example = sums / np.maximum(counts, 1)[:, None, None]
    table = []
    for p, name in enumerate(SPACES):
        for layer in range(L):
            mean, low, high = mean_interval(per_example[:, p, layer])
            table.append({"layer": layer, "projection": name, "kl": mean, "kl_ci_low": low, "kl_ci_high": high,
                          "n_examples": N, "n_positions": int(counts.sum())})
    return pd.DataFrame(table), per_example


def spaces(ctx: RunContext) -> dict[str, dict[str, pd.DataFrame]]:
    """Figures 4-5 and 9-11's per-layer tables under each projection (from the experiments' own code)."""
    cap = capture_eval(ctx)
    out: dict[str, dict[str, pd.DataFrame]] = {}
    for name in SPACES:
        out[name] = {"values": values.figure_tables(ctx, projection=name)["per_layer"],
                     "refinement": refinement.per_layer(cap.residual[name], cap.final)}
    return out


def side_by_side(tables: dict[str, dict[str, pd.DataFrame]]) -> pd.DataFrame:
    keep_values = ["layer", "agreement_rate", "agreement_rate_ci_low", "agreement_rate_ci_high", "n_keys_with_target",
                   "rank_median", "mean_log10_rank", "mean_top_prob"]
    keep_refinement = ["layer", "residual_agreement", "residual_agreement_ci_low", "residual_agreement_ci_high",
                       "mean_confidence", "kept", "kept_ci_low", "kept_ci_high", "override", "override_ci_low",
                       "override_ci_high", "composition", "composition_ci_low", "composition_ci_high", "n_examples"]
    frames = []
    for name, t in tables.items():
        v = t["values"][keep_values].rename(columns={"agreement_rate": "value_agreement",
                                                     "agreement_rate_ci_low": "value_agreement_ci_low",
                                                     "agreement_rate_ci_high": "value_agreement_ci_high",
                                                     "rank_median": "value_rank_median",
                                                     "mean_log10_rank": "value_mean_log10_rank",
                                                     "mean_top_prob": "value_mean_top_prob"})
        frames.append(v.merge(t["refinement"][keep_refinement], on="layer").assign(projection=name))
    df = pd.concat(frames, ignore_index=True)
    return df[["projection", *[c for c in df.columns if c != "projection"]]]


def findings_by_projection(tables: dict[str, dict[str, pd.DataFrame]]) -> pd.DataFrame:
    """The fidelity rows of Figures 4 and 9-11 under each projection, and whether the translators change them."""
    merged = None
    for name, t in tables.items():
        f = fidelity({"values": t["values"], "refinement": t["refinement"]}, {"values": name, "refinement": name})
        f = f[["figure", "finding", "rule", "measured", "reproduces"]].rename(
            columns={"measured": f"measured_{name}", "reproduces": f"reproduces_{name}"})
        f[f"measured_{name}"] = f[f"measured_{name}"].astype(str)
        merged = f if merged is None else merged.merge(f.drop(columns=["rule"]), on=["figure", "finding"], how="outer")
    merged["changes_under_translator"] = [
        any(r[f"reproduces_{TRANSLATOR}"] != r[f"reproduces_{p}"] for p in PROJECTIONS)
        for _, r in merged.iterrows()]
    return merged.reset_index(drop=True)

def draw(result: Result) -> Figures:
    """The KL to the final distribution per layer (translators_kl) and Figures 4, 9, 10 and 11 under the three
    projections (translators_values, _agreement, _confidence, _kept)."""
    return {f"{NAME}_kl": draw_kl(result.tables[NAME], result.n_layers),
            **draw_spaces(result.tables[f"{NAME}_spaces"], result.n_layers)}


def draw_kl(kl: pd.DataFrame, L: int):
    """KL(final || layer) per layer under each projection, with its interval."""
    fig, ax = new_figure()
    for name in SPACES:
        t = kl[kl["projection"] == name]
        x = t["layer"].to_numpy()
        ax.plot(x, t["kl"], "o-", color=COLORS[name], label=name)
        ax.fill_between(x, t["kl_ci_low"], t["kl_ci_high"], color=COLORS[name], alpha=0.2)
    ax.set_yscale("log")
    ax.set_ylabel("KL(final || layer), nats")
    ax.set_title(f"Distance of resid_mid's distribution to the final one\n"
                 f"n = {int(kl['n_examples'].iloc[0]):,} held-out examples, every position")
    layer_axis(ax, L)
    legend_outside(ax)
    return fig


def draw_spaces(df: pd.DataFrame, L: int) -> Figures:
    """One figure per compared quantity, a line per projection."""
    figures = {}
    for column, label, figure in (("value_agreement", "% keys: value's top token = trigger target (Fig. 4)",
                                   f"{NAME}_values"),
                                  ("residual_agreement", "% examples: residual's top token = final (Fig. 9)",
                                   f"{NAME}_agreement"),
                                  ("mean_confidence", "mean p(resid_mid) of the final prediction (Fig. 10)",
                                   f"{NAME}_confidence"),
                                  ("kept", "% examples: FF keeps the residual's top (Fig. 11)", f"{NAME}_kept")):
        fig, ax = new_figure()
        scale = 1 if column == "mean_confidence" else 100
        for name in SPACES:
            t = df[df["projection"] == name]
            ax.plot(t["layer"], scale * t[column], "o-", color=COLORS[name], label=name)
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(':')[0]} under three projections")
        layer_axis(ax, L)
        legend_outside(ax)
        figures[figure] = fig
    return figures


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/translators (KL per layer), translators_spaces and translators_findings. Beyond the tables it keeps
    the fitted translators in the run (RUN/translators/translators.npz, `fit`: the explorer and `Run` project
    through them) and sets them on the model's view for the steps after it in this call."""
    fitted = fit(ctx)
    ctx.view.translators = fitted.to(ctx.view.device)
    kl, _ = kl_to_final(ctx)
    tables = spaces(ctx)
    df = side_by_side(tables)
    findings = findings_by_projection(tables)
    n = len(ctx.held_out().examples)
    changed = findings[findings["changes_under_translator"]]
    meta = {"changes_under_translator": "; ".join(
                f"{r.figure}: {r.finding} (reproduces under translator: {r.reproduces_translator})"
                for r in changed.itertuples()) or "none of the findings of Figures 4, 9-11 changes its verdict","projection": "identity, final-norm and translator (side by side)",
            "translator": "N(A_l h + b_l) for residual vectors, N(A_l u) for values, sub-updates and FF outputs; "
                          "A_l, b_l fitted on resid_mid[l] (RUN/translators/translators.npz)",
            "final_prediction": "the model's LM head (bias included)", "n_examples": n,
            "interval": "KL: 95% normal interval of the mean over examples; shares: 95% Wilson score interval",
            "fitted_on": fitted.info["fitted_on"], "epochs": fitted.info["epochs"], "lr": fitted.info["lr"],
            "warnings": sample_size_warnings(NAME, n)}
    result = Result(ctx.view.n_layers, record={"file": "translators/translators.npz",
                                               **{k: v for k, v in meta.items() if k != "fitted_on"}})
    result.add(NAME, kl, **meta)
    result.add(f"{NAME}_spaces", df, **meta)
    result.add(f"{NAME}_findings", findings, **meta)
    return result



EXPERIMENT = Experiment(
    name=NAME, title="Projection spaces: fitted per-layer translators (beyond the paper)",
    section="beyond the paper: the tuned lens (Belrose et al. 2023)", order=10, compute=compute, draw=draw,
    own_pass="the fit's forward and backward passes over held-out positions (it trains parameters)",
    held_out=True,
    optional=True,  # fits parameters: minutes on a GPU at the paper's shape
    encoder=Encoder(True, "KL-to-final, Figures 4, 9-11 side by side", "translators fitted at every (unmasked) "
                    "position of the training examples against the MLM head's output there"),
    latents=("not applicable: the translators map the residual stream of each layer to the last layer's; they "
             "read no memory, neuron or latent"),
    reading_rows={NAME: 3 * 64, f"{NAME}_findings": 16}, module=__name__)
