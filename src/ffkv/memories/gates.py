"""Gates on memory coefficients for gradients: m' = g_l ⊙ m at every position of layer l.

With g_l = 1 the model is unchanged and ∂T/∂g_l,i = Σ_positions m_i·∂T/∂m_i (gradient × coefficient, summed
over the batch and positions); with g_l = α·1 the same gradient is taken along the path of integrated
gradients. A pre-forward hook on the second FF matrix, as `ffkv.memories.interventions` (which rewrites m with
constants, outside autograd); leaving the block removes it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from jaxtyping import Float

from ffkv.errors import FfkvError
from ffkv.memories.view import MemoryView


@contextmanager
def gate_coefficients(view: MemoryView, gates: Mapping[int, Float[torch.Tensor, "d_m"]]) -> Iterator[None]:
    """Within the block, layer l's coefficients are multiplied by gates[l] (d_m,) at every position."""
    handles = []
    for layer, gate in gates.items():
        if not 0 <= layer < view.n_layers:
            raise FfkvError(f"layer {layer} does not exist: this model has layers 0..{view.n_layers - 1}")
        if tuple(gate.shape) != (view.d_m,):
            raise FfkvError(f"a gate of layer {layer} has shape {tuple(gate.shape)}, expected ({view.d_m},)")

        def pre(module, args, gate=gate):
            return (args[0] * gate.to(args[0].dtype), *args[1:])

        handles.append(view.arch.down_proj(view.blocks[layer]).register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
