"""Dead keys: memories that are never active over the indexed corpus, one rule for every study (docs/definitions.md).

The index holds, for every key, its largest coefficient over the whole indexed corpus (its rank-0 trigger
example) and, for signed models, its most negative one. A key is **dead** when neither passes the active rule
of `ffkv.memories.active` (|m_i| > tau·s_l, `ffkv.experiments.heldout.active_threshold`; m_i > 0 for ReLU):
no position of the corpus activates it. A dead key's "trigger examples" are only its least inactive prefixes,
so every study treats it as dead: the patterns label it ``dead`` and leave it out of Figure 2's shares, the
census classes it dead, the explorer says it never fired.
"""

from __future__ import annotations

import numpy as np

from ffkv.experiments.common import RunContext
from ffkv.experiments.heldout import active_threshold


def largest_coefficients(ctx: RunContext, control: bool = False) -> np.ndarray:
    """(L, n) the largest |m_i| of each key (or control memory) over the indexed corpus, both directions."""
    n = ctx.manifest.control_keys if control else ctx.view.d_m
    largest = np.zeros((ctx.view.n_layers, n), dtype=np.float64)
    for direction in (1, -1):
        trig = ctx.triggers(direction, control)
        first = trig[trig["rank"] == 0]
        if len(first):
            at = (first["layer"].to_numpy(int), first["key"].to_numpy(int))
            # The positive direction's best may itself be negative (a key never above 0): only its positive part
            # shows activity that way; the negative direction holds the most negative value.
            value = np.maximum(direction * first["coefficient"].to_numpy(np.float64), 0.0)
            largest[at] = np.maximum(largest[at], value)
    return largest


def dead_keys(ctx: RunContext, control: bool = False) -> np.ndarray:
    """(L, n) bool: the keys (or control memories) that no position of the indexed corpus activates."""
    def compute() -> np.ndarray:
        return largest_coefficients(ctx, control) <= active_threshold(ctx)[:, None]
    return ctx.once(("dead_keys", control), compute)


__all__ = ["dead_keys", "largest_coefficients"]
