"""Gates on memory coefficients for gradients: m' = g_l ⊙ m at every position of layer l.

With g_l = 1 the model is unchanged and ∂T/∂g_l,i = Σ_positions m_i·∂T/∂m_i (gradient × coefficient, summed
over the batch and positions); with g_l = α·1 the same gradient is taken along the path of integrated
gradients. A pre-forward hook on the second FF matrix, as `ffkv.memories.interventions` (which rewrites m with
constants, outside autograd); leaving the block removes it.
"""

from __future__ import annotations

from typing import Mapping

import torch
from jaxtyping import Float

from ffkv.errors import FfkvError
from ffkv.memories.interventions import rewrite_coefficients
from ffkv.memories.view import MemoryView


def gate_coefficients(view: MemoryView, gates: Mapping[int, Float[torch.Tensor, "d_m"]]):
    """Within the block (a context manager), layer l's coefficients are multiplied by gates[l] (d_m,) at every
    position (`ffkv.memories.interventions.rewrite_coefficients`)."""
    for layer, gate in gates.items():
        if not 0 <= layer < view.n_layers:
            raise FfkvError(f"layer {layer} does not exist: this model has layers 0..{view.n_layers - 1}")
        if tuple(gate.shape) != (view.d_m,):
            raise FfkvError(f"a gate of layer {layer} has shape {tuple(gate.shape)}, expected ({view.d_m},)")
    return rewrite_coefficients(view, {layer: (lambda m, gate=gate: m * gate.to(m.dtype))
                                       for layer, gate in gates.items()})
