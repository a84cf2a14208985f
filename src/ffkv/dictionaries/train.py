"""Training a TopK transcoder: the math of one optimizer step, and the measures of a trained one.

A transcoder of FF layer l reads the FF input x (after the pre-FF norm) and predicts the FF output y = FF(x)
through n latents of which only the k largest fire (TopK: Gao et al. 2024; transcoders: Dunefsky et al. 2024):

    a(x) = TopK(relu(x · encoderᵀ + encoder_bias))          (n_latents,)
    ŷ(x) = a(x) · decoder + decoder_bias  (+ x · skipᵀ for a skip transcoder, Paulo et al. 2025)

The recipe is EleutherAI sparsify's (1.3.3, `SparseCoder` with ``transcode=True``, loss ``fvu``), so that a
dictionary trained here is one a sparsify user would recognise:

- encoder rows drawn as `torch.nn.Linear` draws them (uniform in ±1/√d_model); the decoder and the skip
  matrix start at zero (sparsify's transcoder initialisation: the encoder's transpose would be an SAE's, and
  means nothing when the output space is not the input's); decoder rows are not renormalised (sparsify
  renormalises only an SAE's);
- on the first batch, encoder_bias = −mean(x)·encoderᵀ (pre-activations centred) and decoder_bias = mean(y);
- the loss is the batch's fraction of variance unexplained, Σ‖y − ŷ‖² / Σ‖y − ȳ‖², ȳ the batch mean;
- Adam; the step size is a function of the tokens read so far (`learning_rate`), so a run resumed from a
  checkpoint takes exactly the steps an uninterrupted one takes.

AuxK (Gao et al.'s auxiliary loss that revives dead latents) is off, as sparsify's default (auxk_alpha = 0).
Nothing here draws random numbers after the initialisation, which takes its own generator: a checkpoint of
the weights, the optimizer and the data position is the whole state of a run.

The measures of a trained dictionary over held-out tokens (FVU, dead latents, loss recovered) are
`ffkv.dictionaries.fidelity`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from jaxtyping import Float, Int
from torch import nn

from ffkv.dictionaries.dictionary import Dictionary
from ffkv.errors import FfkvError


@dataclass(frozen=True)
class TranscoderShape:
    """What a transcoder is: n_latents = expansion_factor · d_model latents (or exactly `latents` when it is
    set: a width that is no multiple of d_model, as SmolLM2's 24,576 of 576), k of them firing per token, and a
    linear skip path or not."""

    expansion_factor: int = 32
    k: int = 32
    skip: bool = False
    latents: int | None = None

    def n_latents(self, d_model: int) -> int:
        return self.latents if self.latents is not None else self.expansion_factor * d_model

    def validate(self, d_model: int) -> None:
        if self.expansion_factor < 1:
            raise FfkvError(f"the expansion factor must be at least 1, got {self.expansion_factor}")
        if self.latents is not None and self.latents < 1:
            raise FfkvError(f"the latents must be at least 1, got {self.latents}")
        n = self.n_latents(d_model)
        what = (f"{n} latents" if self.latents is not None
                else f"the latents of an {self.expansion_factor}x transcoder of width {d_model}")
        if not 0 < self.k <= n:
            raise FfkvError(f"k must be in 1..{n} ({what}), got {self.k}")


def default_learning_rate(n_latents: int) -> float:
    """sparsify's Adam step size for a dictionary of `n_latents` latents: 2e-4 / √(n_latents / 2¹⁴)."""
    return 2e-4 / math.sqrt(n_latents / 2 ** 14)


def learning_rate(peak: float, tokens_done: int, total_tokens: int, warmup: float = 0.05) -> float:
    """The step size after `tokens_done` of `total_tokens` training tokens: a linear warm-up over the first
    `warmup` share of the tokens, then a linear decay to zero at the last (sparsify's schedule, counted in
    tokens rather than steps: the steps' token counts vary with the examples)."""
    warm = max(1.0, warmup * total_tokens)
    if tokens_done < warm:
        return peak * (tokens_done + 1) / warm
    return peak * max(0.0, (total_tokens - tokens_done) / max(1.0, total_tokens - warm))


class TopKTranscoder(nn.Module):
    """The trainable transcoder of one layer (the parameters sparsify's `SparseCoder` holds, by its names)."""

    def __init__(self, d_model: int, shape: TranscoderShape, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        shape.validate(d_model)
        self.shape = shape
        n = shape.n_latents(d_model)
        bound = 1.0 / math.sqrt(d_model)  # torch.nn.Linear's draw, from a generator of our own
        weight = torch.empty(n, d_model).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
        self.encoder = nn.Parameter(weight.to(device))
        self.encoder_bias = nn.Parameter(torch.zeros(n, device=device))
        self.decoder = nn.Parameter(torch.zeros(n, d_model, device=device))
        self.decoder_bias = nn.Parameter(torch.zeros(d_model, device=device))
        self.skip = nn.Parameter(torch.zeros(d_model, d_model, device=device)) if shape.skip else None

    @property
    def n_latents(self) -> int:
        return int(self.encoder.shape[0])

    @torch.no_grad()
    def initialise_biases(self, x: Float[torch.Tensor, "n d_model"], y: Float[torch.Tensor, "n d_model"]) -> None:
        """sparsify's first-batch initialisation: centred pre-activations, and the output's mean as the bias."""
        self.encoder_bias.copy_(-(x.mean(0) @ self.encoder.T))
        self.decoder_bias.copy_(y.mean(0))

    def encode(self, x: Float[torch.Tensor, "n d_model"]
               ) -> tuple[Float[torch.Tensor, "n k"], Int[torch.Tensor, "n k"]]:
        """The k largest activations relu(x·encoderᵀ + encoder_bias) of each row, and their latents."""
        pre = torch.relu(nn.functional.linear(x, self.encoder, self.encoder_bias))
        return pre.topk(self.shape.k, dim=-1, sorted=False)

    def decode(self, values: Float[torch.Tensor, "n k"], indices: Int[torch.Tensor, "n k"],
               x: Float[torch.Tensor, "n d_model"]) -> Float[torch.Tensor, "n d_model"]:
        """Σ values·decoder[indices] + decoder_bias (+ x·skipᵀ)."""
        if values.is_cuda:
            # Dense on a GPU: the gradient of an indexed gather is summed with atomic adds, in no fixed
            # order, and a resumed run would then differ from an uninterrupted one in the last bits.
            dense = torch.zeros(values.shape[0], self.n_latents, device=values.device, dtype=values.dtype)
            out = dense.scatter(1, indices, values) @ self.decoder
        else:
            # On the CPU a row gather, k/n_latents of the dense work. `index_select`, not `decoder[indices]`:
            # the gradient of an index is summed with parallel atomic adds once it is large (and then differs
            # run to run and with the thread count); index_select's is summed row by row in the indices'
            # order, the same bits on any thread count.
            rows = self.decoder.index_select(0, indices.reshape(-1)).view(*indices.shape, self.decoder.shape[1])
            out = (values.unsqueeze(1) @ rows).squeeze(1)
        out = out + self.decoder_bias
        return out if self.skip is None else out + x @ self.skip.T

    def forward(self, x: Float[torch.Tensor, "n d_model"]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reconstruction ŷ, top-k values, their latents)."""
        values, indices = self.encode(x)
        return self.decode(values, indices, x), values, indices

    def to_dictionary(self, layer: int, source: Mapping[str, Any] | None = None) -> Dictionary:
        """The trained transcoder as ffkv's `Dictionary` (detached copies on the CPU)."""
        take = lambda t: None if t is None else t.detach().to("cpu", torch.float32).clone()  # noqa: E731
        return Dictionary(kind="transcoder", layer=layer, encoder=take(self.encoder),
                          encoder_bias=take(self.encoder_bias), decoder=take(self.decoder),
                          decoder_bias=take(self.decoder_bias), activation="topk", k=self.shape.k,
                          skip=take(self.skip), source=dict(source or {}))


def fraction_of_variance_unexplained(target: Float[torch.Tensor, "n d_model"],
                                     reconstruction: Float[torch.Tensor, "n d_model"]) -> torch.Tensor:
    """Σ‖y − ŷ‖² / Σ‖y − ȳ‖² over the rows, ȳ their mean: 0 for a perfect reconstruction, 1 for the mean.
    Summed in one order on any thread count (`ordered_sum`)."""
    return ordered_sum((target - reconstruction).pow(2)) / ordered_sum((target - target.mean(0)).pow(2))


def ordered_sum(t: Float[torch.Tensor, "n d"]) -> torch.Tensor:
    """The sum of a matrix's entries in an order that does not depend on the thread count: each row's sum (a
    row is summed by one thread), then the rows' sums one after the other, in float64. torch's sum of a whole
    tensor splits it among the threads, and its last bits then change with their number."""
    rows = t.sum(-1).double().cumsum(0)
    return rows[-1].to(t.dtype) if len(rows) else t.new_zeros(())


def train_step(transcoder: TopKTranscoder, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               lr: float) -> tuple[float, torch.Tensor]:
    """One Adam step on the batch's fraction of variance unexplained; returns it (before the step) and the
    latents that fired (activation > 0) in the batch, as a boolean mask over the latents.

    A batch whose outputs do not vary (one token, or copies of one) has no FVU (its denominator is 0, and the
    gradient would be NaN in every weight): it takes no step, and its FVU is returned as NaN."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    reconstruction, values, indices = transcoder(x)
    fired = fired_mask(values.detach(), indices, transcoder.n_latents)
    if not bool(ordered_sum((y - y.mean(0)).pow(2)) > 0):
        return math.nan, fired
    loss = fraction_of_variance_unexplained(y, reconstruction)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach()), fired


def fired_mask(values: torch.Tensor, indices: torch.Tensor, n_latents: int) -> torch.Tensor:
    """(n_latents,) bool: the latents chosen with an activation above zero somewhere in the batch."""
    fired = torch.zeros(n_latents, dtype=torch.bool, device=indices.device)
    fired[indices[values > 0]] = True
    return fired
