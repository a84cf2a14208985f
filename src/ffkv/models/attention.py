"""Causal multi-head self-attention shared by ffkv's native model families (ffkv_lm, fairseq)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def causal_attention(x: torch.Tensor, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module,
                     num_heads: int, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of x (batch, pos, d) over itself, heads merged back to (batch, pos, d).

    Args:
        attn_mask: a boolean or additive mask that already holds causality and padding,
            or None for the plain causal mask.
    """
    b, t, d = x.shape

    def heads(y: torch.Tensor) -> torch.Tensor:
        return y.view(b, t, num_heads, d // num_heads).transpose(1, 2)

    q, k, v = heads(q_proj(x)), heads(k_proj(x)), heads(v_proj(x))
    if attn_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return out.transpose(1, 2).reshape(b, t, d)
