"""A census of every memory (docs/definitions.md, beyond the paper): dead keys, token/n-gram detectors,
positional keys, and what each value does to the vocabulary.

Over every real position of the held-out examples (the examples of `RunContext.held_out`, all
their tokens, not only the seeded position), per layer l and key i:

- **activation frequency**: the share of positions where the key is active by the one rule of
  `ffkv.memories.active` (|m_i| > tau·s_l, s_l the RMS of the layer's coefficients over these
  positions; m_i > 0 for ReLU), split into positive (m_i > 0) and negative (m_i < 0) shares;
  **dead**: never active.
- **strong**: at a position that competes for trigger examples (not a special token such as BOS:
  `Batch.competes`), active, and |m_i| at least `STRONG_SHARE` of the key's largest |m_i| over such
  positions: the key's strongest activations, the ones its trigger examples are made of. A key
  that fires at one level (a ReLU key on a token) fires strongly wherever it is active.
- **detector**: the token or n-gram rule "the last n tokens up to the position are g" (n in
  `NGRAMS`) that best predicts where the key fires strongly, with its precision P(strong | g),
  recall P(g | strong) and F1 = 2·P·R/(P + R); a detector when F1 >= `DETECTOR_F1` on at least
  `DETECTOR_MIN_HITS` strong positions where the rule holds (fewer is an anecdote). Against
  mere activity a gated or GELU key, active at most positions, could never be one (stories260K,
  SwiGLU: no detector in any layer; against strong activations 66% of its first layer's keys, on 66,321 PTB positions).
  The largest |m_i| grows slowly with the sample, so the strong set narrows slowly with it.
- **positional**: the share of m_i's variance over positions explained by the position index
  (eta², adjusted for the number of positions, i.e. epsilon² = 1 - (SS_within/(n - G)) /
  (SS_total/(n - 1)); positions past `POSITION_GROUPS` - 1 pooled); positional when it is
  >= `POSITIONAL_ETA2`.
- **value type**, read with the sign the key fires with (a key active mostly with m_i < 0 writes
  -v_i): the skew and excess kurtosis of the written vector's logits N(±v_i)·Eᵀ over the
  vocabulary (Gurnee et al. 2024): prediction (kurtosis >= `KURTOSIS_MIN`, skew >= `SKEW_MIN`:
  a few tokens pushed up), suppression (kurtosis >= `KURTOSIS_MIN`, skew <= -`SKEW_MIN`: a few
  pushed down), else neither. A key that fires both ways (each sign at least `TWO_WAY_SHARE` of
  its activations) is flagged ``two_way``; its value type is that of its more frequent sign, and
  the other sign writes the mirror type.
- **eraser**: a detector whose written vector, with the sign the key fires with strongly on its
  rule's positions, pushes the rule's last token down: that token's logit is at most `ERASER_Z` standard
  deviations below the mean logit of the written vector (Voita et al. 2023's detector-eraser).
- **class**: dead, else detector, else positional, else other (first that holds).

Memory, streaming (three passes over the held-out sample; nothing grows with it): per layer
d_m x (6 + `POSITION_GROUPS`) float64 sums, and per n-gram length d_m x `CANDIDATES` candidate
rules (a Misra-Gries summary of the rules seen at the key's strong positions, merged batch by
batch: Agarwal et al. 2012, "Mergeable summaries"), whose exact counts a third pass takes. A rule
missed by the summary has fewer than n_strong/(`CANDIDATES` + 1) hits, hence F1 < 2/(`CANDIDATES`
+ 1) = 0.12: below the detector threshold, so every detector is found exactly. At the paper's
shape (16 x 4,096 keys, 2 n-gram lengths) the state is 16·4,096·(70·8 + 2·16·40) B = 120 MB, plus
one batch's d_m x (distinct rules of the batch) counts per layer at a time; d_m x |V| is never
held. Values are projected `chunk_size` keys at a time (`ffkv.memories.projection`).

**Latents** (a run indexed with ``--dictionary``; docs/definitions.md "Latents beside neurons"):
the same classes for the dictionary's latents, read in the same three passes (no pass of their own): the
activations a_j of each layer the dictionary covers are computed (`ffkv.memories.latent_keys.LatentKeys`, exactly the
index's, control latents included) from the quantity their keys read, captured by the same hooks, and fed on the
positions the layer's neurons are fed on (massive positions left out alike), each layer in a one-layer accumulator
whose active rule is a_j > 0 (a_j >= 0: one sign, no two-way latent). Decisions where the definitions were silent: dead is
the index's rule for latents (never fired over the indexed corpus: no trigger row), as patterns_latents reads it;
detector and positional shares are judged among live memories (a dictionary with many dead latents is not thereby
read as having few detectors), dead among every memory; value types read the decoder row, set beside the neurons'
without a random-direction control (a control latent borrows its value). Per measure each kind stands beside its
own random directions (control latents, random key directions) and the latents' excess minus the neurons' is given
with its MOVER interval; a verdict only where every kind and control has `MIN_N` memories judged. The token-
frequency memories of confidence_neurons are that study's, not the census's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ffkv.allocator import release
from ffkv.batching import RowBatches, length_batches
from ffkv.errors import FfkvError
from ffkv.experiments.common import (MIN_N, RunContext, as_numpy, beside_neurons, control_with_interval,
                                     excess_beside_neurons, progress_bar, sample_size_warnings, share_with_interval)
from ffkv.experiments.dead import dead_keys
from ffkv.experiments.figures import COLORS, interval_bars, kinds_beside, layer_axis, legend_outside, new_figure
from ffkv.experiments.heldout import active_scale, active_threshold
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.memories.latent_keys import LatentKeys
from ffkv.memories.latent_keys import SparseCoefficients
from ffkv.memories.active import MASSIVE_FACTOR, RULE, active_fraction
from ffkv.memories.controls import RandomKeys
from ffkv.memories.projection import chunk_size
from ffkv.memories.projection import logits as project
from ffkv.presentation.findings import layer_ends, pct, share_ci

NAME = "census"
#: n-gram lengths of the detector rules (1: the token at the position; 2: it and the one before).
NGRAMS = (1, 2)
#: Candidate rules kept per key and n-gram length (see the module docstring for why 16 is exact enough).
CANDIDATES = 16
#: Positions 0..POSITION_GROUPS-2 are their own group for eta²; later positions share the last one.
POSITION_GROUPS = 64
#: Thresholds (docs/definitions.md, calibrated on planted keys and random ones: tests/experiments/test_census.py).
DETECTOR_F1 = 0.5
DETECTOR_MIN_HITS = 5
#: Strong activation: active, and |m_i| at least this share of the key's largest |m_i| over the census positions
#: that compete for trigger examples (special tokens never do).
STRONG_SHARE = 0.5
POSITIONAL_ETA2 = 0.5
KURTOSIS_MIN = 3.0
SKEW_MIN = 1.0
ERASER_Z = -3.0
TWO_WAY_SHARE = 0.25
#: Random directions drawn to measure, on this model's own unembedding, how often a value with no structure is
#: classed prediction or suppression (the value type's false-positive rate, in the table's description).
NULL_DIRECTIONS = 1000
CLASSES = ("dead", "detector", "positional", "other")
VALUE_TYPES = ("prediction", "suppression", "neither")
#: Keys per (layer, category) in the table of the most typical keys.
TYPICAL = 5
#: Tokens of the written vector's top and bottom shown in the typical table.
SHOWN_TOKENS = 3
#: Padded tokens per census batch: bounds the per-batch (positions x d_m) coefficients and (d_m x rules) counts.
BATCH_TOKENS = 2048


def ngram_ids(tokens: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """Per position (B, T), the id of the n-gram ending there (x_{j-n+1}..x_j as one int64), -1 where the
    example has fewer than n tokens up to j. ``tokens`` holds -1 at padding."""
    out = tokens.clone()
    for back in range(1, n):
        shifted = torch.full_like(tokens, -1)
        shifted[:, back:] = tokens[:, :-back]
        out = torch.where((out >= 0) & (shifted >= 0), shifted * vocab ** back + out, torch.full_like(out, -1))
    return out


def ngram_tokens(rule_id: int, n: int, vocab: int) -> list[int]:
    """The token ids of an n-gram id of `ngram_ids`, first token first."""
    out = []
    for back in range(n - 1, -1, -1):
        out.append(int(rule_id // vocab ** back) % vocab)
    return out


@dataclass
class LayerState:
    """The streaming sums of one layer (float64 sums on the host; candidate rules per n-gram length)."""

    d_m: int
    sum_m: torch.Tensor = None
    sum_m2: torch.Tensor = None
    group_sum: torch.Tensor = None          # (POSITION_GROUPS, d_m)
    positions: int = 0                      # positions counted (massive-activation positions are not)
    group_count: torch.Tensor = None        # (POSITION_GROUPS,) positions counted per position group
    n_positive: torch.Tensor = None
    n_negative: torch.Tensor = None
    n_strong: torch.Tensor = None
    max_abs: torch.Tensor = None            # the largest |m_i| at a competing position (d_m,)
    ids: dict = field(default_factory=dict)      # n -> (d_m, CANDIDATES) int64 rule ids, -1 empty
    counts: dict = field(default_factory=dict)   # n -> (d_m, CANDIDATES) float64 summary counts
    hits: dict = field(default_factory=dict)     # n -> exact strong positions where the rule holds
    hits_positive: dict = field(default_factory=dict)  # n -> those with m_i > 0
    support: dict = field(default_factory=dict)  # n -> positions where the rule holds

    def __post_init__(self) -> None:
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.sum_m, self.sum_m2 = z(self.d_m), z(self.d_m)
        self.group_sum = z(POSITION_GROUPS, self.d_m)
        self.group_count = z(POSITION_GROUPS)
        self.n_positive, self.n_negative, self.n_strong, self.max_abs = (z(self.d_m) for _ in range(4))
        for n in NGRAMS:
            self.ids[n] = torch.full((self.d_m, CANDIDATES), -1, dtype=torch.long)
            for name in ("counts", "hits", "hits_positive", "support"):
                getattr(self, name)[n] = z(self.d_m, CANDIDATES)


def _batch_counts(rules: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Distinct rule ids of a batch's positions (U,), per weight (P, d_m) the (d_m, U) sums over the positions
    where each rule holds, and each rule's number of positions (U,). Positions whose rule id is negative (no
    rule) are left out. A boolean weight is counted from its true entries (`_rule_counts`), another summed in
    float64."""
    return _rule_counts(rules, [torch.nonzero(w, as_tuple=True) if w.dtype == torch.bool else w for w in weights],
                        weights[0].shape[1] if weights else 0)


def _rule_counts(rules: torch.Tensor, weights: list, d_m: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """`_batch_counts` with each boolean weight given as its true entries (positions, keys): strong entries are a
    few percent of a batch's, so they are counted alone, as int64, found once for every n-gram length. A weight
    given as a (P, d_m) tensor is summed in float64 row by row into (U, d_m). Each comes back as the transposed
    (d_m, U) view."""
    unique, inverse = torch.unique(rules, return_inverse=True)
    skip = int((unique < 0).sum())  # sorted: the negative ids come first
    U = len(unique)
    out = []
    for w in weights:
        if isinstance(w, tuple):
            positions, keys = w
            counts = torch.bincount(inverse[positions] * d_m + keys, minlength=U * d_m).view(U, d_m)
        else:
            counts = torch.zeros(U, d_m, dtype=torch.float64)
            counts.index_add_(0, inverse, w.double())
        out.append(counts[skip:].T)
    return unique[skip:], out, torch.bincount(inverse, minlength=U)[skip:].double()


def _lookup(unique: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each id in the sorted `unique`, whether it is there)."""
    if not len(unique):
        return torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    where = torch.searchsorted(unique, ids.clamp(min=0)).clamp(max=len(unique) - 1)
    return where, (unique[where] == ids) & (ids >= 0)


def merge_summary(ids: torch.Tensor, counts: torch.Tensor, unique: torch.Tensor,
                  batch: torch.Tensor, k: int = CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a batch's exact counts (d_m, U) of rules `unique` into each key's Misra-Gries summary of k counters
    (ids, counts: (d_m, k)): add the counts of rules already kept, then keep the k largest after subtracting the
    (k+1)-th largest. A rule's summary count is never above its true count and at most n/(k+1) below it
    (n: the key's counted (strong) positions so far).

    The k largest are taken by one `torch.topk` over [kept counts | batch counts] per key, in that order: which of
    equal counts it keeps, and in which slot, follows that row, so the row is built whole (the ids are not)."""
    batch = batch.to(torch.float64, memory_format=torch.contiguous_format, copy=True)
    where, there = _lookup(unique, ids)
    counts = counts + torch.where(there, batch.gather(1, where), torch.zeros_like(counts))
    rows, slots = torch.nonzero(there, as_tuple=True)
    batch[rows, where[rows, slots]] = 0  # counted in the kept counter (a key's kept ids are distinct)
    counts = torch.where(ids >= 0, counts, torch.zeros_like(counts))  # an empty counter counts nothing
    if len(unique) and int(unique[0]) < 0:  # a rule id below 0 is none (sorted: they come first)
        batch[:, unique < 0] = 0
    all_counts = torch.cat([counts, batch], dim=1)
    kept_slots = ids.shape[1]
    if all_counts.shape[1] <= k:
        all_ids = torch.cat([ids, unique[None, :].expand(ids.shape[0], -1)], dim=1)
        pad = k - all_counts.shape[1]
        return (torch.cat([all_ids, torch.full((ids.shape[0], pad), -1, dtype=torch.long)], 1),
                torch.cat([all_counts, torch.zeros(ids.shape[0], pad, dtype=all_counts.dtype)], 1))
    top, index = torch.topk(all_counts, k + 1, dim=1)
    kept = top[:, :k] - top[:, k:k + 1]
    index = index[:, :k]
    new_ids = torch.where(index < kept_slots, ids.gather(1, index.clamp(max=kept_slots - 1)),
                          unique[(index - kept_slots).clamp(min=0)])
    alive = kept > 0
    return torch.where(alive, new_ids, torch.full_like(new_ids, -1)), torch.where(alive, kept, torch.zeros_like(kept))


def _above(a: torch.Tensor, threshold: float) -> torch.Tensor:
    """|m_i| > tau·s_l, the active rule of `ffkv.memories.active`, for a = |m|, compared exactly as in float64
    whatever a's float dtype (torch would round the threshold to a's dtype first): for float32 a, a > t  <=>
    a >= f when f, t rounded to float32, is above t, else a > f."""
    if a.dtype == torch.float64:
        return a > threshold
    f = float(torch.tensor(threshold, dtype=torch.float64).to(a.dtype))
    return a >= f if f > threshold else a > f


def _at_least(a: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """a >= threshold (float64, per column), compared exactly as in float64 whatever a's float dtype: against the
    smallest value of a's dtype at or above each threshold (the threshold rounded to nearest when that is not
    below it, else the next value up)."""
    if a.dtype == torch.float64:
        return a >= threshold
    f = threshold.to(a.dtype)
    return a >= torch.where(f.double() >= threshold, f, torch.nextafter(f, torch.full_like(f, math.inf)))


class CensusAccumulator:
    """The census statistics of every layer, fed one batch of coefficients at a time, in three passes over the
    same positions: `scale` (sums, largest |m_i|, positions), `summarise` (active and strong counts, candidate
    rules), `count` (exact counts of the candidates). `feed(pass, layer, m, positions, rules, competes)` takes the
    real positions of a batch: m (P, d_m), their position index (P,), the n-gram ids ending at each position, and
    which positions compete for trigger examples (P,) (None: all).

    Args:
        thresholds: per layer tau·s_l of the active rule (`ffkv.memories.active`), from its one owner
            (`ffkv.experiments.heldout.active_scale`); 0 for the m_i > 0 rule of ReLU models.
    """

    def __init__(self, n_layers: int, d_m: int, vocab_size: int, thresholds) -> None:
        self.layers = [LayerState(d_m) for _ in range(n_layers)]
        self.vocab_size, self.d_m = vocab_size, d_m
        self.thresholds = [float(t) for t in thresholds]
        if len(self.thresholds) != n_layers:
            raise ValueError(f"{len(self.thresholds)} thresholds for {n_layers} layers")

    @property
    def positions(self) -> int:
        """Positions counted in the first layer (every layer counts the same unless massive activations are left out)."""
        return self.layers[0].positions

    def threshold(self, layer: int) -> float:
        """tau·s_l of the active rule for `layer`."""
        return self.thresholds[layer]

    def strong_threshold(self, layer: int) -> torch.Tensor:
        """(d_m,) `STRONG_SHARE` of each key's largest |m_i| over the census positions that compete."""
        return STRONG_SHARE * self.layers[layer].max_abs

    def feed(self, step: str, layer: int, m: torch.Tensor, positions: torch.Tensor,
             rules: dict[int, torch.Tensor], competes: torch.Tensor | None = None) -> None:
        """One batch of one layer. rules: n -> (P,) n-gram id per position (-1: none); competes: (P,) bool,
        the positions that compete for trigger examples (None: every position)."""
        s = self.layers[layer]
        m = m.detach().to("cpu")
        if m.dtype not in (torch.float32, torch.float64):
            m = m.float()  # exact: float16 and bfloat16 values are float32 values
        competes = torch.ones(len(m), dtype=torch.bool) if competes is None else competes.to("cpu")
        if step == "scale":
            m64 = m.double()
            s.sum_m += m64.sum(0)
            s.sum_m2 += m64.square().sum(0)
            if bool(competes.any()):  # a maximum is exact in m's own dtype
                torch.maximum(s.max_abs, m[competes].abs().amax(0).double(), out=s.max_abs)
            group = positions.to("cpu").clamp(max=POSITION_GROUPS - 1)
            s.group_sum.index_add_(0, group, m64)
            s.positions += m.shape[0]
            s.group_count.index_add_(0, group, torch.ones(len(group), dtype=torch.float64))
            return
        # The rules of `ffkv.memories.active` and of strong, compared as in float64 (`_above`, `_at_least`).
        magnitude = m.abs()
        active = _above(magnitude, self.threshold(layer))
        strong = active & _at_least(magnitude, self.strong_threshold(layer))
        if not bool(competes.all()):
            strong &= competes[:, None]
        del magnitude
        positive = m > 0
        pairs = torch.nonzero(strong, as_tuple=True)  # (positions, keys) of the strong activations
        if step == "summarise":
            s.n_positive += (active & positive).sum(0)
            s.n_negative += (active & (m < 0)).sum(0)
            s.n_strong += strong.sum(0)
            for n, ids in rules.items():
                unique, (hit,), _ = _rule_counts(ids.to("cpu"), [pairs], self.d_m)
                s.ids[n], s.counts[n] = merge_summary(s.ids[n], s.counts[n], unique, hit)
            return
        up = positive[pairs]
        pairs_positive = (pairs[0][up], pairs[1][up])
        for n, ids in rules.items():
            unique, (hit, hit_pos), support = _rule_counts(ids.to("cpu"), [pairs, pairs_positive], self.d_m)
            where, there = _lookup(unique, s.ids[n])
            zero = torch.zeros_like(s.hits[n])
            s.hits[n] += torch.where(there, hit.gather(1, where), zero)
            s.hits_positive[n] += torch.where(there, hit_pos.gather(1, where), zero)
            s.support[n] += torch.where(there, support[where], zero)

    def key_table(self, layer: int, dead: np.ndarray | None = None) -> pd.DataFrame:
        """Per key of the layer: frequencies, dead, the best rule, eta² (the value columns come later).

        Args:
            dead: (d_m,) the keys never active over the indexed corpus (`ffkv.experiments.dead`), the one rule of
                dead; None: never active at the census positions (for a census without an index)."""
        s = self.layers[layer]
        N = max(s.positions, 1)
        n_active, n_strong = s.n_positive + s.n_negative, s.n_strong
        best = {"f1": torch.zeros(self.d_m, dtype=torch.float64), "n": torch.zeros(self.d_m, dtype=torch.long),
                "id": torch.full((self.d_m,), -1, dtype=torch.long),
                "precision": torch.zeros(self.d_m, dtype=torch.float64),
                "recall": torch.zeros(self.d_m, dtype=torch.float64),
                "support": torch.zeros(self.d_m, dtype=torch.float64),
                "hits": torch.zeros(self.d_m, dtype=torch.float64),
                "hits_positive": torch.zeros(self.d_m, dtype=torch.float64)}
        for n in NGRAMS:  # shorter rules first: a longer one replaces it only with a strictly higher F1
            hits, support = s.hits[n], s.support[n]
            f1 = torch.where(support + n_strong[:, None] > 0, 2 * hits / (support + n_strong[:, None]).clamp(min=1),
                             torch.zeros_like(hits))
            f1 = torch.where(s.ids[n] >= 0, f1, torch.full_like(f1, -1.0))
            value, column = f1.max(1)
            better = value > best["f1"] + 1e-12
            pick = lambda t: t.gather(1, column[:, None])[:, 0]  # noqa: E731
            best["f1"] = torch.where(better, value, best["f1"])
            best["n"] = torch.where(better, torch.full_like(best["n"], n), best["n"])
            best["id"] = torch.where(better, pick(s.ids[n]), best["id"])
            for name, t in (("support", support), ("hits", hits), ("hits_positive", s.hits_positive[n])):
                best[name] = torch.where(better, pick(t), best[name])
        best["precision"] = torch.where(best["support"] > 0, best["hits"] / best["support"].clamp(min=1),
                                        torch.zeros_like(best["hits"]))
        best["recall"] = torch.where(n_strong > 0, best["hits"] / n_strong.clamp(min=1), torch.zeros_like(n_strong))
        mean = s.sum_m / N
        total = s.sum_m2 - s.sum_m.square() / N
        within = total - ((s.group_sum.square() / s.group_count.clamp(min=1)[:, None]).sum(0)
                          - s.sum_m.square() / N)
        eta2 = position_eta2(total, within, N, int((s.group_count > 0).sum()), s.sum_m2)
        has_rule = best["n"] > 0
        rule_sign = torch.where(best["hits_positive"] * 2 >= best["hits"], 1, -1)
        firing_sign = torch.where(s.n_negative > s.n_positive, -1, 1)
        minority = torch.minimum(s.n_positive, s.n_negative)
        return pd.DataFrame({
            "layer": np.full(self.d_m, layer, np.int16), "key": np.arange(self.d_m, dtype=np.int32),
            "n_positions": np.full(self.d_m, s.positions, np.int64),
            "activation_frequency": as_numpy(n_active / N).astype(np.float32),
            "positive_frequency": as_numpy(s.n_positive / N).astype(np.float32),
            "negative_frequency": as_numpy(s.n_negative / N).astype(np.float32),
            "strong_frequency": as_numpy(n_strong / N).astype(np.float32),
            "dead": as_numpy(n_active == 0) if dead is None else np.asarray(dead, dtype=bool),
            "firing_sign": as_numpy(torch.where(n_active > 0, firing_sign, 0)).astype(np.int8),
            "two_way": as_numpy((n_active > 0) & (minority >= TWO_WAY_SHARE * n_active)),
            "rule_n": as_numpy(best["n"]).astype(np.int8),
            "rule_id": as_numpy(best["id"]).astype(np.int64),
            "rule_precision": as_numpy(best["precision"]).astype(np.float32),
            "rule_recall": as_numpy(best["recall"]).astype(np.float32),
            "rule_f1": as_numpy(best["f1"].clamp(min=0)).astype(np.float32),
            "rule_positions": as_numpy(best["support"]).astype(np.int64),
            "rule_hits": as_numpy(best["hits"]).astype(np.int64),
            "rule_sign": as_numpy(torch.where(has_rule & (best["hits"] > 0), rule_sign, 0)).astype(np.int8),
            "position_eta2": as_numpy(eta2).astype(np.float32),
            "mean_coefficient": as_numpy(mean).astype(np.float32),
        })


def position_eta2(total: torch.Tensor, within: torch.Tensor, n: int, groups: int,
                  square_sum: torch.Tensor) -> torch.Tensor:
    """The share of variance explained by position, corrected for the number of groups (epsilon², the adjusted
    eta²: 1 - (SS_within/(n - G)) / (SS_total/(n - 1))), so that coefficients that ignore position score about
    0 on a small sample too (plain eta² expects (G - 1)/(n - 1) there); clipped to [0, 1]; 0 for a constant m
    (a total sum of squares below 1e-9 of Σ m², rounding)."""
    if n <= groups or groups < 2:
        return torch.zeros_like(total)
    varying = total > 1e-9 * square_sum
    eps2 = 1 - (within / (n - groups)) / (total / (n - 1)).clamp(min=1e-300)
    return torch.where(varying, eps2.clamp(0, 1), torch.zeros_like(total))


def value_statistics(view, layer: int, projection: str, signs: np.ndarray, rule_sign: np.ndarray,
                     trigger: np.ndarray, shown: int = SHOWN_TOKENS, memories=None) -> dict[str, np.ndarray]:
    """Per key, of the written vector w_i = s_i·v_i (s_i = `signs`, the sign the key fires with) projected to
    logits z = N(w_i)·Eᵀ: skew and excess kurtosis over the vocabulary and its top and bottom tokens; and the
    standardized logit (z_t - mean z)/std z of token `trigger` (-1: none) in N(r_i·v_i)·Eᵀ, r_i = `rule_sign`:
    what the key writes on its rule's positions. Chunked: at most `chunk_size` keys x |V| logits at a time.
    `memories`: whose values (`ffkv.memories.sets`; default the model's neurons, a dictionary's `Latents` reads its
    decoder rows)."""
    values = (memories or view).values(layer)
    d_m = values.shape[0]
    chunk = chunk_size(view.vocab_size)
    out = {k: [] for k in ("skew", "kurtosis", "trigger_z", "top_ids", "bottom_ids")}
    for start in range(0, d_m, chunk):
        v = values[start:start + chunk].float()
        sign = torch.as_tensor(signs[start:start + chunk], dtype=torch.float32, device=v.device)[:, None]
        rsign = torch.as_tensor(rule_sign[start:start + chunk], dtype=torch.float32, device=v.device)[:, None]
        z = project(view, sign * v, projection)
        mean = z.mean(-1, keepdim=True)
        centred = z - mean
        var = centred.square().mean(-1, keepdim=True)
        std = var.sqrt().clamp(min=1e-12)
        out["skew"].append((centred.pow(3).mean(-1, keepdim=True) / std.pow(3))[:, 0])
        out["kurtosis"].append((centred.pow(4).mean(-1, keepdim=True) / var.square().clamp(min=1e-24) - 3.0)[:, 0])
        out["top_ids"].append(torch.topk(z, min(shown, z.shape[1]), -1).indices)
        out["bottom_ids"].append(torch.topk(-z, min(shown, z.shape[1]), -1).indices)
        t = torch.as_tensor(trigger[start:start + chunk], dtype=torch.long, device=v.device)
        same = (rsign == sign)[:, 0]
        if bool(same.all()):
            zr = z
        elif projection == "identity":  # logits are linear in the vector there: N(-v)·Eᵀ = -(N(v)·Eᵀ)
            zr = z * (rsign * sign)
        else:
            zr = project(view, rsign * v, projection)
        mr, sr = zr.mean(-1), zr.std(-1, unbiased=False).clamp(min=1e-12)
        tz = (zr.gather(1, t.clamp(min=0)[:, None])[:, 0] - mr) / sr
        out["trigger_z"].append(torch.where(t >= 0, tz, torch.full_like(tz, float("nan"))))
        del z, centred, zr
    release()  # the chunks' |V|-wide temporaries, freed (`ffkv.allocator`)
    return {k: as_numpy(torch.cat(v)) for k, v in out.items()}


def value_type(skew: np.ndarray, kurtosis: np.ndarray) -> np.ndarray:
    """prediction / suppression / neither from the written vector's logits (thresholds of this module)."""
    peaked = np.asarray(kurtosis) >= KURTOSIS_MIN
    return np.where(peaked & (np.asarray(skew) >= SKEW_MIN), "prediction",
                    np.where(peaked & (np.asarray(skew) <= -SKEW_MIN), "suppression", "neither"))


def classify(keys: pd.DataFrame) -> pd.DataFrame:
    """The flags and the class of each key from its statistics (in place; returns it)."""
    keys["detector"] = ~keys["dead"] & (keys["rule_f1"] >= DETECTOR_F1) & (keys["rule_hits"] >= DETECTOR_MIN_HITS)
    keys["positional"] = ~keys["dead"] & (keys["position_eta2"] >= POSITIONAL_ETA2)
    keys["value_type"] = value_type(keys["skew"], keys["kurtosis"])
    keys["eraser"] = keys["detector"] & (keys["trigger_z"] <= ERASER_Z)
    keys["class"] = np.where(keys["dead"], "dead", np.where(keys["detector"], "detector",
                             np.where(keys["positional"], "positional", "other")))
    return keys


@torch.no_grad()
def null_rates(view, projection: str, n: int = NULL_DIRECTIONS, seed: int = 0) -> dict[str, float]:
    """Shares of n random Gaussian directions (in the value space, scaled like values are irrelevant: skew and
    kurtosis are scale-free under the identity) classed prediction and suppression on this model's E: the value
    type's false-positive rate here."""
    g = torch.Generator().manual_seed(seed)
    skews, kurts = [], []
    chunk = chunk_size(view.vocab_size)
    scale = float(view.values(0).float().norm(dim=1).mean()) / math.sqrt(view.d_model)
    for start in range(0, n, chunk):
        v = (torch.randn(min(chunk, n - start), view.d_model, generator=g) * scale).to(view.device)
        z = project(view, v, projection)
        c = z - z.mean(-1, keepdim=True)
        var = c.square().mean(-1)
        skews.append(as_numpy(c.pow(3).mean(-1) / var.pow(1.5).clamp(min=1e-36)))
        kurts.append(as_numpy(c.pow(4).mean(-1) / var.square().clamp(min=1e-24) - 3.0))
    kinds = value_type(np.concatenate(skews), np.concatenate(kurts))
    return {kind: float((kinds == kind).mean()) for kind in ("prediction", "suppression")}


def _batches(ctx: RunContext) -> RowBatches:
    """Every held-out example, whole (no masked token), in padded batches; every rank runs every batch (the
    census is summed over all positions and is not split under torchrun)."""
    from ffkv.batching import BATCH_SIZE, _Row

    held = ctx.held_out()
    items = [_Row(i, np.asarray(e.token_ids, dtype=np.int64)) for i, e in enumerate(held.examples)]
    return RowBatches(length_batches(items, BATCH_SIZE, BATCH_TOKENS), ctx.tokenizer.pad_id,
                      tuple(sorted(ctx.special_ids)), ctx.view.device)


@torch.no_grad()
def accumulate(view, batches, vocab_size: int, thresholds, progress: bool = False,
               control: RandomKeys | None = None, massive_rms: np.ndarray | None = None,
               latents: LatentKeys | None = None) -> tuple[CensusAccumulator, CensusAccumulator | None, dict]:
    """The three streaming passes over `batches` (padded `Batch`es or (rows, Batch) pairs), for the model's keys
    and, with `control`, for its random control memories (read from the same passes' FF inputs).

    Args:
        massive_rms: per layer, the RMS of a position's coefficients above which it carries a massive activation
            (`MASSIVE_FACTOR` x the median of `ffkv.experiments.heldout.active_scale`): such positions are left out
            of every statistic of that layer (a key's largest |m_i|, position shares, counts), for the control too.
        latents: a dictionary's latents and their control latents (`ffkv.memories.latent_keys.LatentKeys`, exactly the
            index's activations), read in the same passes from the quantity each layer's keys read (the FF input
            of a transcoder, the FF output of an SAE) on the positions the layer's neurons are counted on.

    Returns the keys' accumulator, the control's (or None), and per dictionary layer (latents, control latents or
    None), each a one-layer accumulator whose active rule is a_j > 0.
    """
    acc = CensusAccumulator(view.n_layers, view.d_m, vocab_size, thresholds)
    acc_control = CensusAccumulator(view.n_layers, control.n, vocab_size, thresholds) if control else None
    latent_accs = {layer: (CensusAccumulator(1, d.n_latents, vocab_size, [0.0]),
                           CensusAccumulator(1, latents.n_control, vocab_size, [0.0]) if latents.n_control else None)
                   for layer, d in latents.dictionaries.items()} if latents is not None else {}
    state: dict = {}

    def feed(target: CensusAccumulator, layer: int, m: torch.Tensor, keep: torch.Tensor | None) -> None:
        positions, rules, competes = state["positions"], state["rules"], state["competes"]
        if keep is not None:
            keep_host = keep.cpu()
            m, positions, competes = m[keep], positions[keep_host], competes[keep_host]
            rules = {n: r[keep_host] for n, r in rules.items()}
        target.feed(state["step"], layer, m, positions, rules, competes)

    def feed_latents(layer: int) -> None:
        # A dictionary layer's latents, once both they and the layer's kept positions are known (a transcoder
        # reads the FF input, before the coefficients; an SAE the FF output, after them).
        if ("latents", layer) in state and ("keep", layer) in state:
            keep = state.pop(("keep", layer))
            for target, a in zip(latent_accs[layer], state.pop(("latents", layer))):
                if target is not None:
                    feed(target, 0, a, keep)

    def sink(name: str, layer: int, t: torch.Tensor) -> None:
        if layer in latent_accs and name == latents.reads(layer):
            found = latents.coefficients(layer, t)
            state[("latents", layer)] = [(c.dense() if isinstance(c, SparseCoefficients) else c)[state["mask"]]
                                         for c in found]
            feed_latents(layer)
        if name != "coefficients":
            if name == "ff_in" and control is not None:
                # the control memories' coefficients, fed once the layer's own tell which positions count
                state["control"] = control.coefficients(layer, t)[state["mask"]]
            return
        m = t[state["mask"]]
        keep = None
        if massive_rms is not None and massive_rms[layer] > 0:
            keep = m.float().square().mean(-1).sqrt() <= float(massive_rms[layer])
        feed(acc, layer, m, keep)
        if control is not None:
            feed(acc_control, layer, state.pop("control"), keep)
        if layer in latent_accs:
            state[("keep", layer)] = keep
            feed_latents(layer)

    steps = ("scale", "summarise", "count")
    quantities = ("coefficients", "ff_in") if control else ("coefficients",)
    if latents is not None:
        quantities = tuple(dict.fromkeys((*quantities, *(latents.reads(layer) for layer in latent_accs))))
    bar = progress_bar(progress, len(steps) * len(batches), "census", "batch")
    try:
        for step in steps:
            state["step"] = step
            with view.capture(quantities, sink=sink, stop_early=True):
                for item in batches:
                    batch = item[1] if isinstance(item, tuple) else item
                    mask = batch.attention_mask.bool()
                    tokens = torch.where(mask, batch.input_ids, torch.full_like(batch.input_ids, -1))
                    state["mask"] = mask.to(view.device)
                    state["positions"] = torch.nonzero(mask)[:, 1].cpu()
                    state["competes"] = batch.competes[mask].cpu()
                    state["rules"] = {} if step == "scale" else {
                        n: ngram_ids(tokens.cpu(), n, vocab_size)[mask.cpu()] for n in NGRAMS}
                    view.forward(batch.input_ids.to(view.device), batch.attention_mask.to(view.device))
                    bar.update(1)
    finally:
        bar.close()
    return acc, acc_control, latent_accs


#: The columns of the per-memory table (census, census_latents_keys), in order.
KEY_COLUMNS = ["layer", "key", "class", "n_positions", "activation_frequency", "positive_frequency",
               "negative_frequency", "strong_frequency", "dead", "firing_sign", "two_way", "rule", "rule_n", "rule_id",
               "rule_precision", "rule_recall", "rule_f1", "rule_positions", "rule_hits", "rule_sign", "detector",
               "position_eta2", "positional", "mean_coefficient", "skew", "kurtosis", "value_type", "trigger_z",
               "eraser", "written_top", "written_bottom"]


def classified(ctx: RunContext, tables: list[pd.DataFrame], memories=None) -> pd.DataFrame:
    """The per-memory tables of `CensusAccumulator.key_table` (one per layer) with their value columns (read
    with each memory's firing sign, from `memories`' values: default the neurons), classed, their rules in words."""
    V = ctx.view.vocab_size
    for keys in tables:
        layer = int(keys["layer"].iloc[0])
        signs = np.where(keys["firing_sign"].to_numpy() < 0, -1, 1)
        rule_sign = np.where(keys["rule_sign"].to_numpy() < 0, -1, 1)
        trigger = np.where(keys["rule_n"].to_numpy() > 0, keys["rule_id"].to_numpy() % V, -1)
        stats = value_statistics(ctx.view, layer, ctx.projections.values, signs, rule_sign, trigger,
                                 memories=memories)
        keys["skew"] = stats["skew"].astype(np.float32)
        keys["kurtosis"] = stats["kurtosis"].astype(np.float32)
        keys["trigger_z"] = stats["trigger_z"].astype(np.float32)
        keys["written_top"] = [" · ".join(ctx.tokens(ids)) for ids in stats["top_ids"]]
        keys["written_bottom"] = [" · ".join(ctx.tokens(ids)) for ids in stats["bottom_ids"]]
    keys = classify(pd.concat(tables, ignore_index=True))
    keys["rule"] = [rule_text(ctx, int(n), int(i), V) for n, i in zip(keys["rule_n"], keys["rule_id"])]
    return keys[KEY_COLUMNS]


def census_tables(ctx: RunContext) -> dict:
    """Every key classed from one pass over the held-out examples: per key, per layer, typical keys, the control."""
    view = ctx.view
    V = view.vocab_size
    batches = list(_batches(ctx))
    thresholds = active_threshold(ctx)
    control = RandomKeys(view, ctx.manifest.control_keys, ctx.manifest.identity.index.get("control_seed", 0)) \
        if ctx.has_control else None
    massive = MASSIVE_FACTOR * active_scale(ctx).median_rms if active_fraction(view) > 0 else None
    latents, unread = latent_keys(ctx)
    acc, acc_control, latent_accs = accumulate(view, batches, V, thresholds, ctx.progress, control, massive, latents)
    dead = dead_keys(ctx)
    keys = classified(ctx, [acc.key_table(layer, dead[layer]) for layer in range(view.n_layers)])
    result = {"keys": keys, "per_layer": per_layer(keys, thresholds), "typical": typical(keys),
              "positions": acc.positions, "n_examples": len(ctx.held_out().examples), "thresholds": thresholds,
              "unread": unread}
    if acc_control is not None:
        dead_control = dead_keys(ctx, control=True)
        c = pd.concat([acc_control.key_table(layer, dead_control[layer]) for layer in range(view.n_layers)],
                      ignore_index=True)
        c["skew"] = c["kurtosis"] = c["trigger_z"] = np.nan  # a control memory's value is borrowed: no value type
        c = classify(c)
        c["source_key"] = ctx.control_sources()[c["layer"].to_numpy(int), c["key"].to_numpy(int)]
        result["control"] = c[CONTROL_COLUMNS]
        result["per_layer"] = result["per_layer"].merge(control_shares(keys, result["control"]), on="layer")
    if latent_accs:
        result["latents"] = latent_census(ctx, latent_accs, keys, result.get("control"))
    return result


#: The control columns of a census table (census_control, census_latents_control).
CONTROL_COLUMNS = ["layer", "key", "source_key", "class", "activation_frequency", "strong_frequency", "dead",
                   "rule_f1", "rule_hits", "detector", "position_eta2", "positional"]


def latent_keys(ctx: RunContext) -> tuple[LatentKeys | None, list[str]]:
    """The run's dictionary as the index read it (`RunContext.latent_keys`); None for a run without latents, or one
    whose dictionary is gone or changed (with `RunContext.latents_for`'s line saying why)."""
    latents, unread = ctx.latents_for(f"{NAME}_latents")
    if latents is None:
        return None, unread
    return ctx.latent_keys(), []


#: What the latents are set beside the neurons on (census_latents): measure -> (the memories judged, the flag).
#: Dead is judged among every memory; a detector or positional memory among the live ones, so that a kind with
#: more dead memories is not thereby read as having fewer detectors.
LATENT_MEASURES = {
    "dead": (lambda k: np.ones(len(k), dtype=bool), lambda k: k["dead"].to_numpy(bool)),
    "detector": (lambda k: ~k["dead"].to_numpy(bool), lambda k: k["detector"].to_numpy(bool)),
    "positional": (lambda k: ~k["dead"].to_numpy(bool), lambda k: k["positional"].to_numpy(bool)),
}
#: Value types set beside the neurons' among live memories (no random-direction control: a control latent borrows
#: its value, as a control key does).
LATENT_VALUE_TYPES = ("prediction", "suppression")


def latent_census(ctx: RunContext, accs: dict, neuron_keys: pd.DataFrame,
                  neuron_control: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    """The census of a dictionary's latents from the passes that classed the neurons (`accumulate`): per latent
    (census_latents_keys), per control latent (census_latents_control) and per layer the dictionary covers
    (census_latents), each measure of `LATENT_MEASURES` for latents and neurons, each beside its own control,
    and the latents' excess minus the neurons' (`ffkv.experiments.common.excess_beside_neurons`).

    A latent is dead when it never fired over the indexed corpus (no row in latent_trigger_examples.parquet, the
    rule of the index: a_j > 0); its control latents likewise (latent_control_trigger_examples.parquet)."""
    memories = ctx.memories("latents")
    fired = ctx.triggers(1, source="latents")
    fired_control = ctx.triggers(1, control=True, source="latents") if ctx.has_latent_control else None

    def never_fired(table: pd.DataFrame, layer: int, n: int) -> np.ndarray:
        return ~np.isin(np.arange(n), table.loc[table["layer"] == layer, "key"].to_numpy())

    def at(table: pd.DataFrame, layer: int) -> pd.DataFrame:
        return table[table["layer"] == layer]

    tables, controls = [], []
    for layer, (acc, acc_control) in accs.items():
        t = acc.key_table(0, never_fired(fired, layer, acc.d_m))
        tables.append(t.assign(layer=np.full(len(t), layer, np.int16)))
        if acc_control is not None:
            c = acc_control.key_table(0, never_fired(fired_control, layer, acc_control.d_m))
            c = c.assign(layer=np.full(len(c), layer, np.int16))
            c["skew"] = c["kurtosis"] = c["trigger_z"] = np.nan  # a control latent's value is borrowed: no value type
            c = classify(c)
            c["source_key"] = ctx.latent_control_sources()[layer][c["key"].to_numpy(int)]
            controls.append(c[CONTROL_COLUMNS])
    keys = classified(ctx, tables, memories)
    control = pd.concat(controls, ignore_index=True) if controls else pd.DataFrame(columns=CONTROL_COLUMNS)
    rows = []
    for layer, (acc, _) in accs.items():
        k, c, nk = at(keys, layer), at(control, layer), at(neuron_keys, layer)
        nc = at(neuron_control, layer) if neuron_control is not None else neuron_keys.iloc[0:0]
        row = {"layer": int(layer), "n_latents": int(len(k)), "n_control_latents": int(len(c)),
               "n_neurons": int(len(nk)), "n_control_neurons": int(len(nc)), "n_positions": int(acc.positions)}
        for name, (judged, flag) in LATENT_MEASURES.items():
            row.update(excess_beside_neurons(*(flag(t)[judged(t)] for t in (k, c, nk, nc)), name))
        live, live_neurons = k[~k["dead"].to_numpy(bool)], nk[~nk["dead"].to_numpy(bool)]
        row.update({"n_live_latents": int(len(live)), "n_live_neurons": int(len(live_neurons))})
        for kind in LATENT_VALUE_TYPES:
            mine = live["value_type"].to_numpy() == kind
            row.update(share_with_interval(mine, f"share_{kind}"))
            row.update(beside_neurons(mine, live_neurons["value_type"].to_numpy() == kind, f"share_{kind}"))
        row["mean_activation_frequency_latents"] = float(live["activation_frequency"].mean()) if len(live) else np.nan
        row["mean_activation_frequency_neurons"] = float(live_neurons["activation_frequency"].mean()) \
            if len(live_neurons) else np.nan
        rows.append(row)
    return {"keys": keys, "control": control, "per_layer": pd.DataFrame(rows)}


#: Census shares set beside the random control memories (value types are left out: a control memory borrows its
#: value from a real key, so its value type is that key's).
CONTROLLED = ("dead", "detector", "positional", "any_detector", "any_positional")


def control_shares(keys: pd.DataFrame, control: pd.DataFrame) -> pd.DataFrame:
    """Per layer, each class share of `CONTROLLED` among the random control memories beside the keys' share
    (Newcombe's interval of the difference)."""
    rows = []
    for layer, g in keys.groupby("layer", sort=True):
        c = control[control["layer"] == layer]
        row = {"layer": int(layer), "n_control_keys": int(len(c))}
        for name in CONTROLLED:
            row.update(control_with_interval(SHARES[name](g).to_numpy(bool), SHARES[name](c).to_numpy(bool),
                                             f"share_{name}"))
        rows.append(row)
    return pd.DataFrame(rows)


def rule_text(ctx: RunContext, n: int, rule_id: int, vocab: int) -> str:
    """A rule as a reader reads it: the n-gram's tokens, joined by '·' (empty: none)."""
    if n <= 0 or rule_id < 0:
        return ""
    return " · ".join(repr(t) for t in ctx.tokens(ngram_tokens(rule_id, n, vocab)))


#: Per-layer shares: table column -> the per-key boolean it counts.
SHARES = {"dead": lambda k: k["dead"], "detector": lambda k: k["class"] == "detector",
          "positional": lambda k: k["class"] == "positional", "other": lambda k: k["class"] == "other",
          "any_detector": lambda k: k["detector"], "any_positional": lambda k: k["positional"],
          "prediction": lambda k: k["value_type"] == "prediction",
          "suppression": lambda k: k["value_type"] == "suppression",
          "eraser": lambda k: k["eraser"], "two_way": lambda k: k["two_way"]}


def per_layer(keys: pd.DataFrame, thresholds: list[float]) -> pd.DataFrame:
    """Per layer: the share of keys in each class and with each flag, n keys, 95% Wilson intervals."""
    rows = []
    for layer, g in keys.groupby("layer", sort=True):
        row = {"layer": int(layer), "n_keys": int(len(g)), "n_positions": int(g["n_positions"].iloc[0])}
        for name, rule in SHARES.items():
            row.update(share_with_interval(rule(g).to_numpy(bool), f"share_{name}"))
        row["mean_activation_frequency"] = float(g["activation_frequency"].mean())
        row["active_threshold"] = float(thresholds[int(layer)])
        rows.append(row)
    return pd.DataFrame(rows)


#: Typical keys: category -> (rows it is chosen from, the score, larger first?).
TYPICAL_BY = {
    "dead": (lambda k: k["dead"], "key", False),
    "detector": (lambda k: k["class"] == "detector", "rule_f1", True),
    "positional": (lambda k: k["class"] == "positional", "position_eta2", True),
    "prediction": (lambda k: k["value_type"] == "prediction", "kurtosis", True),
    "suppression": (lambda k: k["value_type"] == "suppression", "kurtosis", True),
    "eraser": (lambda k: k["eraser"], "trigger_z", False),
}


def typical(keys: pd.DataFrame, n: int = TYPICAL) -> pd.DataFrame:
    """Per layer and category, the n keys most typical of it (the highest score of the category; dead keys by
    key order): the report's table and the explorer's examples."""
    rows = []
    for layer, g in keys.groupby("layer", sort=True):
        for category, (chosen, score, descending) in TYPICAL_BY.items():
            pick = g[chosen(g).to_numpy(bool)].sort_values([score, "key"], ascending=[not descending, True],
                                                           kind="stable").head(n)
            for rank, r in enumerate(pick.to_dict("records")):
                rows.append({"layer": int(layer), "category": category, "rank": rank, "key": int(r["key"]),
                             "score_name": score, "score": float(r[score]), "class": r["class"],
                             **{c: r[c] for c in ("rule", "rule_f1", "position_eta2", "activation_frequency",
                                                  "value_type", "written_top", "written_bottom")}})
    columns = ["layer", "category", "rank", "key", "score_name", "score", "class", "rule", "rule_f1",
               "position_eta2", "activation_frequency", "value_type", "written_top", "written_bottom"]
    return pd.DataFrame(rows, columns=columns)


def draw(result: Result) -> Figures:
    """The classes per layer (census), the value types (census_values) and, with a control, each class beside the
    random key directions (census_control)."""
    table, L = result.tables[f"{NAME}_layers"], result.n_layers
    n_positions, projection = result.meta[NAME]["n_positions"], result.meta[NAME]["projection"]
    x = table["layer"].to_numpy()
    n_keys = int(table["n_keys"].iloc[0]) if len(table) else 0
    fig, ax = new_figure()
    bottom = np.zeros(len(table))
    colors = {"dead": "#8C8C8C", "detector": COLORS["shallow"], "positional": "#DD8452", "other": "#DDDDDD"}
    for name in CLASSES:
        share = 100 * table[f"share_{name}"].to_numpy()
        ax.bar(x, share, bottom=bottom, color=colors[name], label=name)
        bottom += share
    ax.set_ylim(0, 100)
    ax.set_ylabel("% keys of the layer")
    ax.set_title(f"Census of memories by class (n = {n_keys:,} keys per layer, {n_positions:,} held-out positions)")
    layer_axis(ax, L)
    legend_outside(ax, ncol=4)
    figures = {NAME: fig}

    fig, ax = new_figure()
    for shift, name, color in ((-0.27, "prediction", "#55A868"), (0.0, "suppression", "#C44E52"),
                               (0.27, "eraser", "#8172B3")):
        ax.bar(x + shift, 100 * table[f"share_{name}"], width=0.27, color=color, label=name)
        interval_bars(ax, x + shift, table, f"share_{name}")
    ax.set_ylabel("% keys of the layer")
    ax.set_title(f"Value types, as each key fires ({projection} projection; n = {n_keys:,} keys per layer)")
    layer_axis(ax, L)
    legend_outside(ax)
    figures[f"{NAME}_values"] = fig
    if "share_detector_control" in table:  # each class beside the random key directions of the same layer
        fig, ax = new_figure()
        for name in ("dead", "detector", "positional"):
            ax.plot(x, 100 * table[f"share_{name}"], "o-", color=colors[name] if name != "other" else "black",
                    label=f"{name}, keys")
            ax.plot(x, 100 * table[f"share_{name}_control"], "--", marker="_", ms=10,
                    color=colors[name], label=f"{name}, random key directions")
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of the layer's keys / random directions")
        ax.set_title(f"Census classes against random key directions (n = {n_keys:,} keys, "
                     f"{int(table['n_control_keys'].iloc[0]):,} directions per layer)")
        layer_axis(ax, L)
        legend_outside(ax)
        figures[f"{NAME}_control"] = fig
    if f"{NAME}_latents" in result.tables:  # the dictionary's latents beside the layer's neurons
        table = result.tables[f"{NAME}_latents"]
        figures[f"{NAME}_latents"] = kinds_beside(
            table, (("neurons", "detector_neurons", "detector_neurons_control", None),
                    ("latents", "detector_latents", "detector_latents_control", None)),
            "% live memories that are token or\nn-gram detectors",
            "Census: neurons vs. the dictionary's latents, each beside its random directions")
    return figures


def thresholds_text() -> dict[str, str]:
    return {
        "dead": "never active over the indexed corpus (ffkv.experiments.dead: its largest |m_i| at or below tau·s_l)",
        "strong": f"at a position that competes for trigger examples (no special token), active, and |m_i| >= "
                  f"{STRONG_SHARE:g} x the key's largest |m_i| over such positions",
        "detector": f"the best token/n-gram rule (n in {list(NGRAMS)}) for where the key fires strongly has "
                    f"F1 >= {DETECTOR_F1} on at least {DETECTOR_MIN_HITS} strong positions where the rule holds",
        "positional": f"adjusted eta² (epsilon²) of m_i over position >= {POSITIONAL_ETA2} (positions >= "
                      f"{POSITION_GROUPS - 1} pooled)",
        "prediction": f"excess kurtosis of the written vector's logits >= {KURTOSIS_MIN} and skew >= {SKEW_MIN}",
        "suppression": f"excess kurtosis >= {KURTOSIS_MIN} and skew <= -{SKEW_MIN}",
        "eraser": f"a detector whose written vector on its rule's strong positions puts the rule's last token at a "
                  f"standardized logit <= {ERASER_Z}",
        "two_way": f"each sign at least {TWO_WAY_SHARE:.0%} of the key's active positions",
        "class": "dead, else detector, else positional, else other",
    }


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/census (per key), census_layers, census_typical and, with a control, census_control."""
    found = census_tables(ctx)
    tau = active_fraction(ctx.view)
    n_keys = ctx.view.d_m
    meta = {"projection": ctx.projections.values, "projection_choice": ctx.projections.name,
            "positions": f"every real position of the held-out examples: {found['positions']:,} positions of "
                         f"{found['n_examples']:,} examples; positions with a massive activation in a layer (RMS of "
                         f"their coefficients above {MASSIVE_FACTOR:g} x the median analysed position's) are left out "
                         "of that layer (its n_positions)",
            "n_examples": found["n_examples"], "n_positions": found["positions"],
            "active": "m_i > 0 (tau = 0: no coefficient of this model can be negative)" if tau == 0 else
            f"{RULE} (s_l of the held-out analysed positions, as Figures 7-8); tau = {tau:g}",
            "control": (f"{ctx.manifest.control_keys} random key directions per layer (ffkv.memories.controls), "
                        "classed by the same rules from the same passes; *_minus_control: Newcombe's 95% interval"
                        if ctx.has_control else "none: the run holds no random-key control (index again)"),
            "active_threshold": [float(t) for t in found["thresholds"]],
            "thresholds": thresholds_text(),
            "sign": "a key's value type is read from the vector it writes: -v_i when it fires mostly with m_i < 0; "
                    "two_way keys write the mirror type with their other sign",
            "value_type_null_rate": null_rates(ctx.view, ctx.projections.values, seed=ctx.seed),
            "detector_bound": f"Misra-Gries summary of {CANDIDATES} candidate rules per key and n: every rule with "
                              f"F1 >= {2 / (CANDIDATES + 1):.3f} is counted exactly",
            "interval": "95% Wilson score interval", "eval_corpus": ctx.held_out().spec.to_dict(),
            "warnings": sample_size_warnings(NAME, n_keys, "keys")}
    result = Result(ctx.view.n_layers, record={k: v for k, v in meta.items() if k != "warnings"})
    if found["unread"]:  # the dictionary's files are gone or changed: the neurons' tables stand, and say so
        meta = {**meta, "warnings": [*meta["warnings"], *found["unread"]]}
    result.add(NAME, found["keys"], **meta)
    result.add(f"{NAME}_layers", found["per_layer"], **meta)
    result.add(f"{NAME}_typical", found["typical"], **meta)
    if "control" in found:
        result.add(f"{NAME}_control", found["control"], **meta)
    if "latents" in found:
        latents = found["latents"]
        meta_lat = {**meta, "memories": "the latents of the dictionary the run was indexed with (key: encoder row, "
                    "value: decoder row; `ffkv.memories.sets.Latents`), only the layers it covers, read in the "
                    "census's own passes from the quantity their keys read (a transcoder's FF input, an SAE's FF "
                    "output), on the positions the layer's neurons are counted on",
                    "active": f"latents: a_j > 0 (docs/definitions.md); neurons: {meta['active']}",
                    "dead": "latents: never fired over the indexed corpus (no row in latent_trigger_examples.parquet); "
                            "neurons: never active over it (ffkv.experiments.dead)",
                    "control": ("the control latents of each layer (ffkv.memories.latent_keys: a real latent's encoder "
                                "norm, bias and threshold with a random direction, judged against the real latents), "
                                "classed by the same rules from the same passes" if ctx.has_latent_control else
                                "none: the run holds no control latents"),
                    "beside_neurons": "MEASURE_latents, MEASURE_neurons: share of the kind's memories judged (dead: "
                                      "every memory; detector, positional: the live ones) with 95% Wilson intervals; "
                                      "*_minus_control: Newcombe's 95% interval; excess_MEASURE_latents_minus_neurons: "
                                      "the latents' excess over their control minus the neurons' over theirs (MOVER "
                                      f"95% interval); verdict_MEASURE read only where every kind and control has at "
                                      f"least {MIN_N} memories judged",
                    "warnings": sample_size_warnings(f"{NAME}_latents", int(latents["per_layer"]["n_latents"].min())
                                                     if len(latents["per_layer"]) else 0, "latents")}
        result.add(f"{NAME}_latents", latents["per_layer"], **meta_lat)
        result.add(f"{NAME}_latents_keys", latents["keys"], **meta_lat)
        result.add(f"{NAME}_latents_control", latents["control"], **meta_lat)
    return result


# ------------------------------------------------ census: the paper's findings, its reading and fidelity rules
#: Table or figure name -> the paper's finding shown beside it (exact names: `ffkv.experiments.registry`).
FINDINGS: dict[str, Finding] = {
    "census": Finding("Beyond the paper (Voita et al. 2023)", (
        "In OPT models over 70% of the neurons of some early layers never activate; many "
        "live early-layer neurons detect a token or n-gram and their values remove that token from the "
        "residual stream; some fire by position alone.")),
    "census_values": Finding("Beyond the paper (Gurnee et al. 2024)", (
        "In GPT-2, prediction neurons (the value pushes a few tokens up) rise in later "
        "layers and suppression neurons (a few tokens pushed down) take over in the last layers.")),
    "census_control": Finding("Beyond the paper (Voita et al. 2023)", (
        "Each census class beside the same rules applied to random key directions of the "
        "layer: a class is a finding about trained keys only where it is more common among them.")),
}
# The other tables and figures of the study stand beside the finding they belong to.
FINDINGS.update({"census_layers": FINDINGS["census"], "census_typical": FINDINGS["census"]})
FINDINGS["census_latents"] = Finding("Beyond the paper, beside the census", (
    "The same classes for the latents of a sparse dictionary of the layer, each kind against its own random "
    "directions: are the latents token or n-gram detectors (or dead, or positional) beyond their control more "
    "often than the neurons are beyond theirs?"))
FINDINGS.update({"census_latents_keys": FINDINGS["census_latents"],
                 "census_latents_control": FINDINGS["census_latents"]})


def reading(name: str, table: pd.DataFrame) -> str | None:
    """The census on this model: the shares of dead keys and of token or n-gram detectors in the first and
    last layers (n, 95% intervals); None for its other tables. Layers count from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "census" and {"class", "key"} <= set(t.columns):
        def share(kind: str, g: pd.DataFrame) -> str:
            return share_ci(float((g["class"] == kind).mean()), len(g))
        lo, hi = t[t["layer"] == first.layer], t[t["layer"] == last.layer]
        return (f"In this model {share('dead', lo)} of the keys of {n_first} are dead and {share('detector', lo)} "
                f"are token or n-gram detectors; in {n_last}: dead {share('dead', hi)}, detectors "
                f"{share('detector', hi)} (n: keys per layer; positions: every token of the held-out sample).")
    if name == f"{NAME}_latents" and "excess_detector_latents_minus_neurons" in t:
        return " ".join(_latents_text(row) for row in t.to_dict("records"))
    return None


def _latents_text(row: dict) -> str:
    """One layer of census_latents in words: per measure, each kind's share beside its own control, and which kind
    stands higher against its control (`excess_verdict`) where n carries a verdict."""
    def kind(measure: str, name: str) -> str:
        share = share_ci(row[f"{measure}_{name}"], row[f"n_{measure}_{name}"])
        control = row[f"{measure}_{name}_control"]
        return f"{name} {share}" + (f" (their random directions {pct(control)})" if np.isfinite(control) else "")

    parts = []
    for measure in LATENT_MEASURES:
        excess_name = f"excess_{measure}_latents_minus_neurons"
        low, high = row[f"{excess_name}_ci_low"], row[f"{excess_name}_ci_high"]
        excess = (f"; excess over control, latents minus neurons "
                  f"{100 * row[excess_name]:+.1f} points [{100 * low:+.1f}, "
                  f"{100 * high:+.1f}]" if np.isfinite(low) else "")
        parts.append(f"{measure}: {kind(measure, 'latents')}; {kind(measure, 'neurons')}{excess}: "
                     f"{row[f'verdict_{measure}']}")
    return f"Layer {int(row['layer']) + 1}, " + "; ".join(parts) + "."


EXPERIMENT = Experiment(
    name=NAME, title="Census of memories: dead, token detectors, positional, value types (beyond the paper)",
    section="beyond the paper: Voita et al. 2023, Gurnee et al. 2024", order=6, compute=compute, draw=draw,
    own_pass=("every position of every held-out example, three times (scale, candidate rules, exact counts): the shared"
              " held-out pass keeps one analysed position per example"),
    held_out=True,
    encoder=Encoder(True, "census (beyond the paper)", "over every token of the held-out examples, unmasked: "
                    "activation, detector and positional statistics describe the keys; value types through the "
                    "values projection"),
    latents=("census_latents, census_latents_keys, census_latents_control: the census classes of the latents (dead,"
             " token or n-gram detector, positional, value type) from the census's own passes, each kind's share "
             "minus its own random directions (control latents, random key directions), and the difference"),
    findings=FINDINGS, reading=reading, reading_rows={f"{NAME}_typical": 30}, module=__name__)
