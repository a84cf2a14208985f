"""A dictionary's fidelity to its FF layer (docs/definitions.md): how well its reconstruction stands in for the layer.

Per dictionary layer, over the same tokens:

- ``fvu``: the fraction of the FF output's variance the reconstruction leaves unexplained, Σ‖y − ŷ‖² / Σ‖y − ȳ‖²
  (0 is perfect), from float64 sums: exactly as over the tokens' concatenation, however they are batched;
- ``dead_latents``: the latents that never fire (activation > 0) over those tokens;
- ``loss_recovered`` = (L_ablated − L_spliced) / (L_ablated − L_model): L_model the model's next-token loss,
  L_spliced that loss with the layer's FF output replaced by the reconstruction, L_ablated with it replaced by a
  mean FF output. 1 when the splice costs nothing, 0 when it is no better than the mean.

The one place these are computed, for `ffkv train-dictionary` and the latents_beside study: `LayerFidelity` tallies
one dictionary, `Fidelity` holds the model's own loss beside them and gives the rows. The passes that feed them
run the model (`ffkv.memories.dictionary_fidelity`): this package does not import ffkv.memories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float

from ffkv.dictionaries.dictionary import Dictionary


def loss_recovered(original: float, spliced: float, mean_ablated: float) -> float:
    """(L_mean − L_spliced) / (L_mean − L_original): 1 when the splice loses nothing, 0 when it is no better than
    mean ablation (NaN when mean ablation itself costs nothing)."""
    gap = mean_ablated - original
    return (mean_ablated - spliced) / gap if gap != 0 else float("nan")


class LayerFidelity:
    """One dictionary's tallies: its reconstruction error and firing over the tokens `add`ed, the FF output's mean
    over them, and the summed next-token losses with its layer spliced (`spliced`) and mean-ablated (`ablated`)."""

    def __init__(self, dictionary: Dictionary) -> None:
        self.dictionary = dictionary
        self.n = 0
        self.sum = torch.zeros(dictionary.d_model, dtype=torch.float64)
        self.sum_squares = torch.zeros((), dtype=torch.float64)
        self.error = torch.zeros((), dtype=torch.float64)
        self.fired = torch.zeros(dictionary.n_latents, dtype=torch.bool)
        self.spliced = 0.0
        self.ablated = 0.0

    def add(self, read: Float[torch.Tensor, "n d_model"], ff_out: Float[torch.Tensor, "n d_model"]) -> None:
        """Some tokens' rows: what the dictionary reads (the FF input for a transcoder, the FF output for an SAE)
        and the FF output it reconstructs."""
        d = self.dictionary
        y = ff_out.double()
        a = d.encode(read)
        self.n += int(y.shape[0])
        self.sum += y.sum(0).cpu()
        self.sum_squares += y.square().sum().cpu()
        self.error += (y - d.decode(a, read).double()).square().sum().cpu()
        self.fired |= (a > 0).any(0).cpu()

    @property
    def mean(self) -> Float[torch.Tensor, "d_model"]:
        """The FF output's mean over the tokens added (float64, on the CPU)."""
        return self.sum / max(self.n, 1)

    @property
    def fvu(self) -> float:
        n = max(self.n, 1)
        variance = float(self.sum_squares - n * (self.sum / n).square().sum())
        return float(self.error) / variance if variance > 0 else math.nan

    @property
    def dead(self) -> int:
        return int((~self.fired).sum())


@dataclass
class Fidelity:
    """A model's dictionaries measured over the same tokens: each layer's tallies, the model's own summed
    next-token loss, the tokens read and the tokens predicted (those with a next token)."""

    layers: dict[int, LayerFidelity]
    loss_model: float = 0.0
    tokens: int = 0
    predicted: int = 0

    def rows(self) -> list[dict]:
        """One row per layer: layer, n_latents, fvu, dead_latents, dead_share, loss_original, loss_spliced,
        loss_mean_ablated, loss_recovered, eval_tokens (the tokens the FVU is over); losses per predicted token."""
        rows = []
        for layer, f in sorted(self.layers.items()):
            lo, ls, la = (v / max(self.predicted, 1) for v in (self.loss_model, f.spliced, f.ablated))
            n_latents = f.dictionary.n_latents
            rows.append({"layer": layer, "n_latents": n_latents, "fvu": f.fvu, "dead_latents": f.dead,
                         "dead_share": f.dead / n_latents, "loss_original": lo, "loss_spliced": ls,
                         "loss_mean_ablated": la, "loss_recovered": loss_recovered(lo, ls, la), "eval_tokens": f.n})
        return rows
