"""Interventions on memory coefficients: switch a memory off, scale it, or set it (every position).

An intervention rewrites m_i, the input of the FF layer's second matrix, with a
pre-forward hook on that matrix, so FF(x) = Σ_i m'_i·v_i + b_V: exactly the memory
view of docs/definitions.md. Hooks exist only inside `intervene`; leaving the block restores
the model exactly. `replace_ff_output` replaces a layer's whole FF output instead (a transcoder
spliced in, mean ablation).

A latent of a sparse dictionary attached to the view (``view.latents``, `ffkv.memories.sets.Latents`) is edited
the same way (an `Intervention` of its dictionary's `kind`): the layer's output becomes the dictionary's
reconstruction from the edited activations plus the dictionary's error term (the layer's own output minus the
reconstruction from the unedited ones), that is FF(x) + Σ_j (a'_j − a_j)·dec_j over the edited latents j. An
edit that changes nothing gives the layer's own output; switching latent j off removes exactly a_j·dec_j. An
SAE's latents read the layer's output after any edit of the layer's neurons.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal, Mapping, Sequence

import torch

from ffkv.errors import FfkvError
from ffkv.memories.view import MemoryView

OPERATIONS = ("off", "scale", "set")


#: What an edit's memory is: a neuron of the model, or a latent of a dictionary of that kind (`ffkv.dictionaries`).
EDIT_KINDS = ("neuron", "transcoder", "sae")
#: The largest |factor| (scale) or |value| (set) an edit may give a memory, wherever the edit comes from (the
#: command line, the explorer, the library). Far beyond the coefficients a model makes; past it the model's
#: output soon overflows to infinity or NaN, and nothing under the edit can be measured.
MAX_EDIT_VALUE = 1e4
#: The most edits a refusal names before it counts the rest.
NAMED_EDITS = 3


class NonFiniteOutput(FfkvError):
    """The model's output under an edit is NaN or infinite: the edit overflowed the model's numbers."""


@dataclass(frozen=True)
class Intervention:
    """One memory's coefficient rewritten: off (m' = 0), scale (m' = value·m) or set (m' = value). `kind` says
    whether `key` is a neuron of the layer or a latent of the dictionary attached there ("transcoder", "sae")."""

    layer: int
    key: int
    op: Literal["off", "scale", "set"] = "off"
    value: float = 0.0
    kind: str = "neuron"

    def __post_init__(self) -> None:
        """Refuse an unknown operation or kind, and a factor or value that is not a finite number within
        ±`MAX_EDIT_VALUE` (the one bound of every edit); the value is kept as a float."""
        if self.op not in OPERATIONS:
            raise FfkvError(f"unknown intervention {str(self.op)[:40]!r}; choose from {', '.join(OPERATIONS)}")
        if self.kind not in EDIT_KINDS:
            raise FfkvError(f"unknown kind of memory {str(self.kind)[:40]!r}; choose from {', '.join(EDIT_KINDS)}")
        if self.op == "off":
            return
        what = "factor" if self.op == "scale" else "value"
        number = None if isinstance(self.value, (str, bytes, bool)) else _as_float(self.value)
        if number is None:
            raise FfkvError(f"{self.op} of memory {_address(self)}: the {what} must be a number, got "
                            f"{str(self.value)[:40]!r}")
        object.__setattr__(self, "value", number)
        if not (math.isfinite(number) and abs(number) <= MAX_EDIT_VALUE):
            raise FfkvError(f"{' '.join(_text(self))}: the {what} must be finite and within ±{MAX_EDIT_VALUE:g} "
                            "(a larger one overflows the model's output to infinity or NaN)")

    @classmethod
    def scaled(cls, layer: int, key: int, factor: float, kind: str = "neuron") -> "Intervention":
        """A scale, written as off when the factor is 0."""
        return cls(layer, key, "off", kind=kind) if factor == 0 else cls(layer, key, "scale", factor, kind)


    @property
    def factor(self) -> float | None:
        """The scale this intervention multiplies m by (0 for off), None for set."""
        return 0.0 if self.op == "off" else self.value if self.op == "scale" else None


def _as_float(value: object) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _address(edit: Intervention) -> str:
    """The edit's memory as readers write it (``4:17``, ``t4:42``)."""
    from ffkv.memories.address import edit_ref  # the one writer of addresses; it imports this module

    return str(edit_ref(edit))


def _text(edit: Intervention) -> tuple[str, str]:
    """(operation, text) of the edit as the command line writes it (``("scale", "t4:42=2")``)."""
    from ffkv.memories.address import edit_text  # the one writer of edits; it imports this module

    return edit_text(edit)


def refuse_non_finite(bad: int, total: int, edits: Sequence[Intervention]) -> None:
    """Nothing when the model's output under `edits` was finite at every position read (`bad` of `total` were
    not); else a `NonFiniteOutput` naming the edits and the count, so that a NaN is never reported as a result.
    The passes under edits a person gives ask it: `ffkv.experiments.scoring.score_examples` (`ffkv intervene`,
    the analyses that score under edits) and the explorer's trace and generation."""
    edits = list(edits)
    if not bad or not edits:
        return
    named = ", ".join(" ".join(_text(e)) for e in edits[:NAMED_EDITS])
    more = f" and {len(edits) - NAMED_EDITS:,} more" if len(edits) > NAMED_EDITS else ""
    raise NonFiniteOutput(f"the edit{'s' if len(edits) > 1 else ''} {named}{more} made the model's output NaN or "
                          f"infinite at {bad:,} of {total:,} positions: its numbers overflowed, and nothing can be "
                          "measured under it; give a smaller factor or value")


def _per_layer(view: MemoryView, interventions: Iterable[Intervention]) -> dict[int, dict[int, Intervention]]:
    out: dict[int, dict[int, Intervention]] = {}
    for edit in interventions:
        if edit.kind != "neuron":
            raise FfkvError(f"latent {edit.layer}:{edit.key} is not a neuron")  # `intervene` routes latents apart
        if not 0 <= edit.layer < view.n_layers or not 0 <= edit.key < view.d_m:
            raise FfkvError(f"memory {edit.layer}:{edit.key} does not exist: this model has layers "
                            f"0..{view.n_layers - 1} and keys 0..{view.d_m - 1}")
        out.setdefault(edit.layer, {})[edit.key] = edit  # the last one given for a memory wins
    return out


@contextmanager
def rewrite_coefficients(view: MemoryView, rewrites: Mapping[int, Callable[[torch.Tensor], torch.Tensor]]
                         ) -> Iterator[None]:
    """Within the block, layer l's coefficients m (batch, pos, d_m) are replaced by rewrites[l](m) on their way
    into the second FF matrix: the one hook every rewrite of m uses (`intervene`, the gates of
    `ffkv.memories.gates`). Leaving the block, also on an error, removes every hook."""
    handles = []
    try:
        for layer, rewrite in rewrites.items():
            def pre(module, args, rewrite=rewrite):
                return (rewrite(args[0]), *args[1:])

            handles.append(view.arch.down_proj(view.blocks[layer]).register_forward_pre_hook(pre))
        yield
    finally:
        for h in handles:
            h.remove()


def intervene(view: MemoryView, interventions: Iterable[Intervention], in_place: bool = False):
    """Within the block (a context manager), each listed memory's coefficient is rewritten at every position.

    Args:
        in_place: rewrite the listed columns of m in the tensor the layer made, not in a copy of it: the same
            values (each column is computed as in the copy), without copying m at every call. Only for a caller
            whose hooks are the first on the model (entered before any `capture`), so that no other hook has kept
            m unchanged (`ffkv.experiments.scoring`).
    """
    interventions = list(interventions)
    latent_edits = [e for e in interventions if e.kind != "neuron"]
    rewrites = {}
    for layer, edits in _per_layer(view, [e for e in interventions if e.kind == "neuron"]).items():
        columns = EditedColumns(edits, view.device)

        def rewrite(m, columns=columns):
            if not in_place:
                m = m.clone()
            m[..., columns.keys] = columns.edited(m[..., columns.keys])
            return m

        rewrites[layer] = rewrite
    if not latent_edits:
        return rewrite_coefficients(view, rewrites)
    return _both(rewrite_coefficients(view, rewrites), replace_ff_output(view, _latent_edits(view, latent_edits)))


class EditedColumns:
    """One layer's edits (index -> `Intervention`) as tensors on `device`: the edited columns, in index order, and
    how each is rewritten (the one rule, for the hooks here and for what the explorer's trace shows)."""

    def __init__(self, edits: Mapping[int, Intervention], device: torch.device | str) -> None:
        ordered = [edits[k] for k in sorted(edits)]
        self.keys = torch.tensor(sorted(edits), dtype=torch.long, device=device)
        self.factor = torch.tensor([e.factor if e.factor is not None else 1.0 for e in ordered], device=device)
        self.is_set = torch.tensor([e.op == "set" for e in ordered], device=device)
        self.setting = torch.tensor([e.value for e in ordered], device=device)
        self.any_set = bool(self.is_set.any())

    def edited(self, a: torch.Tensor) -> torch.Tensor:
        """The edited values of the columns `a` (..., len(keys)): off 0, scale factor·a, set the value."""
        scaled = a * self.factor.to(a.dtype)
        # where(False, ., x) is x: without a set edit, the scaled columns are written as they are.
        return torch.where(self.is_set, self.setting.to(a.dtype), scaled) if self.any_set else scaled


@contextmanager
def _both(first, second) -> Iterator[None]:
    with first, second:
        yield


def _latent_edits(view: MemoryView, edits: list[Intervention]
                  ) -> dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Per layer, the FF output with its latents edited (the module docstring): FF(x) + Σ_j (a'_j − a_j)·dec_j."""
    latents = getattr(view, "latents", None)
    if latents is None:
        raise FfkvError("an edit of a latent needs its dictionary attached to the model (open the run's latents: "
                        "Run.memories('latents'), or a run indexed with --dictionary)")
    per: dict[int, dict[int, Intervention]] = {}
    for edit in edits:
        ref = latents.layout.check_latent(edit.layer, edit.key, edit.kind)
        per.setdefault(ref.layer, {})[ref.latent] = edit
    out = {}
    for layer, chosen in per.items():
        d, reads = latents.dictionaries[layer], latents.reads(layer)
        columns = EditedColumns(chosen, d.device)
        decoder = d.decoder[columns.keys]

        def edited(x, ff_out, d=d, reads=reads, columns=columns, decoder=decoder):
            a = d.encode(x if reads == "ff_in" else ff_out)[..., columns.keys]
            return ff_out + ((columns.edited(a) - a) @ decoder).to(ff_out.dtype)

        out[layer] = edited
    return out


def latents_off_by_row(view: MemoryView, off: Mapping[int, Callable[[], torch.Tensor]]):
    """Within the block (a context manager), layer l's latents where ``off[l]()`` (batch, 1, n_latents) is True are
    switched off row by row: the FF output becomes FF(x) − Σ_j off_j·a_j·dec_j, the rule of an "off" edit
    (`intervene`) with the latents each row switches off (several masked models' passes in one batch)."""
    latents = getattr(view, "latents", None)
    if latents is None:
        raise FfkvError("an edit of a latent needs its dictionary attached to the model (open the run's latents: "
                        "Run.memories('latents'), or a run indexed with --dictionary)")
    out = {}
    for layer, mask in off.items():
        d, reads = latents.dictionaries[layer], latents.reads(layer)

        def edited(x, ff_out, d=d, reads=reads, mask=mask):
            a = d.encode(x if reads == "ff_in" else ff_out)
            rows = mask()
            gone = (a.reshape(rows.shape[0], -1, a.shape[-1]) * rows).reshape(-1, a.shape[-1])
            return ff_out - _decoded(gone, d.decoder).reshape(ff_out.shape).to(ff_out.dtype)

        out[layer] = edited
    return replace_ff_output(view, out)


#: Elements of the decoder rows `_decoded` gathers at once.
GATHER_ELEMENTS = 2**24


def _decoded(a: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
    """a (rows, n_latents) · decoder (n_latents, d), reading only each row's nonzero activations where they are few
    (a dictionary's are: TopK's k, a ReLU's or JumpReLU's active latents), in chunks of rows."""
    k = int((a != 0).sum(-1).max()) if a.numel() else 0
    if k == 0:
        return a.new_zeros(a.shape[0], decoder.shape[1])
    if 4 * k >= a.shape[-1]:
        return a @ decoder
    values, indices = a.topk(k, dim=-1)  # activations are never negative: every nonzero one is among them
    step = max(1, GATHER_ELEMENTS // (k * decoder.shape[1]))
    return torch.cat([(values[s:s + step, None, :] @ decoder[indices[s:s + step]])[:, 0]
                      for s in range(0, len(values), step)])


@contextmanager
def replace_ff_output(view: MemoryView,
                      replacements: Mapping[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]) -> Iterator[None]:
    """Within the block, layer l's FF output FF(x) is replaced by replacements[l](x, FF(x)) on its way into the
    residual stream, x the FF input after the pre-FF norm (both as the model holds them: (batch, pos, d), or
    flattened where the family flattens): a transcoder spliced in for the layer, or the layer's output set to
    its mean (mean ablation). Leaving the block, also on an error, removes every hook."""
    handles = []
    try:
        for layer, replace in replacements.items():
            view._check_layer(layer)
            block, seen = view.blocks[layer], {}

            def remember(module, args, seen=seen):
                seen["x"] = args[0]

            def substitute(module, args, out, replace=replace, seen=seen):
                ff_out = out[0] if isinstance(out, (tuple, list)) else out
                new = replace(seen.pop("x"), ff_out).to(ff_out.dtype)
                return (new, *out[1:]) if isinstance(out, (tuple, list)) else new

            handles.append(view.arch.key_proj(block).register_forward_pre_hook(remember))
            handles.append(view.arch.down_proj(block).register_forward_hook(substitute))
        yield
    finally:
        for h in handles:
            h.remove()
