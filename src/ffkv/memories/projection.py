"""Projecting vectors onto the vocabulary: p(h) = softmax(N(h)·Eᵀ) (SPEC section 1).

N is the identity (the paper's choice, and the default for values and memory
sub-updates) or the model's final normalization (the default for residual-stream
vectors, the "logit lens"). Every result records which one it used.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ffkv.errors import FfkvError
from ffkv.memories.view import MemoryView

PROJECTIONS = ("identity", "final-norm")
#: Defaults of SPEC section 1: values and sub-updates as in the paper, residuals through N.
DEFAULT_FOR_VALUES = "identity"
DEFAULT_FOR_RESIDUALS = "final-norm"


def check_projection(name: str) -> str:
    """Validate a projection name."""
    if name not in PROJECTIONS:
        raise FfkvError(f"unknown projection {name!r}; choose from {', '.join(PROJECTIONS)}")
    return name


@torch.no_grad()
def logits(view: MemoryView, h: torch.Tensor, projection: str) -> torch.Tensor:
    """Vocabulary logits of vectors h (..., d): N(h)·Eᵀ.

    As in SPEC section 1, the LM head's bias (GPT-J, BERT) is not added: it is the
    same for every vector and would pull every distribution towards frequent tokens.
    Heads that are not one matrix (fairseq's adaptive softmax) are called as they are.
    """
    check_projection(projection)
    if projection == "final-norm":
        h = view.final_norm(h)
    head = view.arch.unembed(view.model)
    h = h.to(view.unembedding.dtype)
    if isinstance(head, torch.nn.Linear):
        return (h @ head.weight.T).float()
    return head(h).float()


@torch.no_grad()
def value_logits(
    view: MemoryView, layer: int, projection: str = DEFAULT_FOR_VALUES, chunk: int = 1024
) -> Iterator[tuple[int, torch.Tensor]]:
    """Logits of a layer's value vectors, `chunk` keys at a time.

    Yields (first key of the chunk, logits (n, |V|) float32). Peak memory is
    chunk x |V| floats, never d_m x |V| or L x d_m x |V|.
    """
    values = view.values(layer)
    for start in range(0, values.shape[0], chunk):
        yield start, logits(view, values[start : start + chunk], projection)
