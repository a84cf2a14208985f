"""Trace a prompt through the memories, intervene on them, and generate with the interventions (paper Section 5).

Per layer, at any position of the prompt: the top prediction of the residual before the FF
layer (`resid_mid`), of the FF output itself (`ff_out`) and of the residual after it
(`resid_post`), and the memories that contributed most to a chosen token t, by
m_i · (v_i·E[t]) (the coefficient times the value's logit for t, identity projection, as
the paper reads values). t is the model's own top prediction at that position unless the
reader picks another. An intervention rewrites chosen coefficients m_i (0 switches a memory
off) at every position (`ffkv.memories.interventions`); the trace runs again, and `generate`
continues the prompt greedily with and without it. Where a sparse dictionary covers a layer, its latents are
listed beside the neurons and edited the same way: the layer's output becomes the dictionary's reconstruction
with the edit plus its error term, FF(x) + Σ_j (a'_j − a_j)·d_j, so an edit of nothing is the model itself.
Projections: final normalization for residuals, identity for ff_out (docs/definitions.md); the residuals can
be read through the run's fitted translators instead (the tuned lens, `lens="translator"`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from ffkv.explorer.validation import MAX_NEW_TOKENS
from ffkv.errors import FfkvError
from ffkv.memories.interventions import EditedColumns, Intervention, intervene, refuse_non_finite
from ffkv.memories.sets import MemorySet
from ffkv.memories.projection import DEFAULT_FOR_RESIDUALS, DEFAULT_FOR_VALUES, TRANSLATOR, final_logits, logits
from ffkv.models.loading import LoadedModel

#: Edits applied at every position: {(layer from 0, key): the memory's `Intervention` (off, scale or set)}, one
#: dict for the neurons and one for a dictionary's latents (key: the latent).
Edits = dict[tuple[int, int], Intervention]
#: How the residual columns (before and after the FF layer) are read: the logit lens, or the run's fitted
#: per-layer translators (`ffkv.memories.translators`; T_l for both of layer l's residual vectors).
LENSES = (DEFAULT_FOR_RESIDUALS, TRANSLATOR)


@dataclass
class Prediction:
    token_id: int
    prob: float
    target_prob: float | None = None  # the probability of the trace's target token under the same reading


@dataclass
class LayerTrace:
    layer: int
    before: Prediction          # argmax p(resid_mid)
    ff: Prediction              # argmax p(ff_out)
    after: Prediction           # argmax p(resid_post)
    memories: list[dict]        # the top contributors to the target: key, coefficient, contribution, edit
    suppressing: list[dict]     # the most negative contributions to the target
    edited: list[dict]          # the other memories of the layer that are edited (or asked to be shown)
    coefficients: torch.Tensor  # m at the position, (d_m,)
    # a dictionary's latents at this layer (`trace`'s `latents`): latent, activation a_j (as edited), contribution
    # a_j·(d_j·E[t]), address, edit
    latents: list[dict] = field(default_factory=list)


@dataclass
class TraceResult:
    token_ids: list[int]
    position: int
    target: int                 # the token whose memory contributions are listed
    layers: list[LayerTrace]
    final: list[Prediction]     # the model's own top predictions at `position`
    edits: Edits = field(default_factory=dict)
    lens: str = DEFAULT_FOR_RESIDUALS  # how the residual columns were read (`LENSES`)
    latent_edits: Edits = field(default_factory=dict)  # {(layer, latent): edit}


def max_prompt_tokens(loaded: LoadedModel) -> int:
    """How many tokens the model accepts (its position table, less two for offset-style tables)."""
    config = getattr(loaded.model, "config", None)
    for name in ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 2:
            return value - 2
    return 1024


def _top(lg: torch.Tensor, target: int | None = None) -> Prediction:
    p = lg.float().softmax(-1)
    value, index = p.max(-1)
    return Prediction(int(index), float(value), None if target is None else float(p[target]))


def _run(view, ids: torch.Tensor, quantities: tuple[str, ...]) -> tuple[torch.Tensor, dict]:
    """One forward pass of a prompt: the model's own output logits (`final_logits`) and the captures of
    `quantities` (the last layer's output is captured too: the logits of a model whose head is not a module
    call are read from it)."""
    asked = tuple(dict.fromkeys(quantities + ("resid_post", "head_in")))
    last_only = [view.n_layers - 1] if not quantities else None  # generation: only the fallback's last layer
    with view.capture(asked, layers=last_only) as cap:
        view.forward(ids, torch.ones_like(ids), with_head=True)
    return final_logits(view, cap["head_in"].get(-1), cap["resid_post"][view.n_layers - 1]), cap


def _check_output(output: torch.Tensor, edits: list[Intervention]) -> None:
    """The model's output logits (batch, positions, |V|) under `edits`, refused where NaN or infinite
    (`refuse_non_finite`): a trace or a generation of nothing but overflow is no result."""
    if edits:
        finite = torch.isfinite(output).all(-1)
        refuse_non_finite(int((~finite).sum()), finite.numel(), edits)


def _memory(key: int, m: torch.Tensor, contribution: torch.Tensor, edits: Edits, layer: int) -> dict:
    return {"key": key, "coefficient": float(m[key]), "contribution": float(contribution[key]),
            "edit": edits.get((layer, key))}


def _latents(latents: MemorySet, layer: int, captured: torch.Tensor, e_target: torch.Tensor, top: int,
             edits: Edits, listed: set[tuple[int, int]]) -> list[dict]:
    """The active latents of `layer` (none where the dictionary does not cover it) that push the target most, then
    the listed ones (edited, or edited in the trace compared with): key (the latent), coefficient (a_j at the
    position, as edited), contribution a_j·(d_j·E[t]), address, edit. `captured` is what the latents read there."""
    if layer not in latents.layers:
        return []
    a = latents.coefficients(layer, captured[None]).float()[0]
    here = {k: e for (lay, k), e in edits.items() if lay == layer}
    if here:
        columns = EditedColumns(here, a.device)
        a[columns.keys] = columns.edited(a[columns.keys])
    contribution = a * (latents.values(layer).float() @ e_target)
    order = [k for k in contribution.topk(min(top, contribution.numel())).indices.tolist() if a[k] > 0]
    order += sorted(k for (lay, k) in listed if lay == layer and k not in order)
    return [{"key": k, "coefficient": float(a[k]), "contribution": float(contribution[k]),
             "address": str(latents.ref(layer, k)), "edit": here.get(k)} for k in order]


@contextmanager
def _outputs_before_edits(view, layers: Iterable[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, the FF output of each of `layers` as the layer made it, before an edit of its latents
    replaces it (an SAE's latents read that output: the trace shows their own activations, then the edit). Entered
    before `intervene`, so its hook runs first."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    try:
        for layer in layers:
            def keep(module, args, out, layer=layer):
                seen[layer] = (out[0] if isinstance(out, (tuple, list)) else out).detach()

            handles.append(view.arch.down_proj(view.blocks[layer]).register_forward_hook(keep))
        yield seen
    finally:
        for h in handles:
            h.remove()


def _split(edits: Iterable[Intervention], latents: MemorySet | None) -> tuple[Edits, Edits]:
    """The edits of neurons and of latents, each {(layer, key): edit}; a latent's checked against `latents` (an
    edit of a latent without them is refused in one line)."""
    neurons, of_latents = {}, {}
    for e in edits:
        if e.kind == "neuron":
            neurons[(e.layer, e.key)] = e
            continue
        if latents is None:
            from ffkv.memories.address import edit_ref

            raise FfkvError(f"an edit of latent {edit_ref(e)} needs the run's dictionary (a run indexed with "
                            "--dictionary, its files where the manifest says)")
        ref = latents.layout.check_latent(e.layer, e.key, e.kind)
        of_latents[(ref.layer, ref.latent)] = e
    return neurons, of_latents


@torch.no_grad()
def trace(loaded: LoadedModel, token_ids: list[int], edits: Iterable[Intervention] = (), position: int = -1,
          target: int | None = None, top_memories: int = 8, suppressing: int = 3,
          show: Iterable[tuple[int, int]] = (), lens: str = DEFAULT_FOR_RESIDUALS,
          latents: MemorySet | None = None, top_latents: int = 5,
          show_latents: Iterable[tuple[int, int]] = ()) -> TraceResult:
    """Trace `token_ids` (one prompt) at `position`, optionally with memories switched off, scaled or set.

    Args:
        edits: memories switched off, scaled or set at every position (layers from 0): neurons, and latents of
            `latents` (an `Intervention` of the dictionary's kind); an output they make NaN or infinite is refused
            (`refuse_non_finite`).
        position: the position to read (negative counts from the end).
        target: the token whose contributions rank the memories; default the model's top prediction.
        top_memories, suppressing: memories listed per layer with the largest and most negative contributions.
        show: (layer, key) pairs listed too (beside the edited ones), e.g. the edits of a trace to compare with.
        lens: how resid_mid and resid_post are read (`LENSES`); "translator" needs the view's translators.
        latents: a dictionary's latents (`ffkv.memories.sets.Latents`) to read beside the neurons: per layer it
            covers, the `top_latents` active latents (a_j > 0) with the largest contributions a_j·(d_j·E[t]) to the
            target, read from the same pass, then the edited ones and `show_latents` ((layer, latent) pairs).
    """
    view = loaded.view
    edits, latent_edits = _split(edits, latents)
    listed = set(edits) | set(show)
    listed_latents = set(latent_edits) | set(show_latents)
    ids = torch.tensor([token_ids], dtype=torch.long, device=view.device)
    pos = position if position >= 0 else len(token_ids) + position
    if not 0 <= pos < len(token_ids):
        raise IndexError(f"position {position} is outside the prompt's {len(token_ids)} tokens")
    read = tuple(sorted({latents.reads(layer) for layer in latents.layers})) if latents is not None else ()
    # An SAE's latents read the FF output, which an edit of them replaces: read them from the layer's own output.
    replaced = sorted({layer for layer, _ in latent_edits if latents.reads(layer) == "ff_out"})
    with latents.attached() if latent_edits else nullcontext(), _outputs_before_edits(view, replaced) as own, \
            intervene(view, [*edits.values(), *latent_edits.values()]):
        output, cap = _run(view, ids, tuple(dict.fromkeys(("coefficients", "resid_mid", "ff_out", "resid_post")
                                                          + read)))
    _check_output(output, [*edits.values(), *latent_edits.values()])
    probs = output[0, pos].float().softmax(-1)
    top = probs.topk(min(5, probs.numel()))
    final = [Prediction(int(i), float(p)) for p, i in zip(top.values, top.indices)]
    target = final[0].token_id if target is None else int(target)
    e_target = view.unembedding[target].float()
    layers = []
    for layer in range(view.n_layers):
        at = lambda q: cap[q][layer][0, pos]  # noqa: E731
        m = at("coefficients").float()
        contribution = m * (view.values(layer).float() @ e_target)
        best = contribution.topk(min(top_memories, contribution.numel())).indices.tolist()
        worst = [k for k in (-contribution).topk(min(suppressing, contribution.numel())).indices.tolist()
                 if contribution[k] < 0]
        touched = sorted(k for (lay, k) in listed if lay == layer and k not in best and k not in worst)
        shown_latents = []
        if latents is not None and layer in latents.layers:
            captured = own[layer][0, pos] if layer in own else at(latents.reads(layer))
            shown_latents = _latents(latents, layer, captured, e_target, top_latents, latent_edits, listed_latents)
        layers.append(LayerTrace(
            layer=layer,
            before=_top(logits(view, at("resid_mid"), lens, layer=layer), target),
            ff=_top(logits(view, at("ff_out"), DEFAULT_FOR_VALUES), target),
            after=_top(logits(view, at("resid_post"), lens, layer=layer), target),
            memories=[_memory(k, m, contribution, edits, layer) for k in best],
            suppressing=[_memory(k, m, contribution, edits, layer) for k in worst],
            edited=[_memory(k, m, contribution, edits, layer) for k in touched],
            coefficients=m.cpu(),
            latents=shown_latents,
        ))
    return TraceResult(list(token_ids), pos, target, layers, final, edits, lens, latent_edits)


@torch.no_grad()
def generate(loaded: LoadedModel, token_ids: list[int], n: int, edits: Iterable[Intervention] = (),
             max_tokens: int | None = None, latents: MemorySet | None = None) -> list[int]:
    """The prompt continued greedily by n tokens (fewer at the model's length limit), with `edits` applied
    at every position of every step (latents' edits: of `latents`); an output they make NaN or infinite is
    refused (`refuse_non_finite`). Returns the new token ids only."""
    view = loaded.view
    limit = max_tokens or max_prompt_tokens(loaded)
    ids = torch.tensor([token_ids], dtype=torch.long, device=view.device)
    new: list[int] = []
    neurons, of_latents = _split(edits, latents)
    edited = [*neurons.values(), *of_latents.values()]
    with latents.attached() if of_latents else nullcontext(), intervene(view, edited):
        for _ in range(min(n, MAX_NEW_TOKENS)):
            if ids.shape[1] >= limit:
                break
            output = _run(view, ids, ())[0]
            _check_output(output, edited)
            nxt = int(output[0, -1].argmax())
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=view.device)], dim=1)
    return new
