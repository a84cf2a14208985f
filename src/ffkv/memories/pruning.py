"""Removing memories from a model: masked (m_i = 0 at every position) or cut out of the weights (docs/definitions.md).

A memory i of layer l is removed when its coefficient m_i no longer reaches the second FF matrix.
Two ways give the same function:

- **masked**: the model is unchanged and m_i is set to 0 at every position
  (`ffkv.memories.interventions.intervene` with op "off"): what the pruning curves measure;
- **surgery** (`shrink_model`): the key row k_i (and its bias entry b_K,i), for gated layers the up
  row u_i kept aligned with the gate row, and the value v_i (a column of the down projection; a row of
  GPT-2's transposed Conv1D) are deleted, and the config's intermediate size is updated, so the model is
  smaller and `save_pretrained` writes it in its original format. Since FF(x) = Σ_i m_i·v_i + b_V,
  leaving out the removed i gives what m_i = 0 gives, up to the order of a float sum.

Hugging Face configs hold one intermediate size for every layer, so surgery removes the same number of
keys from every layer (`removal_count`); the masked model follows the same rule, so the two agree.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
from jaxtyping import Int
from torch import nn

from ffkv.errors import FfkvError
from ffkv.memories.interventions import Intervention, intervene
from ffkv.memories.view import MemoryView

#: config.model_type -> the config field that holds d_m (one value for every layer). The families of
#: `ffkv.memories.architectures` that surgery supports; fairseq checkpoints are not Hugging Face models.
INTERMEDIATE_SIZE_FIELDS = {
    "gpt2": "n_inner", "gptj": "n_inner", "gpt_neo": "intermediate_size", "gpt_neox": "intermediate_size",
    "opt": "ffn_dim", "llama": "intermediate_size", "mistral": "intermediate_size",
    "qwen2": "intermediate_size", "bert": "intermediate_size", "roberta": "intermediate_size",
    "ffkv_lm": "intermediate_size",
}

#: Removed keys per layer: layer -> 0-based key indices (every layer the same count).
Removed = Mapping[int, Sequence[int] | np.ndarray]


def removal_count(d_m: int, share: float) -> int:
    """How many keys a layer of d_m memories loses at `share` (0 <= share < 1): the nearest integer to
    share·d_m (halves round up), never all of them (at least one key is kept, so every layer's FF stays)."""
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= float(share) < 1:
        raise FfkvError(f"the share of keys to remove must be a number in [0, 1), got {share!r}")
    return min(int(np.floor(float(share) * d_m + 0.5)), d_m - 1)


def _check_removed(view: MemoryView, removed: Removed) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for layer, keys in removed.items():
        if not 0 <= int(layer) < view.n_layers:
            raise FfkvError(f"layer {layer} does not exist: this model has layers 0..{view.n_layers - 1}")
        keys = np.unique(np.asarray(keys, dtype=np.int64))
        if len(keys) and (keys[0] < 0 or keys[-1] >= view.d_m):
            raise FfkvError(f"key indices of layer {layer} must be in 0..{view.d_m - 1}")
        out[int(layer)] = keys
    return out


@contextmanager
def masked(view: MemoryView, removed: Removed) -> Iterator[None]:
    """Within the block, the removed memories' coefficients are 0 at every position (the masked model)."""
    with intervene(view, removal_edits(view, removed)):
        yield


def removal_edits(view: MemoryView, removed: Removed) -> list[Intervention]:
    """The removed memories as interventions that switch them off (m_i = 0 at every position)."""
    return [Intervention(layer, int(k), "off") for layer, keys in _check_removed(view, removed).items() for k in keys]


def kept_keys(view: MemoryView, removed: Removed) -> dict[int, Int[torch.Tensor, "kept"]]:
    """Per layer, the kept key indices in ascending order; refuses removals of unequal size per layer."""
    removed = _check_removed(view, removed)
    counts = {len(removed.get(layer, ())) for layer in range(view.n_layers)}
    if len(counts) != 1:
        raise FfkvError("surgery needs the same number of removed keys in every layer (the model's config holds "
                        f"one intermediate size for all layers); got counts {sorted(counts)}")
    if counts == {view.d_m}:
        raise FfkvError("cannot remove every key of a layer: keep at least one")
    keep = {}
    for layer in range(view.n_layers):
        mask = np.ones(view.d_m, dtype=bool)
        mask[removed.get(layer, np.zeros(0, dtype=np.int64))] = False
        keep[layer] = torch.as_tensor(np.flatnonzero(mask), dtype=torch.long)
    return keep


def intermediate_size_field(model: nn.Module) -> str:
    """The config field of d_m for a model that surgery supports, or a clear refusal."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in INTERMEDIATE_SIZE_FIELDS:
        raise FfkvError(f"pruning cannot write a smaller {model_type or type(model).__name__!r} model; it writes "
                        f"Hugging Face models of types {', '.join(sorted(INTERMEDIATE_SIZE_FIELDS))} "
                        "(the pruning curves of `ffkv analyze` still work: they mask, not cut)")
    return INTERMEDIATE_SIZE_FIELDS[model_type]


def _slice(module: nn.Module, keep: torch.Tensor, dim: int, bias: bool) -> None:
    """Keep the given indices of `module.weight` along `dim` (and of its bias when `bias`), in place."""
    with torch.no_grad():
        index = keep.to(module.weight.device)
        module.weight = nn.Parameter(module.weight.index_select(dim, index).contiguous(), requires_grad=False)
        if bias and getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(module.bias.index_select(0, index).contiguous(), requires_grad=False)
    n = len(keep)
    if isinstance(module, nn.Linear):
        if dim == 0:
            module.out_features = n
        else:
            module.in_features = n
    elif hasattr(module, "nf") and dim == 1:  # GPT-2's Conv1D: weight (in, out), nf = out
        module.nf = n


def shrink_model(view: MemoryView, removed: Removed) -> int:
    """Cut the removed memories out of the model's weights, in place; returns the new d_m.

    Key rows (and b_K), up rows of gated layers, and value columns of the down projection are deleted;
    the value bias b_V is kept (it is not a memory). The config's intermediate size is set to the new d_m.
    The model then computes what the masked model (`masked`) computes. A share of 0 changes nothing.
    """
    model = view.model
    field = intermediate_size_field(model)
    keep = kept_keys(view, removed)
    conv = view.arch.conv1d
    for layer, block in enumerate(view.blocks):
        k = keep[layer]
        # Keys (and gate): rows of a Linear weight (d_m, d); columns of a Conv1D weight (d, d_m).
        _slice(view.arch.key_proj(block), k, 1 if conv else 0, bias=True)
        up = view.arch.up_proj(block)
        if up is not None:
            _slice(up, k, 1 if conv else 0, bias=True)
        # Values: columns of a Linear weight (d, d_m); rows of a Conv1D weight (d_m, d). b_V stays.
        _slice(view.arch.down_proj(block), k, 0 if conv else 1, bias=False)
    d_m = len(keep[0])
    setattr(model.config, field, d_m)
    return d_m


__all__ = ["INTERMEDIATE_SIZE_FIELDS", "Removed", "intermediate_size_field", "kept_keys", "masked",
           "removal_count", "shrink_model"]
