"""The model's passes for a dictionary's fidelity (docs/definitions.md): what `ffkv.dictionaries.fidelity` measures.

Over padded batches (right padding), at the real, non-special tokens (`Batch.competes`): the model's own
next-token loss; the FF input and output of each dictionary layer, which the dictionary reads and reconstructs;
then, one layer at a time, the loss with that layer's FF output replaced at those tokens by the dictionary's
reconstruction (spliced) and by a mean FF output (mean-ablated), through `replace_ff_output`. `ffkv
train-dictionary` and the latents_beside study both measure through `measure_fidelity`; each chooses its batches
and its mean (the training tokens', or by default the measured tokens' own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ffkv.batching import Batch
from ffkv.dictionaries.dictionary import Dictionary
from ffkv.dictionaries.fidelity import Fidelity, LayerFidelity
from ffkv.memories.interventions import replace_ff_output
from ffkv.memories.sets import READS
from ffkv.memories.view import MemoryView


def next_token_loss(model: torch.nn.Module, batch: Batch) -> float:
    """The summed next-token negative log-likelihood of a padded batch (right padding), in float32 (or the
    model's own float64)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    logits = (logits.logits if hasattr(logits, "logits") else logits[0])[:, :-1].float()
    real = batch.attention_mask.bool()
    chosen = real[:, 1:] & real[:, :-1]
    gold = batch.input_ids[:, 1:][chosen]
    return float(-torch.log_softmax(logits[chosen], -1).gather(1, gold[:, None]).sum())


def _at_kept(keep: torch.Tensor, reads: str, new: Callable[[torch.Tensor], torch.Tensor]):
    """A replacement of the FF output (`replace_ff_output`) by new(what the dictionary reads) at the kept positions
    only, whatever shape the model holds it in."""
    def replace(x: torch.Tensor, ff_out: torch.Tensor) -> torch.Tensor:
        shaped = ff_out.reshape(*keep.shape, -1)
        read = x.reshape(*keep.shape, -1) if reads == "ff_in" else shaped
        swapped = torch.where(keep[..., None], new(read).to(shaped.dtype), shaped)
        return swapped.reshape(ff_out.shape)
    return replace


@torch.no_grad()
def measure_fidelity(view: MemoryView, batches: Sequence[Batch], dictionaries: Mapping[int, Dictionary],
                     means: Mapping[int, torch.Tensor] | None = None, progress: Callable[[int], None] | None = None
                     ) -> Fidelity:
    """Each dictionary's fidelity over `batches` (on the model's device).

    Args:
        dictionaries: 0-based layer -> its dictionary (a transcoder or an SAE), on the model's device.
        means: 0-based layer -> the mean FF output (d_model,) that mean ablation writes; None: the FF output's mean
            over the kept tokens of `batches`.
        progress: called with each batch's real tokens once its passes are done.
    """
    layers = sorted(dictionaries)
    fidelity = Fidelity({layer: LayerFidelity(dictionaries[layer]) for layer in layers})
    for batch in batches:
        keep = batch.competes
        fidelity.loss_model += next_token_loss(view.model, batch)
        with view.capture(("ff_in", "ff_out"), layers=layers, stop_early=True) as cap:
            view.forward(batch.input_ids, batch.attention_mask)
        for layer in layers:
            x = cap["ff_in"][layer].reshape(*keep.shape, -1)[keep]
            out = cap["ff_out"][layer].reshape(*keep.shape, -1)[keep]
            fidelity.layers[layer].add(x if READS[dictionaries[layer].kind] == "ff_in" else out, out)
        real = batch.attention_mask.bool()
        fidelity.predicted += int((real[:, 1:] & real[:, :-1]).sum())
        fidelity.tokens += batch.n_tokens
    # the splices after every batch's capture: mean ablation may write the mean over all of them
    ablate = {layer: fidelity.layers[layer].mean if means is None else means[layer] for layer in layers}
    for batch in batches:
        for layer in layers:
            f, reads = fidelity.layers[layer], READS[dictionaries[layer].kind]
            as_mean = lambda r, m=ablate[layer]: m.to(r.device).expand(*r.shape[:-1], -1)  # noqa: E731
            with replace_ff_output(view, {layer: _at_kept(batch.competes, reads, dictionaries[layer])}):
                f.spliced += next_token_loss(view.model, batch)
            with replace_ff_output(view, {layer: _at_kept(batch.competes, reads, as_mean)}):
                f.ablated += next_token_loss(view.model, batch)
        if progress is not None:
            progress(batch.n_tokens)
    return fidelity
