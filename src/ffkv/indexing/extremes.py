"""Each example's extreme coefficient per key over its competing positions, in one read of a layer's coefficients.

Mode example of the index (docs/definitions.md) keeps, per example and key, the largest coefficient over the example's
competing positions and the first position that has it (and, in a signed index, the most negative one, stored
negated). torch gives that as a max (min) over positions after the blocked positions (padding, special tokens)
are written with -inf (+inf): two writes and two reads of the layer's (B, T, d_m) coefficients, then copies into
the candidate buffer. On a GPU those are launches more than arithmetic. `masked_extremes` does it in one Triton
kernel: it reads the coefficients once, skips the blocked positions as it goes (masking inside the reduction, the
tensor left as it is), and writes both directions' values and positions straight into the buffer's (d_m, B)
columns.

Exactly torch's answer: comparisons in float32 order bf16 and fp16 values as they are; a later position replaces
the running extreme only when strictly better, so ties go to the first position; an example with no competing
position keeps -inf (+inf) at position 0, as torch's max over a row of -inf gives; a NaN wins, as torch's max and
min propagate it (the first NaN's position).
"""

from __future__ import annotations

import functools
import os

import torch

#: Keys per Triton program (one example, this many keys, looping over the positions).
BLOCK_KEYS = 128


#: The oldest CUDA compute capability the kernel is used on (Ampere); older cards keep torch's reductions.
MIN_CAPABILITY = (8, 0)


def available(c: torch.Tensor) -> bool:
    """Whether `masked_extremes` runs for these coefficients: on a CUDA device of at least `MIN_CAPABILITY` with
    Triton installed, or in Triton's interpreter (TRITON_INTERPRET=1, on a CPU: the tests' way to run the kernel
    without a GPU)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if c.dim() != 3 or not (interpreted or (c.is_cuda and _capable(c.device))):
        return False
    return _triton()


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


@functools.cache
def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel(interpret: bool):
    """The Triton kernel, made at first use (Triton decides at decoration whether it is interpreted; `interpret`
    keys the cache so a test that switches the interpreter on gets its own)."""
    import triton
    import triton.language as tl

    @triton.jit
    def extremes(c_ptr, competes_ptr, max_ptr, argmax_ptr, min_ptr, argmin_ptr, T, D,
                 c_b, c_t, c_d, m_b, m_t, v_d, v_b, p_d, p_b, w_d, w_b, q_d, q_b,
                 SIGNED: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        keys = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = keys < D
        row = b.to(tl.int64) * c_b  # a batch's coefficients may pass 2**31 elements
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_at = tl.full([BLOCK], 0, tl.int32)
        worst = tl.full([BLOCK], float("inf"), tl.float32)
        worst_at = tl.full([BLOCK], 0, tl.int32)
        for t in range(0, T):
            competes = tl.load(competes_ptr + b * m_b + t * m_t) != 0
            x = tl.load(c_ptr + row + t * c_t + keys * c_d, mask=inside, other=0.0).to(tl.float32)
            nan = x != x
            up = competes & ((x > best) | (nan & (best == best)))
            best = tl.where(up, x, best)
            best_at = tl.where(up, t, best_at)
            if SIGNED:
                down = competes & ((x < worst) | (nan & (worst == worst)))
                worst = tl.where(down, x, worst)
                worst_at = tl.where(down, t, worst_at)
        tl.store(max_ptr + keys * v_d + b * v_b, best, mask=inside)
        tl.store(argmax_ptr + keys * p_d + b * p_b, best_at, mask=inside)
        if SIGNED:
            tl.store(min_ptr + keys * w_d + b * w_b, -worst, mask=inside)
            tl.store(argmin_ptr + keys * q_d + b * q_b, worst_at, mask=inside)

    return extremes


def masked_extremes(c: torch.Tensor, competes: torch.Tensor, best: torch.Tensor, best_at: torch.Tensor,
                    worst: torch.Tensor | None = None, worst_at: torch.Tensor | None = None) -> None:
    """Per example and key, the extremes of (B, T, d_m) coefficients `c` over the positions where (B, T)
    `competes`, written into (d_m, B) views (any strides: the candidate buffer's columns).

    Args:
        best, best_at: float32 and int32 (d_m, B): the largest coefficient and its first position.
        worst, worst_at: the same for the smallest coefficient, stored negated (-min, as a signed index's state
            keeps the negative direction); None: a positive index, the minimum not computed.
    """
    b, t, d = c.shape
    signed = worst is not None
    if best.shape != (d, b) or best.dtype != torch.float32 or best_at.dtype != torch.int32:
        raise ValueError(f"outputs must be (d_m, B) = ({d}, {b}) float32 values and int32 positions")
    worst, worst_at = (worst, worst_at) if signed else (best, best_at)  # unused pointers when not signed
    flags = competes.view(torch.uint8) if competes.dtype == torch.bool else competes
    grid = (b, -(-d // BLOCK_KEYS))
    _kernel(os.environ.get("TRITON_INTERPRET") == "1")[grid](
        c, flags, best, best_at, worst, worst_at, t, d, *c.stride(), *flags.stride(),
        *best.stride(), *best_at.stride(), *worst.stride(), *worst_at.stride(), SIGNED=signed, BLOCK=BLOCK_KEYS)


__all__ = ["BLOCK_KEYS", "available", "masked_extremes"]
