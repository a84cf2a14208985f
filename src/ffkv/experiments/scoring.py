"""One forward pass per example that scores it: loss, the mass of a token set, per-layer coefficient statistics.

Shared by `membership` (coefficient statistics and the loss baseline) and `interventions` (perplexity and
token-set mass with and without memories rewritten). Each example is a whole token sequence; a causal LM
predicts token t+1 from x_1..x_{t+1} at every position t that has a next token (special tokens such as
</s> included, as in training). Per example:

- ``nll``: the mean token negative log-likelihood over those predictions (natural log); ``n_predicted``
  how many there were (perplexity over a set of examples is exp(Σ nll·n / Σ n)).
- ``mass``: the mean, over the same positions, of p(S), the probability the model's final distribution
  gives to the token set S (when S is given).
- ``top_coefficients``: per layer, the mean over the example's non-special positions of the mean of the
  `top_k` largest |m_i| at the position (|m_i|: the signed rule of `ffkv.memories.active` reads
  magnitudes, so a gated or GELU model's negative coefficients count as much as positive ones).
- ``latent_top_coefficients``: with a dictionary's latents (`ffkv.memories.sets.Latents`), the same statistic of
  the latents' activations a_j (never negative) at each layer the dictionary covers, read in the same pass.

The final distribution is the model's own LM head applied to its captured input (bias included).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch

from ffkv.errors import FfkvError
from ffkv.experiments.common import as_numpy, progress_bar
from ffkv.memories.interventions import (Intervention, intervene, latents_off_by_row, refuse_non_finite,
                                         rewrite_coefficients)
from ffkv.memories.projection import final_logits
from ffkv.models.loading import LoadedModel
from ffkv.parallel import gather_rows

#: Coefficients averaged per position for the ``top_coefficients`` statistic.
TOP_K = 16
#: Positions x vocabulary logits made at once (2**25 floats: 128 MB in float32), whatever |V| and the batch.
HEAD_ELEMENTS = 2**25


@dataclass(frozen=True)
class RowMasks:
    """Which memories each row's pass keeps, so that passes of several masked models share batches: ``keep[l]``
    (groups, d_m) is True where group g keeps memory i of layer l, and ``group[r]`` is row r's group. Row r's
    coefficients m of layer l are multiplied by ``keep[l][group[r]]`` on their way into the second FF matrix: m·0 = 0
    and m·1 = m, so a row computes what a pass with its group's memories switched off computes, but for the
    rounding of the batch it shares with other rows. ``latents_off[l]`` (groups, n_latents), True where group g
    switches latent j of layer l's attached dictionary off (`ffkv.memories.interventions.latents_off_by_row`)."""

    keep: dict[int, torch.Tensor]
    group: np.ndarray
    latents_off: dict[int, torch.Tensor] = field(default_factory=dict)


def _masked(m: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """m (batch, pos, d_m), or as a family flattens it (batch·pos, d_m), times each row's mask (batch, 1, d_m)."""
    return (m.reshape(keep.shape[0], -1, m.shape[-1]) * keep).reshape(m.shape)


@dataclass
class Scores:
    """Per example (rows, in input order): see the module's docstring.

    nll: (N,) mean token NLL; n_predicted: (N,) predictions it averages; mass: (N,) mean p(S), NaN without S;
    top_coefficients: (N, L) per-layer statistic, None when not asked for; latent_top_coefficients: dictionary
    layer -> (N,) the same of its latents, empty without latents.
    """

    nll: np.ndarray
    n_predicted: np.ndarray
    mass: np.ndarray
    top_coefficients: np.ndarray | None
    latent_top_coefficients: dict[int, np.ndarray] = field(default_factory=dict)


def perplexity(scores: Scores) -> float:
    """exp of the token-weighted mean NLL over every prediction of the examples."""
    n = scores.n_predicted.astype(np.float64)
    return float(np.exp((scores.nll * n).sum() / n.sum()))


@torch.no_grad()
def score_examples(loaded: LoadedModel, token_lists: Sequence[np.ndarray], *, token_set: Iterable[int] = (),
                   coefficients: bool = False, top_k: int = TOP_K,
                   interventions: Sequence[Intervention] = (), masks: RowMasks | None = None,
                   progress: bool = False, desc: str = "scoring", latents=None) -> Scores:
    """Score each example in one forward pass (batched by length; under torchrun each rank its share).

    Args:
        token_lists: the examples' token ids (each with at least two tokens to have a prediction).
        token_set: the token ids of S for ``mass`` (empty: ``mass`` is NaN).
        coefficients: also compute the per-layer ``top_coefficients`` statistic.
        interventions: memories rewritten at every position during the pass (`ffkv.memories.intervene`); an
            output they make NaN or infinite at any position is refused (`refuse_non_finite`), not scored.
        masks: memories switched off per row (`RowMasks`), after the `interventions`.
        latents: with ``coefficients``, a dictionary's latents (`ffkv.memories.sets.Latents`) whose
            ``latent_top_coefficients`` are read from the same pass (the quantity each layer's latents read).
    """
    from ffkv.batching import row_batches

    view = loaded.view
    interventions = list(interventions)  # applied, then named if they overflow the model
    if view.encoder:
        raise FfkvError("scoring by next-token loss needs a causal LM; this model is an encoder (masked LM)")
    N, L = len(token_lists), view.n_layers
    short = [i for i, t in enumerate(token_lists) if len(t) < 2]
    if short:
        raise FfkvError(f"example {short[0]} has fewer than 2 tokens: nothing to predict")
    S = torch.as_tensor(sorted({int(t) for t in token_set}), dtype=torch.long, device=view.device)
    if len(S) and (int(S.min()) < 0 or int(S.max()) >= view.vocab_size):
        raise FfkvError(f"token ids must lie in 0..{view.vocab_size - 1}")
    k = min(top_k, view.d_m)
    nll = np.zeros(N, np.float64)
    count = np.zeros(N, np.int64)
    mass = np.full(N, np.nan, np.float64)
    broken = np.zeros(N, np.int64)  # per example, predictions whose loss is NaN or infinite
    stat = np.zeros((N, L), np.float64) if coefficients else None
    latent_layers = latents.layers if coefficients and latents is not None else []
    latent_stat = {layer: np.zeros(N, np.float64) for layer in latent_layers}
    latent_reads = tuple(dict.fromkeys(latents.reads(layer) for layer in latent_layers))
    state: dict = {}

    def top_mean(t: torch.Tensor, n: int) -> torch.Tensor:
        """Per example (B,): the mean over its competing positions of the mean of the n largest |t|."""
        top = t.float().abs().topk(n, dim=-1).values.mean(-1)  # (B, T)
        w = state["competes"]
        return (top * w).sum(-1) / w.sum(-1).clamp(min=1)

    def sink(name: str, layer: int, t: torch.Tensor) -> None:
        if name in latent_reads and layer in latent_stat and latents.reads(layer) == name:
            state[("latents", layer)] = top_mean(latents.coefficients(layer, t), min(top_k, latents.size(layer)))
        if name == "coefficients":
            state[(name, layer)] = top_mean(t, k)
        elif name == "head_in" or layer == L - 1:  # resid_post: only the last layer's, for models without a head module
            state[(name, layer)] = t

    special = loaded.special_ids
    mine = row_batches([(i, np.asarray(t, dtype=np.int64)) for i, t in enumerate(token_lists)],
                       loaded.tokenizer.pad_id, special, view.device)
    # The final residual is read from the last layer alone (head_in where the model has a head module): the sums
    # resid_mid + ff_out of the other layers would be made and dropped on every pass.
    bar = progress_bar(progress, len(mine.rows), desc, "ex")
    kept = {layer: keep.to(view.device) for layer, keep in (masks.keep if masks is not None else {}).items()}
    off = {layer: o.to(view.device) for layer, o in (masks.latents_off if masks is not None else {}).items()}
    row_group = torch.as_tensor(masks.group, dtype=torch.long) if masks is not None else None
    try:
        with intervene(view, interventions, in_place=True), \
                rewrite_coefficients(view, {layer: (lambda m, layer=layer: _masked(m, state["keep"][layer]))
                                            for layer in kept}), \
                latents_off_by_row(view, {layer: (lambda layer=layer: state["off"][layer]) for layer in off}) \
                if off else nullcontext(), \
                view.capture(("coefficients",) if coefficients else (), sink=sink), \
                view.capture(latent_reads, layers=latent_layers, sink=sink), \
                view.capture(("head_in", "resid_post"), layers=[L - 1], sink=sink):
            for idx, batch in mine:
                state.clear()
                state["competes"] = batch.competes.float()
                if row_group is not None:
                    groups = row_group[torch.as_tensor(idx, dtype=torch.long)].to(view.device)
                    state["keep"] = {layer: keep[groups][:, None, :] for layer, keep in kept.items()}
                    state["off"] = {layer: o[groups][:, None, :] for layer, o in off.items()}
                view.forward(batch.input_ids, batch.attention_mask, with_head=True)
                head_in = state.get(("head_in", -1))
                real = batch.attention_mask.bool()
                valid = real[:, 1:] & real[:, :-1]  # position t has a next token t+1
                where = torch.nonzero(valid)[:, 0]
                hidden = (head_in if head_in is not None else state[("resid_post", L - 1)])[:, :-1][valid]
                target = batch.input_ids[:, 1:][valid]
                row_nll = torch.zeros(len(idx), dtype=torch.float64, device=view.device)
                row_mass = torch.zeros(len(idx), dtype=torch.float64, device=view.device)
                row_broken = torch.zeros(len(idx), dtype=torch.long, device=view.device)
                chunk = max(1, HEAD_ELEMENTS // view.vocab_size)
                for s in range(0, len(target), chunk):  # (positions x |V|) logits a chunk at a time: bounded memory
                    h = hidden[s:s + chunk]
                    logp = torch.log_softmax(final_logits(view, h if head_in is not None else None, h).float(), dim=-1)
                    token_nll = -logp.gather(1, target[s:s + chunk, None])[:, 0].double()
                    row_nll.index_add_(0, where[s:s + chunk], token_nll)
                    # A NaN or +inf logit makes the whole row of log-probabilities NaN: the target's shows it.
                    row_broken.index_add_(0, where[s:s + chunk], (~torch.isfinite(token_nll)).long())
                    if len(S):
                        row_mass.index_add_(0, where[s:s + chunk], logp[:, S].exp().sum(-1).double())
                n = valid.sum(1)
                nll[idx] = as_numpy(row_nll / n)
                count[idx] = as_numpy(n)
                broken[idx] = as_numpy(row_broken)
                if len(S):
                    mass[idx] = as_numpy(row_mass / n)
                if stat is not None:
                    for layer in range(L):
                        stat[idx, layer] = as_numpy(state[("coefficients", layer)])
                for layer, values in latent_stat.items():
                    values[idx] = as_numpy(state[("latents", layer)])
                bar.update(len(idx))
    finally:
        bar.close()
    arrays = {"nll": nll, "count": count, "mass": mass, "broken": broken,
              **({"stat": stat} if stat is not None else {}),
              **{f"latents/{layer}": values for layer, values in latent_stat.items()}}
    arrays = gather_rows(arrays, mine.rows)
    refuse_non_finite(int(arrays["broken"].sum()), int(arrays["count"].sum()), interventions)  # every rank alike
    return Scores(arrays["nll"], arrays["count"], arrays["mass"], arrays.get("stat"),
                  {layer: arrays[f"latents/{layer}"] for layer in latent_stat})
