"""Trace a prompt through the memories, and intervene on them (paper Section 5, per prompt).

Per layer, at one position: the top prediction of the residual before the FF layer
(`resid_mid`), of the FF output itself (`ff_out`) and of the residual after it
(`resid_post`), and the memories that contributed most, by |m_i|·‖v_i‖. An intervention
scales chosen coefficients m_i (0 switches a memory off) at every position
(`ffkv.memories.interventions`), and the trace is run again.
Projections: final normalization for residuals, identity for ff_out (SPEC section 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ffkv.memories.interventions import Intervention, intervene
from ffkv.memories.projection import DEFAULT_FOR_RESIDUALS, DEFAULT_FOR_VALUES, logits
from ffkv.models.loading import LoadedModel

Edits = dict[tuple[int, int], float]


@dataclass
class Prediction:
    token_id: int
    prob: float


@dataclass
class LayerTrace:
    layer: int
    before: Prediction          # argmax p(resid_mid)
    ff: Prediction              # argmax p(ff_out)
    after: Prediction           # argmax p(resid_post)
    memories: list[dict]        # key, coefficient, contribution |m_i|·‖v_i‖, scale (if edited)
    coefficients: torch.Tensor  # m at the position, (d_m,)


@dataclass
class TraceResult:
    token_ids: list[int]
    position: int
    layers: list[LayerTrace]
    final: list[Prediction]     # the model's own top predictions at `position`
    edits: Edits = field(default_factory=dict)


def max_prompt_tokens(loaded: LoadedModel) -> int:
    """How many tokens the model accepts (its position table, less two for offset-style tables)."""
    config = getattr(loaded.model, "config", None)
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 2:
            return value - 2
    return 1024


def _top(lg: torch.Tensor) -> Prediction:
    p = lg.float().softmax(-1)
    value, index = p.max(-1)
    return Prediction(int(index), float(value))


@torch.no_grad()
def trace(loaded: LoadedModel, token_ids: list[int], edits: Edits | None = None, position: int = -1,
          top_memories: int = 8) -> TraceResult:
    """Trace `token_ids` (one prompt) at `position`, optionally with memories scaled or switched off."""
    view = loaded.view
    edits = dict(edits or {})
    ids = torch.tensor([token_ids], dtype=torch.long, device=view.device)
    mask = torch.ones_like(ids)
    pos = position if position >= 0 else len(token_ids) + position
    with intervene(view, [Intervention.scaled(layer, key, factor) for (layer, key), factor in edits.items()]):
        with view.capture(("coefficients", "resid_mid", "ff_out", "resid_post")) as cap:
            view.forward(ids, mask)
        out = loaded.model(input_ids=ids, attention_mask=mask)
    final_logits = out.logits if hasattr(out, "logits") else out[0]
    probs = final_logits[0, pos].float().softmax(-1)
    top = probs.topk(min(5, probs.numel()))
    final = [Prediction(int(i), float(p)) for p, i in zip(top.values, top.indices)]
    layers = []
    for layer in range(view.n_layers):
        at = lambda q: cap[q][layer][0, pos]  # noqa: E731
        m = cap["coefficients"][layer][0, pos].float()
        norms = view.values(layer).float().norm(dim=1)
        contribution = m.abs() * norms
        best = contribution.topk(min(top_memories, contribution.numel()))
        memories = [{"key": int(k), "coefficient": float(m[k]), "contribution": float(c),
                     "scale": edits.get((layer, int(k)))} for c, k in zip(best.values, best.indices)]
        layers.append(LayerTrace(
            layer=layer,
            before=_top(logits(view, at("resid_mid"), DEFAULT_FOR_RESIDUALS)),
            ff=_top(logits(view, at("ff_out"), DEFAULT_FOR_VALUES)),
            after=_top(logits(view, at("resid_post"), DEFAULT_FOR_RESIDUALS)),
            memories=memories, coefficients=m.cpu(),
        ))
    return TraceResult(list(token_ids), pos, layers, final, edits)
