"""Which memories are active at a position: the one rule of ffkv (docs/definitions.md, paper Figures 7 and 8).

A memory i writes m_i·v_i into the residual. For ReLU feed-forwards (the paper's) m_i >= 0 and
most coefficients are exactly 0, so the paper counts a memory as active when m_i > 0. For
activations that go negative (GELU, SiLU, every gated FF) no coefficient is exactly 0 and a
negative m_i writes -v_i as strongly as a positive one writes v_i. ffkv uses one rule for both:

    active  <=>  |m_i| > tau · s_l

where s_l is the root mean square of the layer's coefficients (over every memory at the
analysed positions, massive-activation positions left out: `layer_scale`) and tau is
`ACTIVE_FRACTION` (0.1) when coefficients can be negative, 0 when they cannot. With tau = 0
the rule is |m_i| > 0, i.e. m_i > 0 for ReLU: the paper's.

**Massive activations** (Sun et al. 2024, "Massive Activations in Large Language Models"): Llama-,
Mistral-, Qwen- and GPT-2-style models carry, at a few positions (mostly the first token), coefficients
hundreds or thousands of times the rest in a few layers (SmolLM2-135M: up to 3,109 in layer 12 where
other positions stay under 16). One such position among thousands sets a plain RMS: s_l would be
13.4 instead of 0.16 and almost no memory would count as active anywhere else. So s_l leaves out the
positions whose own RMS over the layer's memories is more than `MASSIVE_FACTOR` times the median
position's; those positions are reported (`massive_positions`), never hidden.

Why 0.1, measured (300 sentences each, docs/definitions.md): on stories260K (SiLU-gated) the
memories with |m_i| <= 0.1·s_l together write a median 3-4% of the FF output's norm in every
layer (0.2: 8-11%; 0.05: 1-2% but it keeps near-zero coefficients that a ReLU would zero);
on ffkv-tiny (ReLU) the same cut would leave out 4-6% of the m_i > 0 memories, which write
0.2-0.4% of the output: the rule is about as strict as ReLU's own zeros.

Each active memory keeps its sign: a positive one is counted in ``n_positive`` and predicts
the top of v_i·Eᵀ, a negative one in ``n_negative`` and predicts the bottom of v_i·Eᵀ (the top
of m_i·v_i·Eᵀ).
"""

from __future__ import annotations

import numpy as np
import torch
from jaxtyping import Bool, Float

from ffkv.memories.view import MemoryView

#: tau of the rule for activations that can be negative (measured: see the module's docstring).
ACTIVE_FRACTION = 0.1
#: The rule, in words, for tables and reports.
RULE = ("|m_i| > tau·s_l, s_l the RMS of the layer's coefficients at the analysed positions, massive-activation "
        "positions (RMS > 20 x the median position's) left out")
#: A position whose coefficients' RMS (over the layer's memories) exceeds this multiple of the median position's
#: carries a massive activation and is left out of s_l. Ordinary positions of the models measured stay within
#: a few times the median (docs/definitions.md); massive ones reach hundreds to thousands.
MASSIVE_FACTOR = 20.0


def layer_scale(position_rms: np.ndarray) -> tuple[float, np.ndarray]:
    """s_l of the active rule from the RMS of a layer's coefficients at each analysed position, and which
    positions carry a massive activation (left out of it).

    Args:
        position_rms: (N,) per position, sqrt(mean_i m_i²) over the layer's memories.

    Returns:
        (s_l, massive): the RMS over every memory at the positions that are not massive (0.0 without any),
        and the (N,) bool mask of massive positions (RMS > `MASSIVE_FACTOR` x the median position's).
    """
    rms = np.asarray(position_rms, dtype=np.float64)
    if not len(rms):
        return 0.0, np.zeros(0, dtype=bool)
    massive = rms > MASSIVE_FACTOR * float(np.median(rms))
    kept = rms[~massive]
    return (float(np.sqrt(np.mean(kept ** 2))) if len(kept) else 0.0), massive


def active_fraction(view: MemoryView) -> float:
    """tau of the rule for this model: 0 (m_i > 0) when no coefficient can be negative, else `ACTIVE_FRACTION`
    (`MemoryView.signed`, the rule that also sets `ffkv index --sign`'s default)."""
    return ACTIVE_FRACTION if view.signed else 0.0


def active(m: Float[torch.Tensor, "*batch d_m"], threshold: float) -> Bool[torch.Tensor, "*batch d_m"]:
    """The active memories: |m_i| > threshold (threshold = tau·s_l of the layer)."""
    return m.abs() > threshold


__all__ = ["ACTIVE_FRACTION", "MASSIVE_FACTOR", "RULE", "active", "active_fraction", "layer_scale"]
