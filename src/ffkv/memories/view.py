"""The key-value memory view of a loaded model (docs/definitions.md).

`MemoryView` exposes, for layer l, the keys K (d_m x d), values V (d_m x d) and
biases of the feed-forward layer `FF(x) = f(x·Kᵀ + b_K)·V + b_V`, the output
embedding E and the final normalization, and captures per-layer quantities
during a forward pass with hooks, only for the layers and quantities asked for:

- ``coefficients``: m, the input of the second FF matrix  (batch, pos, d_m)
- ``ff_in``: x, the FF layer's input (after its pre-FF norm)  (batch, pos, d)
- ``resid_mid``: the residual right before the FF output is added  (batch, pos, d)
- ``ff_out``: FF(x)  (batch, pos, d)
- ``resid_post``: resid_mid + ff_out  (batch, pos, d)
- ``head_in``: the LM head's input, after the final normalization  (batch, pos, d); captured
  only by ``forward(..., with_head=True)``, which then ends at the head: the consumer
  applies the head to the positions it needs (`final_logits`), never to the whole batch.

Every forward hook of ffkv lives in this package (here and in `ffkv.memories.interventions`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from jaxtyping import Float, Int
from torch import nn

from ffkv.errors import FfkvError
from ffkv.memories.architectures import Architecture, architecture_of, signed_coefficients

QUANTITIES = ("coefficients", "ff_in", "resid_mid", "ff_out", "resid_post", "head_in")

#: sink(quantity, layer, tensor) receives each captured tensor instead of storing it.
Sink = Callable[[str, int, torch.Tensor], None]


class StopForward(Exception):
    """Raised inside a hook to end a forward pass once the last needed layer has run."""


def _weight_rows(module: nn.Module, conv1d: bool) -> torch.Tensor:
    """The weight as (out_features, in_features) whatever the storage layout."""
    return module.weight.T if conv1d else module.weight


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class Capture(dict):
    """Captured tensors: ``capture[quantity][layer]`` -> tensor (batch, pos, ...)."""


class MemoryView:
    """Keys, values and captures of a model's feed-forward layers.

    Args:
        model: a loaded model of a supported family (see `ffkv.memories.architectures`).
    """

    def __init__(self, model: nn.Module, architecture: Architecture | None = None) -> None:
        self.model = model
        self.arch = architecture or architecture_of(model)
        self.blocks = list(self.arch.blocks(model))
        self._shape: tuple[int, int] | None = None
        self._running = False  # inside `forward`: the head hook fires only there
        #: Fitted per-layer translators (`ffkv.memories.translators.Translators`) read by the "translator"
        #: projection; None until fitted or loaded from a run (the translators experiment sets them).
        self.translators = None
        #: The sparse dictionary attached to the model (`ffkv.memories.sets.Latents`), whose latents edits of
        #: `ffkv.memories.interventions.intervene` may name; None until attached (`Latents.attach`).
        self.latents = None

    # ------------------------------------------------------------------ shape
    @property
    def n_layers(self) -> int:
        """L, the number of FF layers."""
        return len(self.blocks)

    @property
    def d_m(self) -> int:
        """Memories per layer."""
        return self.keys(0).shape[0]

    @property
    def d_model(self) -> int:
        """Width of the residual stream."""
        return self.keys(0).shape[1]

    @property
    def gated(self) -> bool:
        """Whether m = act(x·Gᵀ) ⊙ (x·Uᵀ) (Llama-style) rather than f(x·Kᵀ + b_K)."""
        return self.arch.up_proj(self.blocks[0]) is not None

    @property
    def signed(self) -> bool:
        """Whether some coefficient m_i can be negative (gated FF layers, GELU, SiLU; not ReLU):
        `ffkv.memories.architectures.signed_coefficients` of any layer."""
        return any(signed_coefficients(self.arch, self.model, block) for block in self.blocks)

    @property
    def parallel(self) -> bool:
        """Whether attention and FF read the same block input (GPT-J, parallel GPT-NeoX)."""
        return self.arch.parallel(self.model)

    @property
    def encoder(self) -> bool:
        """Whether the model is a masked-LM encoder (BERT, RoBERTa)."""
        return self.arch.encoder

    @property
    def resid_mid_definition(self) -> str:
        """Which definition of resid_mid applies to this model (docs/definitions.md)."""
        if self.parallel:
            return "parallel: resid_pre + attn_out"
        return "sequential: residual before the FF output is added"

    # ---------------------------------------------------------------- weights
    def _check_layer(self, layer: int) -> nn.Module:
        if not 0 <= layer < self.n_layers:
            raise FfkvError(f"layer {layer} does not exist: this model has layers 0..{self.n_layers - 1}")
        return self.blocks[layer]

    def keys(self, layer: int) -> Float[torch.Tensor, "d_m d_model"]:
        """K of a layer: row i is key k_i (the gate row for gated layers)."""
        return _weight_rows(self.arch.key_proj(self._check_layer(layer)), self.arch.conv1d)

    def key_bias(self, layer: int) -> Float[torch.Tensor, "d_m"] | None:
        """b_K of a layer, or None."""
        return self.arch.key_proj(self._check_layer(layer)).bias

    def up(self, layer: int) -> Float[torch.Tensor, "d_m d_model"] | None:
        """U of a gated layer, else None."""
        module = self.arch.up_proj(self._check_layer(layer))
        return None if module is None else _weight_rows(module, self.arch.conv1d)

    def up_bias(self, layer: int) -> Float[torch.Tensor, "d_m"] | None:
        """Bias of U for gated layers that have one, else None."""
        module = self.arch.up_proj(self._check_layer(layer))
        return None if module is None else module.bias

    def values(self, layer: int) -> Float[torch.Tensor, "d_m d_model"]:
        """V of a layer: row i is value v_i."""
        down = self.arch.down_proj(self._check_layer(layer))
        return down.weight if self.arch.conv1d else down.weight.T

    def value_bias(self, layer: int) -> Float[torch.Tensor, "d_model"] | None:
        """b_V of a layer, or None. Not a memory."""
        return self.arch.down_proj(self._check_layer(layer)).bias

    def activation(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The FF nonlinearity f of a layer."""
        return self.arch.activation(self.model, self._check_layer(layer))

    @property
    def unembedding(self) -> Float[torch.Tensor, "vocab d_model"]:
        """E: the output embedding (the LM head, tied or not)."""
        return self.arch.unembed(self.model).weight

    @property
    def unembedding_bias(self) -> Float[torch.Tensor, "vocab"] | None:
        """The LM head's bias where the model has one (added to every projection)."""
        head = self.arch.unembed(self.model)
        return getattr(head, "bias", None)

    @property
    def vocab_size(self) -> int:
        """|V|, the number of rows of E."""
        return self.unembedding.shape[0]

    def final_norm(self, h: Float[torch.Tensor, "*batch d_model"]) -> Float[torch.Tensor, "*batch d_model"]:
        """N(h): the model's final normalization (identity where it has none)."""
        norm = self.arch.final_norm(self.model)
        return h if norm is None else norm(h)

    @torch.no_grad()
    def final_logits(self, head_in: Float[torch.Tensor, "*batch d_model"]) -> Float[torch.Tensor, "*batch vocab"]:
        """The model's own output logits for captured ``head_in`` vectors (the LM head, bias included)."""
        return self.arch.unembed(self.model)(head_in.to(self.unembedding.dtype)).float()

    # ---------------------------------------------------------------- forward
    @property
    def device(self) -> torch.device:
        return self.unembedding.device

    def forward(self, input_ids: Int[torch.Tensor, "batch pos"],
                attention_mask: Int[torch.Tensor, "batch pos"] | None = None, with_head: bool = False) -> None:
        """Run the blocks on a batch; hooks of an open `capture` fire.

        Args:
            with_head: run the whole model, LM head included (for hooks on the head);
                by default only the blocks run.

        A `StopForward` raised by a hook (e.g. `capture(stop_early=True)`) ends the pass early.
        """
        module = self.model if with_head else self.arch.base(self.model)
        self._shape = (int(input_ids.shape[0]), int(input_ids.shape[1]))
        self._running = True
        try:
            with torch.no_grad():
                module(input_ids=input_ids, attention_mask=attention_mask)
        except StopForward:
            pass
        finally:
            self._running = False

    def _as_batch(self, t: torch.Tensor) -> torch.Tensor:
        # Some families (OPT) flatten (batch, pos) before the FF layer.
        if t.dim() == 2 and self._shape is not None:
            return t.reshape(self._shape[0], self._shape[1], -1)
        return t

    @contextmanager
    def capture(
        self,
        quantities: Iterable[str] = ("coefficients",),
        layers: Iterable[int] | None = None,
        sink: Sink | None = None,
        stop_early: bool = False,
    ) -> Iterator[Capture]:
        """Capture the named quantities of the given layers during forward passes.

        Args:
            quantities: any of `QUANTITIES`.
            layers: which layers (default all).
            sink: if given, called as sink(quantity, layer, tensor) for each capture
                instead of storing it, so a consumer can reduce it at once. A sink may
                overwrite a ``coefficients`` tensor in place: the model is done with it.
            stop_early: end `forward` as soon as the highest requested layer has given what is
                asked of it: before its down-projection runs when only its coefficients (or
                quantities before them) are asked for, after it otherwise. Ignored with ``head_in``.

        Yields:
            A `Capture` filled as forward passes run (empty when a sink is given);
            ``head_in`` is stored under layer -1.
        """
        quantities = tuple(quantities)
        unknown = [q for q in quantities if q not in QUANTITIES]
        if unknown:
            raise FfkvError(f"unknown quantity {unknown[0]!r}; choose from {', '.join(QUANTITIES)}")
        layers = list(range(self.n_layers)) if layers is None else sorted(set(layers))
        for layer in layers:
            self._check_layer(layer)
        store = Capture({q: {} for q in quantities})
        handles = []
        need_mid = "resid_mid" in quantities or "resid_post" in quantities
        need_out = "ff_out" in quantities or "resid_post" in quantities
        pending: dict[int, dict[str, torch.Tensor]] = {}

        def emit(name: str, layer: int, t: torch.Tensor) -> None:
            if name not in quantities:
                return
            if sink is not None:
                sink(name, layer, t)
            else:
                store[name][layer] = t

        def on_pair(layer: int) -> None:
            parts = pending.get(layer, {})
            if "resid_mid" in parts and "ff_out" in parts:
                emit("resid_post", layer, parts["resid_mid"] + parts["ff_out"])
                pending.pop(layer)

        stop = stop_early and bool(layers) and "head_in" not in quantities
        # The last requested layer's down-projection need not run when nothing asked for needs its output.
        stop_before_down = stop and not need_out

        for layer in layers:
            block = self.blocks[layer]
            down = self.arch.down_proj(block)

            if "coefficients" in quantities:
                def on_m(mod, args, *_, layer=layer):
                    emit("coefficients", layer, self._as_batch(args[0]))
                if stop_before_down and layer == layers[-1]:  # the pass ends before the down-projection
                    handles.append(down.register_forward_pre_hook(on_m))
                else:  # read after the second matrix has consumed m, so a sink may reuse the tensor in place
                    handles.append(down.register_forward_hook(on_m))
            if "ff_in" in quantities:
                handles.append(self.arch.key_proj(block).register_forward_pre_hook(
                    lambda mod, args, layer=layer: emit("ff_in", layer, self._as_batch(args[0]))))
            if need_out:
                def on_out(mod, args, out, layer=layer):
                    t = self._as_batch(_first(out))
                    emit("ff_out", layer, t)
                    if "resid_post" in quantities:
                        pending.setdefault(layer, {})["ff_out"] = t
                        on_pair(layer)
                handles.append(down.register_forward_hook(on_out))
            if need_mid:
                handles.extend(self._hook_resid_mid(block, layer, emit, pending, on_pair, quantities))

        if "head_in" in quantities:
            def head_pre(mod, args):
                if self._running:  # not a consumer's own call of the head (`final_logits`)
                    emit("head_in", -1, self._as_batch(args[0]))
                    raise StopForward
            handles.append(self.arch.unembed(self.model).register_forward_pre_hook(head_pre))

        if stop:  # registered last, so it runs after the last layer's other hooks on the same module
            def stop_forward(*_):
                raise StopForward
            last_down = self.arch.down_proj(self.blocks[layers[-1]])
            register = last_down.register_forward_pre_hook if stop_before_down else last_down.register_forward_hook
            handles.append(register(stop_forward))
        try:
            yield store
        finally:
            for h in handles:
                h.remove()

    def _hook_resid_mid(self, block, layer, emit, pending, on_pair, quantities):
        def deliver(t: torch.Tensor) -> None:
            t = self._as_batch(t)
            emit("resid_mid", layer, t)
            if "resid_post" in quantities:
                pending.setdefault(layer, {})["resid_mid"] = t
                on_pair(layer)

        site = self.arch.resid_mid_site(block)
        if site is not None:
            module, index = site

            def pre(mod, args, kwargs):
                if len(args) > index:
                    deliver(args[index])
                else:
                    deliver(list(kwargs.values())[index - len(args)])
            return [module.register_forward_pre_hook(pre, with_kwargs=True)]

        # Parallel block: resid_mid = resid_pre + attn_out.
        resid_pre: dict[str, torch.Tensor] = {}

        def block_pre(mod, args, kwargs):
            resid_pre["t"] = args[0] if args else kwargs["hidden_states"]

        def attn_out(mod, args, out):
            deliver(resid_pre.pop("t") + _first(out))

        return [
            block.register_forward_pre_hook(block_pre, with_kwargs=True),
            self.arch.attention(block).register_forward_hook(attn_out),
        ]
