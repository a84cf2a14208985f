"""Membership signal (docs/definitions.md; paper Section 8): do memories fire differently on training text?

Equal numbers of member examples (from the model's training split) and non-member examples (held out
from training) are drawn, each a seeded uniform subset of its corpus (`ffkv.experiments.common.eval_spec`,
read with the run's unit options). Each example goes through the model once (`ffkv.experiments.scoring`):

- per layer, the coefficient statistic: the mean over the example's non-special positions of the mean
  of the `TOP_K` largest |m_i| (magnitudes: the signed rule of `ffkv.memories.active`);
- the loss baseline: the example's mean token NLL (members are expected to score lower; its AUC is read
  with the score -NLL).

Per layer, the ROC AUC of the statistic separating members from non-members (AUC > 0.5: members have
larger top coefficients; < 0.5: smaller; 0.5: no signal), with its DeLong 95% interval; the same for
the loss baseline. Which split each example came from is written to ``membership_examples``.

For a run indexed with a sparse dictionary (docs/definitions.md), ``membership_latents`` reads the same statistic of
the latents' activations a_j (never negative) at each dictionary layer, from the same pass: per layer the latents'
AUC beside the neurons' of that layer, each against no signal (0.5), and their difference, latents minus neurons,
with its paired DeLong interval (the same examples score both). Which kind separates the splits more
(`stronger`): the one further from 0.5, where both AUCs sit on the same side of 0.5 and the difference's interval
excludes 0; otherwise the data cannot say.

Splits: ffkv-tiny (embedded) knows its own (`ffkv.models.default_corpus`: every 20th verse held out), so
they are the default for it. For any other model both corpora must be named (``member_corpus`` and
``nonmember_corpus``; ``ffkv analyze --only membership --member-corpus A --nonmember-corpus B``): ffkv
cannot know what a model was trained on, and refuses rather than guess. Run as part of every experiment
(no ``--only``) on a model with no known split and no corpora given, the experiment is skipped with a
note (`skip_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ffkv.corpus import iter_examples
from ffkv.errors import FfkvError
from ffkv.experiments.common import RunContext, eval_spec, sample_size_warnings
from ffkv.experiments.figures import COLORS, KIND_COLORS, latent_figure, layer_axis, legend_outside, new_figure
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.experiments.scoring import TOP_K, score_examples
from ffkv.models.default_corpus import KNOWN_SPLITS
from ffkv.presentation.findings import layer_ends
from ffkv.presentation.intervals import auc_difference_interval, auc_interval
from ffkv.presentation.style import layer_number

NAME = "membership"
LATENTS = f"{NAME}_latents"
#: Examples drawn from each split by default (fewer when a split holds fewer usable examples).
N_PER_SPLIT = 1000
INTERVAL = "95% DeLong interval of the ROC AUC (AUC ± 1.96·SE, clipped to [0, 1])"


def _options(ctx: RunContext) -> dict:
    """The options given to this call (`analyze(options={"membership": {...}})`), for `skip_reason`."""
    return dict(ctx.options.get(NAME, {})) if hasattr(ctx, "options") else {}


def skip_reason(ctx: RunContext) -> str | None:
    """Why the experiment cannot run on this run with these options (None when it can)."""
    opts = _options(ctx)
    member, nonmember = opts.get("member_corpus"), opts.get("nonmember_corpus")
    if (member is None) != (nonmember is None):
        return "membership needs both --member-corpus and --nonmember-corpus (one was given)"
    if member is None and ctx.loaded.model_id not in KNOWN_SPLITS:
        return (f"membership: ffkv does not know which text {ctx.loaded.model_id!r} was trained on; name both "
                "splits with --member-corpus (training text) and --nonmember-corpus (text never trained on)")
    return None


def corpora(ctx: RunContext) -> tuple[object, object, str]:
    """(member source, non-member source, where they came from) for this run."""
    why = skip_reason(ctx)
    if why:
        raise FfkvError(why)
    opts = _options(ctx)
    if opts.get("member_corpus") is not None:
        return opts["member_corpus"], opts["nonmember_corpus"], "given by the user"
    from ffkv.models.default_corpus import default_corpus_path

    member, nonmember = KNOWN_SPLITS[ctx.loaded.model_id]
    return (str(default_corpus_path(member)), str(default_corpus_path(nonmember)),
            f"{ctx.loaded.model_id}'s own training split (embedded corpus: every 20th verse held out)")


def draw_examples(ctx: RunContext, member, nonmember, n: int) -> pd.DataFrame:
    """Equal numbers of member and non-member examples (seeded subsets; examples of < 2 tokens left out)."""
    found = {}
    for label, source in (("member", member), ("nonmember", nonmember)):
        spec = eval_spec(ctx.manifest, source, None, n, ctx.seed)
        found[label] = [(e.example_id, np.asarray(e.token_ids, np.int64), e.text, spec.source)
                        for e in iter_examples(spec, ctx.tokenizer) if len(e.token_ids) >= 2]
    k = min(len(v) for v in found.values())
    if k < 2:
        raise FfkvError(f"membership needs at least 2 examples of each split; found {len(found['member'])} members "
                        f"and {len(found['nonmember'])} non-members")
    rng = np.random.default_rng(ctx.seed)
    kept = {label: [v[i] for i in np.sort(rng.choice(len(v), size=k, replace=False))] for label, v in found.items()}
    rows = [{"split": label, "member": label == "member", "source": src, "example_id": int(eid), "token_ids": ids,
             "text": text} for label in ("member", "nonmember") for eid, ids, text, src in kept[label]]
    return pd.DataFrame(rows)


def per_layer_auc(stat: np.ndarray, member: np.ndarray) -> pd.DataFrame:
    """Per layer: the AUC of the statistic (members as positives) with its DeLong interval."""
    rows = []
    for layer in range(stat.shape[1]):
        auc, low, high = auc_interval(stat[member, layer], stat[~member, layer])
        rows.append({"layer": layer, "auc": auc, "auc_ci_low": low, "auc_ci_high": high,
                     "mean_member": float(stat[member, layer].mean()),
                     "mean_nonmember": float(stat[~member, layer].mean()),
                     "n_member": int(member.sum()), "n_nonmember": int((~member).sum())})
    return pd.DataFrame(rows)


def stronger(auc_latents: float, auc_neurons: float, low: float, high: float) -> str:
    """Which kind's statistic separates the splits more: the one whose AUC is further from 0.5, where both sit on
    the same side of it and the difference's interval (low, high) excludes 0; otherwise the data cannot say."""
    same_side = (auc_latents - 0.5) * (auc_neurons - 0.5) > 0
    if not (same_side and np.isfinite(low) and np.isfinite(high)) or low <= 0 <= high:
        return "cannot say"
    return "latents" if abs(auc_latents - 0.5) > abs(auc_neurons - 0.5) else "neurons"


def latent_auc(latent_stat: dict[int, np.ndarray], neuron_stat: np.ndarray, member: np.ndarray) -> pd.DataFrame:
    """membership_latents: per dictionary layer, the latents' AUC beside the same layer's neurons', with the paired
    difference (module docstring)."""
    rows = []
    for layer, stat in sorted(latent_stat.items()):
        auc, low, high = auc_interval(stat[member], stat[~member])
        neurons = neuron_stat[:, layer]
        auc_n, low_n, high_n = auc_interval(neurons[member], neurons[~member])
        diff, d_low, d_high = auc_difference_interval(stat[member], stat[~member], neurons[member], neurons[~member])
        rows.append({"layer": layer, "auc_latents": auc, "auc_latents_ci_low": low, "auc_latents_ci_high": high,
                     "mean_member_latents": float(stat[member].mean()),
                     "mean_nonmember_latents": float(stat[~member].mean()),
                     "auc_neurons": auc_n, "auc_neurons_ci_low": low_n, "auc_neurons_ci_high": high_n,
                     "auc_chance": 0.5, "n_examples": int(len(member)), "n_member": int(member.sum()),
                     "n_nonmember": int((~member).sum()), "auc_latents_minus_neurons": diff,
                     "auc_latents_minus_neurons_ci_low": d_low, "auc_latents_minus_neurons_ci_high": d_high,
                     "stronger": stronger(auc, auc_n, d_low, d_high)})
    return pd.DataFrame(rows)


def score_tables(ctx: RunContext, n: int = N_PER_SPLIT) -> dict:
    """Both splits' examples scored: the per-layer AUC, the loss baseline, the per-example table, and with a
    dictionary its latents' AUC beside the neurons' (``latents``: None for a run without latents; ``unread``: why
    they were not read where the dictionary is gone or changed)."""
    member, nonmember, origin = corpora(ctx)
    examples = draw_examples(ctx, member, nonmember, int(n))
    latents, unread = ctx.latents_for(LATENTS)
    scores = score_examples(ctx.loaded, list(examples["token_ids"]), coefficients=True, progress=ctx.progress,
                            desc="membership", latents=latents)
    is_member = examples["member"].to_numpy(bool)
    table = per_layer_auc(scores.top_coefficients, is_member)
    latent_table = (latent_auc(scores.latent_top_coefficients, scores.top_coefficients, is_member)
                    if latents is not None else None)
    auc, low, high = auc_interval(-scores.nll[is_member], -scores.nll[~is_member])
    loss = {"auc": auc, "auc_ci_low": low, "auc_ci_high": high,
            "mean_member": float(scores.nll[is_member].mean()), "mean_nonmember": float(scores.nll[~is_member].mean()),
            "n_member": int(is_member.sum()), "n_nonmember": int((~is_member).sum())}
    table = table.assign(loss_auc=auc, loss_auc_ci_low=low, loss_auc_ci_high=high)
    L = scores.top_coefficients.shape[1]
    base = examples.drop(columns=["token_ids"]).assign(
        n_tokens=[len(t) for t in examples["token_ids"]], mean_nll=scores.nll)
    out = base.loc[base.index.repeat(L)].reset_index(drop=True).assign(
        layer=np.tile(np.arange(L, dtype=np.int16), len(base)), top_coefficients=scores.top_coefficients.ravel())
    return {"per_layer": table, "loss": loss, "examples": out, "origin": origin,
            "member_corpus": str(member), "nonmember_corpus": str(nonmember), "latents": latent_table,
            "unread": unread}


def draw(result: Result) -> Figures:
    """The ROC AUC per layer with its interval, beside the loss baseline's and no signal (0.5)."""
    table, loss = result.tables[NAME], result.meta[NAME]["loss_baseline"]
    x = table["layer"].to_numpy()
    auc = table["auc"].to_numpy()
    fig, ax = new_figure()
    ax.errorbar(x, auc, yerr=[auc - table["auc_ci_low"].to_numpy(), table["auc_ci_high"].to_numpy() - auc],
                fmt="o-", color=COLORS["shallow"], ecolor="black", elinewidth=0.8, capsize=2,
                label=f"mean top-{TOP_K} |m| per position")
    ax.axhline(loss["auc"], color=COLORS["last"], linestyle="--",
               label=f"loss baseline (-NLL): {loss['auc']:.3f} [{loss['auc_ci_low']:.3f}, {loss['auc_ci_high']:.3f}]")
    ax.axhspan(loss["auc_ci_low"], loss["auc_ci_high"], color=COLORS["last"], alpha=0.12)
    ax.axhline(0.5, color=COLORS["chance"], linestyle=":", label="no signal (0.5)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("ROC AUC, training vs held-out")
    ax.set_title(f"Membership signal per layer (95% DeLong intervals)\n"
                 f"n = {loss['n_member']:,} training + {loss['n_nonmember']:,} held-out examples")
    layer_axis(ax, result.n_layers)
    legend_outside(ax)
    return {NAME: fig, **latent_figure(result, LATENTS, _draw_latents)}


def _draw_latents(table: pd.DataFrame):
    """Per dictionary layer, the neurons' and the latents' AUC with their DeLong intervals, beside no signal."""
    fig, ax = new_figure(5.0, 3.2)
    x = np.arange(len(table))
    for offset, kind in ((-0.1, "neurons"), (0.1, "latents")):
        color = KIND_COLORS[kind]
        auc = table[f"auc_{kind}"].to_numpy(float)
        ax.errorbar(x + offset, auc, yerr=[auc - table[f"auc_{kind}_ci_low"].to_numpy(float),
                                           table[f"auc_{kind}_ci_high"].to_numpy(float) - auc],
                    fmt="o", color=color, ecolor="black", elinewidth=0.8, capsize=2, label=kind)
    ax.axhline(0.5, color=COLORS["chance"], linestyle=":", label="no signal (0.5)")
    ax.set_xticks(x)
    ax.set_xticklabels([f"layer {layer_number(layer)}" for layer in table["layer"]])
    ax.set_xlim(-0.6, len(table) - 0.4)
    ax.set_ylim(0, 1)
    ax.set_ylabel("ROC AUC, training vs held-out")
    first = table.iloc[0]
    ax.set_title(f"Membership signal, latents beside neurons (95% DeLong intervals)\n"
                 f"n = {int(first.n_member):,} training + {int(first.n_nonmember):,} held-out examples", fontsize=9)
    legend_outside(ax)
    return fig


def compute(ctx: RunContext, options: "Options | None" = None) -> Result:
    """metrics/membership (per layer) and membership_examples."""
    given = (options or Options()).n
    found = score_tables(ctx, given if given is not None else min(N_PER_SPLIT, ctx.n_eval or N_PER_SPLIT))
    loss = found["loss"]
    n = loss["n_member"] + loss["n_nonmember"]
    meta = {"n_examples": n, "n_member": loss["n_member"], "n_nonmember": loss["n_nonmember"],
            "interval": INTERVAL,
            "statistic": f"per example and layer: mean over non-special positions of the mean of the {TOP_K} "
                         "largest |m_i| (signed coefficients read by magnitude)",
            "rule": "AUC of the statistic with members as positives (> 0.5: larger on training text); the loss "
                    "baseline is the AUC of -mean token NLL",
            "loss_baseline": loss, "splits": found["origin"], "member_corpus": found["member_corpus"],
            "nonmember_corpus": found["nonmember_corpus"], "seed": ctx.seed,
            "warnings": sample_size_warnings(NAME, n)}
    result = Result(ctx.view.n_layers, record=dict(meta))
    result.add(NAME, found["per_layer"], **meta)
    result.add(f"{NAME}_examples", found["examples"], **meta)
    if found["latents"] is not None:
        result.add(LATENTS, found["latents"], **{
            **meta, "statistic": f"per example and dictionary layer: mean over non-special positions of the mean of "
                                 f"the {TOP_K} largest a_j (latents; the neurons' statistic beside it)",
            "rule": "each kind's AUC with members as positives against no signal (0.5); their difference with its "
                    "paired DeLong 95% interval; stronger: the kind further from 0.5 where both sit on one side and "
                    "the interval excludes 0"})
    if found["unread"]:  # the dictionary's files are gone or changed: the neurons' tables stand, and say so
        result.meta[NAME] = {**meta, "warnings": [*meta["warnings"], *found["unread"]]}
    return result


# ------------------------------------------------ membership: the paper's findings, its reading and fidelity rules
#: The paper's finding (or the reference's) beside its figure and every table of the study.
FINDING = Finding("Beyond the paper (its Section 8 names it as future work)", (
    "Memories that store training text should fire "
    "differently on training examples than on unseen ones: a membership signal, compared here with the "
    "standard loss-based baseline on the same examples."))
FINDINGS = {NAME: FINDING, f"{NAME}_examples": FINDING, LATENTS: Finding("Beyond the paper", (
    "Do a sparse dictionary's latents fire differently on training text than the layer's own neurons do? The same "
    "statistic of the latents' activations, on the same examples, beside the neurons'."))}


def reading(name: str, table: pd.DataFrame) -> str | None:
    """The membership signal on this model: the layer whose coefficient statistic is furthest from
    chance (ROC AUC, DeLong interval), beside the loss baseline; None for its other tables. Layers count from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "membership" and "auc" in t and "loss_auc" in t:
        best = t.loc[(t["auc"] - 0.5).abs().idxmax()]
        n = f"n = {int(first.n_member):,} training + {int(first.n_nonmember):,} held-out examples"
        return (f"In this model the coefficient statistic's ROC AUC is furthest from 0.5 in layer "
                f"{layer_number(best.layer)}: {best.auc:.3f} (95% DeLong CI {best.auc_ci_low:.3f}-"
                f"{best.auc_ci_high:.3f}); the loss baseline's AUC is {first.loss_auc:.3f} "
                f"({first.loss_auc_ci_low:.3f}-{first.loss_auc_ci_high:.3f}); {n}.")
    if name == LATENTS and "auc_latents" in t:
        parts = [f"layer {layer_number(r.layer)}: latents {r.auc_latents:.3f} [{r.auc_latents_ci_low:.3f}, "
                 f"{r.auc_latents_ci_high:.3f}] against neurons {r.auc_neurons:.3f} [{r.auc_neurons_ci_low:.3f}, "
                 f"{r.auc_neurons_ci_high:.3f}], difference {r.auc_latents_minus_neurons:+.3f} "
                 f"[{r.auc_latents_minus_neurons_ci_low:+.3f}, {r.auc_latents_minus_neurons_ci_high:+.3f}]: "
                 + ("the data cannot say which separates the splits more" if r.stronger == "cannot say"
                    else f"the {r.stronger} separate the splits more") for r in t.itertuples()]
        return (f"Membership AUC (no signal: 0.5; n = {int(first.n_member):,} training + "
                f"{int(first.n_nonmember):,} held-out examples): " + "; ".join(parts) + ".")
    return None


@dataclass(frozen=True)
class Options:
    """Membership's options (`analyze(options={"membership": {...}})`, the command's flags)."""

    member_corpus: str | None = field(default=None, metadata={
        "flag": "--member-corpus", "help": "text the model was trained on (members); with --nonmember-corpus. "
        "Default: the model's own known split (ffkv-tiny: its training verses); other models need both"})
    nonmember_corpus: str | None = field(default=None, metadata={
        "flag": "--nonmember-corpus", "help": "text the model never saw in training (non-members)"})
    n: int | None = field(default=None, metadata={
        "flag": "--n-membership", "positive": True,
        "help": f"examples drawn from each split, seeded (default: --n-eval, at most {N_PER_SPLIT}; fewer if a split "
                "holds fewer)"})


EXPERIMENT = Experiment(
    name=NAME, title="Membership signal: training vs held-out text (beyond the paper)",
    section="beyond the paper (its Section 8 names it as future work)",
    order=8, compute=compute, draw=draw, options=Options, skip_reason=skip_reason,
    own_pass=("training and held-out examples scored whole (loss and coefficient statistics at every position): its own"
              " text, the member and non-member sets"),
    encoder=Encoder(False, "membership (beyond the paper)", "not computed: its baseline and statistic score "
                    "next-token loss, which a masked-LM encoder does not define"),
    latents=(f"{LATENTS}: the same statistic of the latents' activations from the same pass, each dictionary layer's "
             "AUC beside its neurons' with the paired difference"),
    findings=FINDINGS, reading=reading, module=__name__)
