"""Which memories are active at a position: the one rule of ffkv (SPEC section 7, paper Figures 7 and 8).

A memory i writes m_i·v_i into the residual. For ReLU feed-forwards (the paper's) m_i >= 0 and
most coefficients are exactly 0, so the paper counts a memory as active when m_i > 0. For
activations that go negative (GELU, SiLU, every gated FF) no coefficient is exactly 0 and a
negative m_i writes -v_i as strongly as a positive one writes v_i. ffkv uses one rule for both:

    active  <=>  |m_i| > tau · s_l

where s_l is the root mean square of the layer's coefficients (over every memory at the
analysed positions) and tau is `ACTIVE_FRACTION` (0.1) when coefficients can be negative,
0 when they cannot. With tau = 0 the rule is |m_i| > 0, i.e. m_i > 0 for ReLU: the paper's.

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

import torch
from jaxtyping import Bool, Float

from ffkv.memories.view import MemoryView

#: tau of the rule for activations that can be negative (measured: see the module's docstring).
ACTIVE_FRACTION = 0.1
#: The rule, in words, for tables and reports.
RULE = "|m_i| > tau·s_l, s_l the RMS of the layer's coefficients at the analysed positions"


def active_fraction(view: MemoryView) -> float:
    """tau of the rule for this model: 0 (m_i > 0) when no coefficient can be negative, else `ACTIVE_FRACTION`
    (`MemoryView.signed`, the rule that also sets `ffkv index --sign`'s default)."""
    return ACTIVE_FRACTION if view.signed else 0.0


def active(m: Float[torch.Tensor, "*batch d_m"], threshold: float) -> Bool[torch.Tensor, "*batch d_m"]:
    """The active memories: |m_i| > threshold (threshold = tau·s_l of the layer)."""
    return m.abs() > threshold


__all__ = ["ACTIVE_FRACTION", "RULE", "active", "active_fraction"]
