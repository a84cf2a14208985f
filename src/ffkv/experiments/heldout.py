"""One forward pass over the held-out examples that serves both SPEC sections 7 and 8.

For each example, at its one seeded position, every layer: the coefficients m (reduced
at once to the number of active memories and whether an active memory's top token
equals the FF output's), and the top tokens of resid_mid, ff_out and resid_post. The
final prediction o is read from the model's own LM head (its input is captured as
``head_in`` and the head is applied to the chosen positions only), so o is what the
model predicts, head bias included. Only (examples x layers) integers and floats are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ffkv.experiments.common import RunContext, as_numpy, mask_token_id, progress_bar
from ffkv.experiments.values import value_top_tokens
from ffkv.memories.projection import logits as project
from ffkv.parallel import gather_rows


@dataclass
class EvalCapture:
    """Per example (rows, in held-out order) and layer (columns): what sections 7 and 8 read.

    n_active: number of memories with m_i > 0.
    ff_top: argmax p(ff_out) (values projection).
    ff_matches: whether some active memory's sub-update m_i·v_i has the same top token.
    post_top_values / post_matches: the released code's variant, resid_post under the
        values projection, and whether an active memory's top token equals it.
    resid_top: argmax p(resid_mid); post_top: argmax p(resid_post) (residual projection).
    confidence: p(resid_mid)[o] (residual projection).
    final: o, the model's prediction (N,).
    """

    n_active: np.ndarray
    ff_top: np.ndarray
    ff_matches: np.ndarray
    post_top_values: np.ndarray
    post_matches: np.ndarray
    resid_top: np.ndarray
    post_top: np.ndarray
    confidence: np.ndarray
    final: np.ndarray


def _final_logits(view, head_input: torch.Tensor | None, resid_post_last: torch.Tensor) -> torch.Tensor:
    if head_input is not None:
        return view.final_logits(head_input)
    # The model's forward did not call its head as a module: the logit lens of the last layer.
    z = project(view, resid_post_last, "final-norm")
    if view.unembedding_bias is not None:
        z = z + view.unembedding_bias.float()
    return z


def _matches_exact(view, layer: int, m: torch.Tensor, projection: str, *tops: torch.Tensor,
                   chunk: int = 256) -> list[torch.Tensor]:
    """Whether some active memory's sub-update m_i·v_i has each given top token, projecting every one."""
    values = view.values(layer)
    found = [torch.zeros(m.shape[0], dtype=torch.bool, device=m.device) for _ in tops]
    for b in range(m.shape[0]):
        active = torch.nonzero(m[b] > 0)[:, 0]
        for start in range(0, len(active), chunk):
            keys = active[start:start + chunk]
            sub = m[b, keys, None].to(values.dtype) * values[keys]
            best = project(view, sub, projection).argmax(-1)
            for f, t in zip(found, tops):
                f[b] |= bool((best == t[b]).any())
    return found


def capture_eval(ctx: RunContext) -> EvalCapture:
    """The held-out pass, run once per `analyze` and shared by composition and refinement."""
    return ctx.once("eval_capture", lambda: _capture_eval(ctx))


@torch.no_grad()
def _capture_eval(ctx: RunContext) -> EvalCapture:
    """Run the held-out examples once.

    Under torchrun each rank runs its share of the batches; every rank gets every example's row.
    """
    view, held = ctx.view, ctx.held_out()
    L, N = view.n_layers, len(held.examples)
    pv, pr = ctx.projections.values, ctx.projections.residuals
    device = view.device
    tops = [torch.as_tensor(value_top_tokens(ctx, layer), device=device) for layer in range(L)]
    out = {k: np.zeros((N, L), dtype=dt) for k, dt in (
        ("n_active", np.int32), ("ff_top", np.int64), ("ff_matches", bool), ("post_top_values", np.int64),
        ("post_matches", bool), ("resid_top", np.int64), ("post_top", np.int64), ("confidence", np.float32))}
    final = np.zeros(N, dtype=np.int64)

    mask_id = mask_token_id(ctx.tokenizer) if view.encoder else None
    rows = []
    for i, (e, j) in enumerate(zip(held.examples, held.positions)):
        ids = np.asarray(e.token_ids, dtype=np.int64).copy()
        if mask_id is not None:
            ids[j] = mask_id  # SPEC section 9: the encoder predicts the masked token
        rows.append((i, ids))

    state: dict = {}

    def sink(name: str, layer: int, t: torch.Tensor) -> None:
        # head_in keeps the model's dtype: the head is applied to it as the model would.
        picked = t[state["rows"], state["pos"]]
        state[(name, layer)] = picked if name == "head_in" else picked.float()

    mine = ctx.batches(rows)
    bar = progress_bar(ctx.progress, len(mine.rows), "held-out pass", "ex")
    try:
        with view.capture(("coefficients", "resid_mid", "ff_out", "resid_post", "head_in"), sink=sink):
            for idx, batch in mine:
                state.clear()
                state["rows"] = torch.arange(len(idx), device=device)
                state["pos"] = torch.as_tensor(held.positions[idx], device=device)
                view.forward(batch.input_ids, batch.attention_mask, with_head=True)  # ends at the head
                o = _final_logits(view, state.get(("head_in", -1)), state[("resid_post", L - 1)]).argmax(-1)
                final[idx] = as_numpy(o)
                for layer in range(L):
                    m = state[("coefficients", layer)]
                    active = m > 0
                    ff = project(view, state[("ff_out", layer)], pv).argmax(-1)
                    post_v = project(view, state[("resid_post", layer)], pv).argmax(-1)
                    if pv == "identity":
                        # argmax p(m_i·v_i) = argmax p(v_i) when m_i > 0: a positive scale of the logits.
                        same_ff = ((tops[layer][None, :] == ff[:, None]) & active).any(-1)
                        same_post = ((tops[layer][None, :] == post_v[:, None]) & active).any(-1)
                    else:
                        # A normalization is not scale-free (epsilon, bias, dense layers): project each one.
                        same_ff, same_post = _matches_exact(view, layer, m, pv, ff, post_v)
                    z_mid = project(view, state[("resid_mid", layer)], pr)
                    r = z_mid.argmax(-1)
                    conf = torch.softmax(z_mid, -1).gather(1, o[:, None])[:, 0]
                    y = project(view, state[("resid_post", layer)], pr).argmax(-1)
                    for name, value in (("n_active", active.sum(-1)), ("ff_top", ff), ("ff_matches", same_ff),
                                        ("post_top_values", post_v), ("post_matches", same_post),
                                        ("resid_top", r), ("post_top", y), ("confidence", conf)):
                        out[name][idx, layer] = as_numpy(value)
                bar.update(len(idx))
    finally:
        bar.close()
    out = gather_rows({**out, "final": final}, mine.rows)  # this rank's examples -> all, under torchrun
    return EvalCapture(**out)
