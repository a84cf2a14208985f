"""Pruning memories (docs/definitions.md): held-out perplexity against the share of keys removed, per criterion,
and `prune`, which writes the smaller model (`ffkv prune RUN --criterion C --share S --out MODEL_DIR`).

Which keys go. Every criterion orders the keys of each layer, first removed first; a share s removes the
first n = `ffkv.memories.pruning.removal_count`(d_m, s) keys of that order **in every layer** (the same
count per layer: every layer's FF stays alive, and the written model keeps the one intermediate size a
Hugging Face config holds). Ties go to the lower key index. The criteria (docs/definitions.md):

- ``activation_frequency``: least often active first: the share of positions where |m_i| > tau·s_l
  (`ffkv.memories.active`, s_l the run's: `ffkv.experiments.heldout.active_scale`; the explorer's activation
  frequency, computed by the same function, `ffkv.experiments.lookups.activation_stats`, on the same seeded
  sample of the run's examples);
- ``value_norm``: smallest ‖v_i‖ first;
- ``contribution``: smallest mean |m_i|·‖v_i‖ first (the mean of |m_i| over the same sample's positions),
  the mean norm of the memory's sub-update m_i·v_i;
- ``redundancy``: greedy by value cosine: while keys remain, the kept key whose value has the highest
  cosine to another kept key's value is removed (of the two in that pair, the one with the smaller ‖v_i‖;
  then the lower index); cosines are recomputed among the kept keys after every removal;
- ``census``: by the group of each key in RUN/metrics/census.parquet (`ffkv analyze --only census`), in the
  order of `CENSUS_GROUPS`: dead keys first, then other (and any class not named there), positional, token
  detectors, then keys whose value is a suppression or a prediction one, whatever their class (memories
  whose values write a coherent token set are kept longest); within a group, smallest mean |contribution|
  first;
- ``random``: a seeded permutation per layer (numpy's default_rng([seed, layer])), the baseline.

The statistics (activation frequency, mean |m_i|) come from the run's own indexed examples
(`ffkv.experiments.lookups.corpus_sample`), never from the held-out examples whose perplexity is measured,
so no criterion is chosen on the test set. Perplexity is exp of the mean next-token negative
log-likelihood over every position of the held-out examples read (token-weighted: each predicted token counts
once; n_tokens in the table), of the masked model (`ffkv.memories.pruning.masked`). The curve reads at most
`MAX_TOKENS` predicted tokens: held-out examples in a seeded random order until the next would pass it.

Latents (docs/definitions.md; a run indexed with ``--dictionary``): ``pruning_latents`` removes a share of one
dictionary layer's latents (switched off, a_j = 0: the layer's output is the reconstruction without them plus the
dictionary's error term, `ffkv.memories.interventions`) and, beside it, the same share of the same layer's neurons
(masked in that layer only), each by the same criterion read for its own kind, on the same held-out tokens:
``activation_frequency`` (a_j > 0 over the same corpus sample, `ffkv.experiments.latent_lookups.activation_stats`),
``value_norm`` (‖d_j‖), ``contribution`` (mean a_j·‖d_j‖) and ``random`` (a seeded permutation, numpy's
default_rng([seed, layer, 1]) for latents). ``redundancy`` is left out for latents (greedy over all pairs of a
16x dictionary's decoder rows: hundreds of millions of cosines per step); ``census`` is not read for latents yet
(its order would read census_latents_keys' classes). At `LATENT_SHARES`; per row the paired difference of the
per-example mean NLL, latents minus neurons, with its 95% interval (`ffkv.presentation.intervals.paired_mean_interval`):
a positive difference means removing the latents costs more than removing as large a share of the neurons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from ffkv.errors import FfkvError
from ffkv.experiments.common import RunContext
from ffkv.experiments.heldout import active_threshold
from ffkv.experiments.lookups import (SAMPLE_EXAMPLES, SAMPLE_MAX_TOKENS, activation_stats, corpus_sample,
                                     sample_batches, sample_statistics)
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.experiments.scoring import RowMasks, Scores, score_examples
from ffkv.memories.active import RULE
from ffkv.memories.pruning import Removed, removal_count, removal_edits
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.store.run import RunDir

NAME = "pruning"
LATENTS = f"{NAME}_latents"
#: The criteria read for latents, and the shares of a dictionary layer's latents (and of its neurons) removed.
LATENT_CRITERIA = ("activation_frequency", "value_norm", "contribution", "random")
LATENT_SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)
#: The criteria, in the order of the table and the figure's legend.
CRITERIA = ("activation_frequency", "value_norm", "contribution", "redundancy", "census", "random")
#: Criteria that read the statistics of the corpus sample (the others read the weights alone, or the census).
NEEDS_SAMPLE = ("activation_frequency", "contribution", "census")
#: Shares of each layer's keys removed along the curve.
SHARES = tuple(round(0.1 * i, 1) for i in range(10))
#: Shares the report's table shows.
SUMMARY_SHARES = (0.1, 0.3, 0.5)
#: Most predicted tokens the curve reads: held-out examples are taken in a seeded random order until the next
#: would pass this (55 masked passes of the whole held-out set would dominate `ffkv analyze`; the criteria are
#: compared on the same tokens, so their differences are paired). n_tokens is in the table.
MAX_TOKENS = 4096
#: A key's group by the census, in the order the groups are removed: "dead" by its class, "suppression" and
#: "prediction" by its value type (any other class), else its class ("detector", "positional", "other"; a class
#: not named here counts as "other").
CENSUS_GROUPS = ("dead", "other", "positional", "detector", "suppression", "prediction")


def check_criterion(criterion: str) -> str:
    """The criterion, or a clear error naming the known ones."""
    if criterion not in CRITERIA:
        raise FfkvError(f"unknown pruning criterion {criterion!r}; choose from {', '.join(CRITERIA)}")
    return criterion


@dataclass(frozen=True)
class KeyStatistics:
    """What the criteria read, per layer (rows) and key (columns).

    Attributes:
        value_norm: ‖v_i‖ (L, d_m).
        frequency: share of the sample's positions where the key is active (`ffkv.memories.active`), or None
            when no sample was read.
        mean_abs: mean |m_i| over the same positions, or None.
        positions, examples: the sample's size (0 without a sample).
    """

    value_norm: np.ndarray
    frequency: np.ndarray | None = None
    mean_abs: np.ndarray | None = None
    positions: int = 0
    examples: int = 0

    @property
    def contribution(self) -> np.ndarray:
        """Mean |m_i|·‖v_i‖ (L, d_m): the mean norm of each memory's sub-update."""
        if self.mean_abs is None:
            raise FfkvError("the contribution criterion needs coefficient statistics from a corpus sample")
        return self.mean_abs * self.value_norm


def key_statistics(loaded: LoadedModel, run: RunDir | None = None, seed: int = 0,
                   token_lists: Sequence[Sequence[int]] | None = None, bar=None,
                   threshold: np.ndarray | None = None, act: dict[str, np.ndarray] | None = None) -> KeyStatistics:
    """‖v_i‖ of every key and, from a corpus sample, each key's activation frequency and mean |m_i|.

    Args:
        run: the run whose examples are sampled (`corpus_sample`: SAMPLE_EXAMPLES examples of at most
            SAMPLE_MAX_TOKENS tokens, seeded, as the explorer's activation frequency).
        token_lists: the sample itself instead of `run` (None and no run: weights only).
        threshold: the run's tau·s_l per layer (`ffkv.experiments.heldout.active_threshold`), the active rule of
            the activation frequency (the explorer's); None: no activation frequency.
        act: `activation_stats` of `token_lists` under `threshold`, when the caller has them (`analyze` computes
            them once for the explorer and this: `ffkv.experiments.lookups.sample_statistics`).
    """
    view = loaded.view
    norms = np.stack([view.values(layer).float().norm(dim=1).cpu().numpy() for layer in range(view.n_layers)])
    if token_lists is None and run is not None:
        token_lists = corpus_sample(run, n=SAMPLE_EXAMPLES, seed=seed, max_tokens=SAMPLE_MAX_TOKENS)
    if token_lists is None:
        return KeyStatistics(norms.astype(np.float64))
    if act is None:
        act = activation_stats(loaded, sample_batches(loaded, [list(t) for t in token_lists]), threshold, bar=bar)
    frequency = None if act["frequency"] is None else act["frequency"].astype(np.float64)
    return KeyStatistics(norms.astype(np.float64), frequency, act["mean_abs"],
                         int(act["positions"]), len(token_lists))


def ascending(scores: np.ndarray) -> np.ndarray:
    """Key indices from the smallest score to the largest, ties to the lower index."""
    return np.argsort(np.asarray(scores), kind="stable")


#: Rows of the cosine matrix symmetrized at once: (n x n) float64 is 1.6 GB at d_m = 14,336, so no whole copy is made.
_SYMMETRIZE_ROWS = 1024


def _symmetrized(sim: torch.Tensor) -> torch.Tensor:
    """(sim + simᵀ) / 2 in place, block by block: the same numbers, without the two (n x n) temporaries."""
    n = sim.shape[0]
    for i in range(0, n, _SYMMETRIZE_ROWS):
        rows = slice(i, min(i + _SYMMETRIZE_ROWS, n))
        for j in range(i, n, _SYMMETRIZE_ROWS):
            cols = slice(j, min(j + _SYMMETRIZE_ROWS, n))
            mean = (sim[rows, cols] + sim[cols, rows].T) / 2
            sim[rows, cols] = mean
            sim[cols, rows] = mean.T
    return sim


@torch.no_grad()
def redundancy_order(values: Float[torch.Tensor, "d_m d"]) -> np.ndarray:
    """The greedy redundancy order of one layer's values (module docstring): every key, first removed first.

    Cosines are computed once in float64 (made exactly symmetric); each step removes, among the kept keys,
    the one whose highest cosine to another kept key is largest (ties: smaller ‖v_i‖, then lower index),
    and recomputes only the keys whose nearest kept neighbour it was.
    """
    v = values.detach().to("cpu", torch.float64)
    n = v.shape[0]
    norms = v.norm(dim=1)
    unit = v / norms.clamp(min=1e-30)[:, None]
    del v
    sim = _symmetrized(unit @ unit.T)
    del unit
    sim.fill_diagonal_(-math.inf)
    # The greedy loop runs n steps of a few small operations: in numpy (the same float64 numbers, and its argmax,
    # as torch's max, gives the first of equal values), whose per-call cost is a fraction of torch's.
    sim = sim.numpy()
    norms = norms.numpy()
    nearest = sim.argmax(axis=1)
    best = sim[np.arange(n), nearest]
    kept = np.ones(n, dtype=bool)
    order = []
    for _ in range(n - 1):
        top = best.max()
        tied = np.flatnonzero(kept & (best == top))
        if len(tied) > 1:  # smaller norm first, then lower index
            tied = tied[np.lexsort((tied, norms[tied]))]
        i = int(tied[0])
        order.append(i)
        kept[i] = False
        best[i] = -math.inf
        sim[:, i] = -math.inf
        rows = np.flatnonzero(kept & (nearest == i))
        if len(rows):
            nearest[rows] = sim[rows].argmax(axis=1)
            best[rows] = sim[rows, nearest[rows]]
    order.extend(int(i) for i in np.flatnonzero(kept))
    return np.asarray(order, dtype=np.int64)


def read_census(run: RunDir) -> pd.DataFrame:
    """RUN/metrics/census.parquet's (layer, key, class, value_type) columns, or a clear error saying how to make it."""
    if not run.has_metric("census"):
        raise FfkvError(f"the census criterion needs {run.metric_path('census')}; run "
                        f"`ffkv analyze {run.path} --only census` first")
    table = run.read_metric("census", columns=["layer", "key", "class", "value_type"])
    if table.duplicated(["layer", "key"]).any():
        raise FfkvError("metrics/census.parquet holds more than one row for some key; expected one class per key")
    return table


def census_provenance(run: RunDir) -> dict:
    """On what the run's census was computed (its `ffkv analyze` record: seed, held-out examples, projections),
    for a reader outside `analyze` (`ffkv prune`); refused where the run does not record a whole census."""
    record = run.manifest().analyses.get("census")
    why = ("the run records no census" if not record else
           f"its census was skipped ({record['skipped']})" if "skipped" in record else
           "its census was computed by an analyze that did not record on what" if not record.get("provenance") else None)
    if why is not None:
        raise FfkvError(f"the census criterion reads the run's census, and {why}; run "
                        f"`ffkv analyze {run.path} --only census` first")
    return dict(record["provenance"])


def census_group(key_class: str, value_type: str) -> str:
    """The key's group of `CENSUS_GROUPS` from its census class and value type."""
    if key_class == "dead":
        return "dead"
    if value_type in ("suppression", "prediction"):
        return value_type
    return key_class if key_class in CENSUS_GROUPS else "other"


def census_order(census: pd.DataFrame, layer: int, d_m: int, contribution: np.ndarray) -> np.ndarray:
    """One layer's keys by census group (`CENSUS_GROUPS`), then by smallest mean |contribution|, then by
    key index."""
    rows = census[census["layer"] == layer]
    groups = np.full(d_m, None, dtype=object)
    keys = rows["key"].to_numpy(np.int64)
    if len(keys) != d_m or set(keys.tolist()) != set(range(d_m)):
        raise FfkvError(f"metrics/census.parquet does not cover the {d_m} keys of layer {layer}; rerun "
                        "`ffkv analyze RUN --only census` with this run's model")
    groups[keys] = [census_group(c, v) for c, v in zip(rows["class"], rows["value_type"])]
    rank = np.array([CENSUS_GROUPS.index(g) for g in groups])
    return np.lexsort((np.arange(d_m), contribution, rank)).astype(np.int64)


def removal_orders(criterion: str, view: MemoryView, stats: KeyStatistics, census: pd.DataFrame | None = None,
                   seed: int = 0) -> list[np.ndarray]:
    """Per layer, every key in the order the criterion removes them (module docstring)."""
    check_criterion(criterion)
    if criterion in NEEDS_SAMPLE and stats.mean_abs is None:
        raise FfkvError(f"the {criterion} criterion needs statistics from a corpus sample (key_statistics with a run)")
    if criterion == "activation_frequency" and stats.frequency is None:
        raise FfkvError("the activation_frequency criterion needs the run's active threshold (key_statistics with "
                        "threshold=, `ffkv.experiments.heldout.active_threshold`)")
    orders = []
    for layer in range(view.n_layers):
        if criterion == "activation_frequency":
            order = ascending(stats.frequency[layer])
        elif criterion == "value_norm":
            order = ascending(stats.value_norm[layer])
        elif criterion == "contribution":
            order = ascending(stats.contribution[layer])
        elif criterion == "redundancy":
            order = redundancy_order(view.values(layer))
        elif criterion == "census":
            if census is None:
                raise FfkvError("the census criterion needs RUN/metrics/census.parquet (`ffkv analyze RUN --only census`)")
            order = census_order(census, layer, view.d_m, stats.contribution[layer])
        else:
            order = np.random.default_rng([seed, layer]).permutation(view.d_m)
        orders.append(np.asarray(order, dtype=np.int64))
    return orders


def keys_to_remove(orders: Sequence[np.ndarray], share: float) -> dict[int, np.ndarray]:
    """The first `removal_count`(d_m, share) keys of each layer's order, sorted."""
    return {layer: np.sort(order[:removal_count(len(order), share)]) for layer, order in enumerate(orders)}


@dataclass(frozen=True)
class Perplexity:
    """Held-out perplexity: exp(nll / n_tokens), nll the summed next-token negative log-likelihood."""

    nll: float
    n_tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.n_tokens) if self.n_tokens else float("nan")

    @classmethod
    def of(cls, scores: Scores) -> "Perplexity":
        """The token-weighted perplexity of `score_examples`' per-example scores."""
        n = scores.n_predicted.astype(np.float64)
        return cls(float((scores.nll * n).sum()), int(n.sum()))


def perplexity(loaded: LoadedModel, rows: Sequence[tuple[int, np.ndarray]], removed: Removed | None = None) -> Perplexity:
    """Token-weighted perplexity of the (masked) model on every position of `rows` (`heldout_rows`).

    Each row's token j+1 is predicted from its tokens 0..j, for every j with a next token, by the one scoring
    pass of `ffkv.experiments.scoring` (the model's own head, bias included; under torchrun each rank runs its
    batches and the per-row sums are gathered).
    """
    return Perplexity.of(score_examples(loaded, [ids for _, ids in rows],
                                        interventions=removal_edits(loaded.view, removed or {})))


def perplexities(loaded: LoadedModel, rows: Sequence[tuple[int, np.ndarray]], removals: Sequence[Removed],
                 progress: bool = False) -> list[Perplexity]:
    """`perplexity` of `rows` with each of `removals` masked ({}: the model as it is), from one scoring pass whose
    batches hold every (removal, row) pair (`ffkv.experiments.scoring.RowMasks`): the masked models' passes share
    batches cut by length, far fuller than one model's, so the curves cost a fraction of a pass per point. Each
    value equals its own pass's but for the rounding of the batch it ran in."""
    view = loaded.view
    keep = {layer: torch.ones(len(removals), view.d_m, dtype=torch.bool) for layer in range(view.n_layers)}
    for g, removed in enumerate(removals):
        for layer, keys in removed.items():
            keep[int(layer)][g, torch.as_tensor(np.asarray(keys, dtype=np.int64))] = False
    keep = {layer: mask for layer, mask in keep.items() if not bool(mask.all())}
    token_lists = [ids for _ in removals for _, ids in rows]
    group = np.repeat(np.arange(len(removals)), len(rows))
    scores = score_examples(loaded, token_lists, masks=RowMasks(keep, group), progress=progress,
                            desc="pruning curves")
    return [Perplexity.of(_of_group(scores, group, g)) for g in range(len(removals))]


def _of_group(scores: Scores, group: np.ndarray, g: int) -> Scores:
    """The scores of the rows of group `g` (`ffkv.experiments.scoring.RowMasks`), in their order."""
    rows = group == g
    return Scores(scores.nll[rows], scores.n_predicted[rows], scores.mass[rows], None)


def heldout_rows(token_lists: Sequence[Sequence[int]], max_tokens: int | None = None,
                 seed: int = 0) -> list[tuple[int, np.ndarray]]:
    """(row, token ids) of the examples with at least one next token, rows numbered 0..n-1.

    With `max_tokens`, the examples are visited in a seeded random order (numpy default_rng(seed)) and kept
    while their predicted tokens (length - 1 each) add up to at most `max_tokens` (always at least one);
    the kept ones stay in their original order.
    """
    kept = [np.asarray(t, dtype=np.int64) for t in token_lists if len(t) >= 2]
    if max_tokens is not None:
        chosen, total = [], 0
        for i in np.random.default_rng(seed).permutation(len(kept)):
            if chosen and total + len(kept[i]) - 1 > max_tokens:
                break
            chosen.append(int(i))
            total += len(kept[i]) - 1
        kept = [kept[i] for i in sorted(chosen)]
    return list(enumerate(kept))


def heldout_perplexity(loaded: LoadedModel, token_lists: Sequence[Sequence[int]],
                       removed: Removed | None = None) -> Perplexity:
    """`perplexity` of a list of examples' token ids (every position), the removed memories masked."""
    return perplexity(loaded, heldout_rows(token_lists), removed)


# ----------------------------------------------------------------------- the experiment
def compute(ctx: RunContext, options=None) -> Result:
    """metrics/pruning (perplexity per criterion and share removed) and metrics/pruning_summary."""
    view = ctx.view
    census, census_note, warnings = None, "metrics/census.parquet absent: run `ffkv analyze RUN --only census`", []
    stale = ctx.provenance_mismatch("census") if ctx.run.has_metric("census") else None
    if stale is not None:  # an earlier census, of another seed or held-out set: not this call's to read
        census_note = f"metrics/census.parquet not used: {stale}; run `ffkv analyze RUN --only census,pruning`"
        warnings.append(f"pruning: the census criterion was left out ({census_note})")
    elif ctx.run.has_metric("census"):
        try:
            census, census_note = read_census(ctx.run), "used"
        except Exception as exc:  # noqa: BLE001 - another experiment's table: the other criteria still run
            census_note = f"metrics/census.parquet not read as one (layer, key, class, value_type) row per key: {exc}"
            warnings.append(f"pruning: the census criterion was left out ({census_note})")
    criteria = [c for c in CRITERIA if c != "census" or census is not None]
    sample, act = sample_statistics(ctx)  # the explorer's lookups read the same pass
    stats = key_statistics(ctx.loaded, token_lists=sample, threshold=active_threshold(ctx), act=act)
    held = ctx.held_out()
    rows = heldout_rows([e.token_ids for e in held.examples], MAX_TOKENS, ctx.seed)
    if not rows:
        raise FfkvError("no held-out example has two tokens or more: nothing to measure perplexity on")
    points = [(criterion, share) for criterion in criteria for share in SHARES if share]
    removals: list[Removed] = [{}]  # nothing removed first: the base, which the latents' curves read too
    for criterion in criteria:
        orders = removal_orders(criterion, view, stats, census, ctx.seed)
        removals += [keys_to_remove(orders, share) for share in SHARES if share]
    base, *masked = perplexities(ctx.loaded, rows, removals, ctx.progress)
    measured = dict(zip(points, masked))
    records = []
    for criterion in criteria:
        for share in SHARES:
            result = measured[(criterion, share)] if share else base
            n = removal_count(view.d_m, share)
            records.append({"criterion": criterion, "share": share, "n_removed": n,
                            "share_removed": n / view.d_m, "perplexity": result.perplexity,
                            "nll": result.nll / result.n_tokens, "n_tokens": result.n_tokens,
                            "n_examples": len(rows)})
    table = pd.DataFrame(records)
    summary = summarize(table)
    description = {
        "n_examples": len(rows), "n_tokens": base.n_tokens, "d_m": view.d_m, "criteria": criteria,
        "removal": "the same number of keys from every layer: the nearest integer to share·d_m, at least one kept",
        "perplexity": "exp of the mean next-token NLL over every position of the held-out examples read "
                      f"(token-weighted; a seeded random choice of them, at most {MAX_TOKENS} tokens), removed "
                      "memories masked (m_i = 0 at every position)",
        "n_heldout_examples": len(held.examples),
        "statistics": {"source": "a seeded sample of the run's indexed examples (not the held-out ones)",
                       "examples": stats.examples, "positions": stats.positions, "active": RULE, "seed": ctx.seed},
        "census": census_note, "warnings": warnings,
    }
    # `analyze` adds n_examples, the held-out examples available; the curve read n_examples_read of them.
    result = Result(view.n_layers, record={"criteria": criteria, "n_examples_read": len(rows),
                                           "n_tokens": base.n_tokens})
    result.add(NAME, table, **description)
    result.add(f"{NAME}_summary", summary, **description)
    latents, unread = ctx.latents_for(LATENTS)
    if unread:  # the dictionary's files are gone or changed: the neurons' tables stand, and say so
        result.meta[NAME] = {**description, "warnings": [*warnings, *unread]}
    if latents is not None:
        result.add(LATENTS, latent_curves(ctx, latents, rows, stats, sample, base), **{
            **description, "criteria": list(LATENT_CRITERIA), "shares": list(LATENT_SHARES),
            "removal": "a share of one dictionary layer's latents switched off (a_j = 0, the dictionary's error term "
                       "kept), beside the same share of that layer's neurons masked (that layer only), each ordered "
                       "by the criterion read for its own kind",
            "difference": "per-example mean next-token NLL, latents removed minus neurons removed, paired over the "
                          "same examples: mean and 95% interval (normal approximation)", "warnings": []})
    return result


def latent_curves(ctx: RunContext, latents, rows: Sequence[tuple[int, np.ndarray]], stats: KeyStatistics,
                  sample: list[list[int]], base: Perplexity) -> pd.DataFrame:
    """pruning_latents: per dictionary layer, criterion and share, the held-out perplexity with that share of the
    layer's latents switched off and with as large a share of its neurons masked (module docstring); `base`: their
    perplexity with nothing removed."""
    from ffkv.experiments.latent_lookups import activation_stats as latent_activation_stats
    from ffkv.presentation.intervals import paired_mean_interval

    view, tokens = ctx.view, [ids for _, ids in rows]
    act = latent_activation_stats(ctx.loaded, latents, sample)
    neuron_orders = {criterion: removal_orders(criterion, view, stats, seed=ctx.seed) for criterion in LATENT_CRITERIA}
    points, latent_gone, neuron_gone = [], [], []   # per point: the latents switched off, the neurons masked
    for i, layer in enumerate(latents.layers):
        size = latents.size(layer)
        norm = latents.values(layer).detach().double().norm(dim=1).cpu().numpy()
        scores = {"activation_frequency": np.asarray(act["frequency"][i], dtype=np.float64), "value_norm": norm,
                  "contribution": act["mean"][i] * norm}
        for criterion in LATENT_CRITERIA:
            order = (np.random.default_rng([ctx.seed, layer, 1]).permutation(size) if criterion == "random"
                     else ascending(scores[criterion]))
            for share in LATENT_SHARES:
                points.append((layer, criterion, share))
                latent_gone.append(np.sort(order[:removal_count(size, share)]))
                neuron_gone.append(np.sort(neuron_orders[criterion][layer][:removal_count(view.d_m, share)]))
    # One scoring pass: each point's two masked models (latents off, neurons masked) are groups 2p and 2p + 1.
    G = 2 * len(points)
    keep = {layer: torch.ones(G, view.d_m, dtype=torch.bool) for layer in latents.layers}
    off = {layer: torch.zeros(G, latents.size(layer), dtype=torch.bool) for layer in latents.layers}
    for p, (layer, _, _) in enumerate(points):
        off[layer][2 * p, torch.as_tensor(latent_gone[p], dtype=torch.long)] = True
        keep[layer][2 * p + 1, torch.as_tensor(neuron_gone[p], dtype=torch.long)] = False
    group = np.repeat(np.arange(G), len(tokens))
    with latents.attached():
        scored = score_examples(ctx.loaded, [ids for _ in range(G) for ids in tokens], progress=ctx.progress,
                                masks=RowMasks(keep, group, off), desc="pruning latents")
    out = []
    for p, (layer, criterion, share) in enumerate(points):
        mine, theirs = (_of_group(scored, group, g) for g in (2 * p, 2 * p + 1))
        diff, low, high = paired_mean_interval(mine.nll - theirs.nll)
        out.append({"layer": layer, "kind": latents.dictionaries[layer].kind, "criterion": criterion, "share": share,
                    "n_latents": latents.size(layer), "n_removed_latents": len(latent_gone[p]),
                    "perplexity_latents": Perplexity.of(mine).perplexity,
                    "d_m": view.d_m, "n_removed_neurons": len(neuron_gone[p]),
                    "perplexity_neurons": Perplexity.of(theirs).perplexity,
                    "perplexity_base": base.perplexity,
                    "nll_latents_minus_neurons": diff, "nll_latents_minus_neurons_ci_low": low,
                    "nll_latents_minus_neurons_ci_high": high, "n_examples": len(rows),
                    "n_tokens": base.n_tokens})
    return pd.DataFrame(out)


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    """One row per criterion: perplexity with nothing removed and at `SUMMARY_SHARES`, and n_tokens."""
    out = []
    for criterion, rows in table.groupby("criterion", sort=False):
        at = dict(zip(rows["share"].round(2), rows["perplexity"]))
        out.append({"criterion": criterion, "perplexity_0": at.get(0.0, float("nan")),
                    **{f"perplexity_{int(round(s * 100))}": at.get(round(s, 2), float("nan")) for s in SUMMARY_SHARES},
                    "n_tokens": int(rows["n_tokens"].iloc[0])})
    return pd.DataFrame(out)


def draw(result: Result) -> Figures:
    """figures/pruning: perplexity against the share of each layer's keys removed, one curve per criterion."""
    from ffkv.experiments.figures import COLORS, latent_figure, legend_outside, new_figure

    table, n_tokens = result.tables[NAME], result.meta[NAME]["n_tokens"]
    fig, ax = new_figure(5.5, 3.8)
    for criterion, rows in table.groupby("criterion", sort=False):
        baseline = {"color": COLORS["random"], "linestyle": "--"} if criterion == "random" else {}
        ax.plot(100 * rows["share_removed"], rows["perplexity"], marker="o", markersize=3,
                label=criterion.replace("_", " "), **baseline)
    ax.set_yscale("log")
    ax.set_xlabel("keys removed from every layer (%)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_title(f"Pruning memories (n = {n_tokens:,} held-out tokens)", fontsize=9)
    legend_outside(ax)
    return {NAME: fig, **latent_figure(result, LATENTS, _draw_latents)}


def _draw_latents(table: pd.DataFrame):
    """figures/pruning_latents: per dictionary layer, perplexity against the share removed, latents solid and the
    layer's neurons dashed, one colour per criterion."""
    import matplotlib.pyplot as plt

    from ffkv.experiments.figures import legend_outside

    layers = sorted(table["layer"].unique())
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers) + 2.0, 3.6), constrained_layout=True,
                             squeeze=False)
    axes = axes[0]
    colors = dict(zip(LATENT_CRITERIA, ("tab:blue", "tab:orange", "tab:green", "tab:gray")))
    for ax, layer in zip(axes, layers):
        own = table[table["layer"] == layer]
        for criterion, rows in own.groupby("criterion", sort=False):
            share = 100 * rows["share"]
            ax.plot(share, rows["perplexity_latents"], marker="o", markersize=3, color=colors[criterion],
                    label=f"{criterion.replace('_', ' ')}, latents")
            ax.plot(share, rows["perplexity_neurons"], marker="x", markersize=3, linestyle="--",
                    color=colors[criterion], label=f"{criterion.replace('_', ' ')}, neurons")
        ax.axhline(float(own["perplexity_base"].iloc[0]), color="black", linewidth=0.6, label="nothing removed")
        ax.set_xlabel(f"share of layer {int(layer) + 1}'s memories removed (%)")
        ax.set_title(f"layer {int(layer) + 1}: {int(own['n_latents'].iloc[0]):,} latents ({own['kind'].iloc[0]}), "
                     f"{int(own['d_m'].iloc[0]):,} neurons", fontsize=8)
    axes[0].set_ylabel("held-out perplexity")
    fig.suptitle(f"Pruning latents beside neurons (n = {int(table['n_tokens'].iloc[0]):,} held-out tokens)",
                 fontsize=9)
    legend_outside(axes[-1])
    return fig




def summary_line(table: pd.DataFrame) -> str:
    """One readable line per criterion: perplexity at 0 and at the summary shares."""
    lines = []
    for _, row in summarize(table).iterrows():
        cells = ", ".join(f"{int(round(s * 100))}%: {row[f'perplexity_{int(round(s * 100))}']:.2f}" for s in SUMMARY_SHARES)
        lines.append(f"{row['criterion']}: 0%: {row['perplexity_0']:.2f}, {cells} (n = {int(row['n_tokens']):,} tokens)")
    return "\n".join(lines)


# ------------------------------------------------ the paper's findings, the fidelity rules, the reading

#: The paper's finding (or the reference's) beside its figure and every table of the study.
FINDING = Finding("Beyond the paper", (
    "The paper leaves pruning open. Held-out perplexity as a growing share of every "
    "layer's keys is removed, one curve per criterion; the seeded random removal is the baseline a "
    "criterion must beat."))
FINDINGS = {NAME: FINDING, f"{NAME}_summary": FINDING, LATENTS: Finding("Beyond the paper", (
    "Is a sparse dictionary's layer more prunable than the layer's neurons? Held-out perplexity as a growing share "
    "of one layer's latents is switched off (the dictionary's error term kept), beside as large a share of the same "
    "layer's neurons removed by the same criterion."))}


def reading(name: str, table: pd.DataFrame) -> str | None:
    """pruning_latents at half of each dictionary layer removed: per criterion the two perplexities and the paired
    difference of the per-example NLL. Layers count from 1."""
    if name != LATENTS or "perplexity_latents" not in table:
        return None
    half = table[table["share"] == 0.5]
    parts = []
    for layer, own in half.groupby("layer"):
        cells = "; ".join(
            f"{r.criterion.replace('_', ' ')}: {r.perplexity_latents:.2f} against {r.perplexity_neurons:.2f} "
            f"(NLL difference {r.nll_latents_minus_neurons:+.3f} [{r.nll_latents_minus_neurons_ci_low:+.3f}, "
            f"{r.nll_latents_minus_neurons_ci_high:+.3f}])" for r in own.itertuples())
        parts.append(f"layer {int(layer) + 1} (nothing removed: {own['perplexity_base'].iloc[0]:.2f}), half of the "
                     f"latents against half of the neurons removed, {cells}")
    return ("Held-out perplexity, " + "; ".join(parts) + ". A positive difference: removing the latents costs "
            "more than removing as large a share of the layer's neurons. The dictionary's error term stays in, so "
            "removing every latent still leaves the part of the layer its reconstruction misses: read it beside "
            "the dictionary's fidelity (latents_beside_dictionary).")


EXPERIMENT = Experiment(
    name=NAME, title="Pruning memories: held-out perplexity against the share of keys removed (beyond the paper)",
    section="beyond the paper", order=9, compute=compute, draw=draw, held_out=True,
    own_pass=("one held-out pass per criterion and share removed, those memories masked (a changed model each "
              "time); its corpus sample's activation statistics are the explorer's (`lookups.sample_statistics`, "
              "one pass for both)"),
    after=("census",),  # its census criterion reads the census of this call
    encoder=Encoder(False, "pruning curves (beyond the paper)", "not computed: perplexity is a causal LM's; `ffkv "
                    "prune` still writes a smaller encoder"),
    latents=(f"{LATENTS}: a share of each dictionary layer's latents switched off, beside the same share of its "
             "neurons, held-out perplexity per criterion (activation frequency, value norm, contribution, random)"),
    findings=FINDINGS, reading=reading, reading_rows={f"{NAME}_summary": 10}, module=__name__)


__all__ = ["CENSUS_GROUPS", "CRITERIA", "KeyStatistics", "Perplexity", "SHARES", "census_order",
           "census_provenance", "check_criterion", "heldout_perplexity", "key_statistics", "keys_to_remove",
           "perplexity", "read_census", "redundancy_order", "removal_orders", "summarize", "summary_line"]
