"""Random key directions: the control that every key-side finding is set beside (docs/definitions.md, Controls).

A finding about trained keys ("its trigger examples share a topic", "its value predicts its trigger's
next token") means something only if a key with no training behind it does not show it as often. Any
linear read-out of the residual picks trigger examples that share words, so the control is a set of
memories of the layer's own shape whose key direction alone is random:

- per layer, `n` control memories; memory j borrows a real memory ``source[j]`` of the layer (drawn
  uniformly with replacement, seeded) and keeps its key norm ‖k_source‖ and key bias, for gated layers
  also the norm and bias of its up row, and its value v_source (so that Figures 4-5 have a value to read);
- its key direction (and up direction, for gated layers) is an isotropic Gaussian draw, scaled to the
  borrowed norm;
- its coefficient at an FF input x is the layer's own function: m_j = f(x·r_j + b_j), or
  act(x·g_j + b_j)·(x·u_j + c_j) for gated layers.

The draws use a CPU generator seeded with (seed, layer), in float32, then move to the model's device
and dtype: the same control on every machine, for every batch size and shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Int

from ffkv.memories.view import MemoryView

#: Control memories per layer when `ffkv index` is not told otherwise (`--control-keys`). A few hundred
#: place the 95th percentile of a layer's control distribution to within a few percentiles.
DEFAULT_CONTROL_KEYS = 256


def layer_generator(seed: int, layer: int, salt: int = 17) -> torch.Generator:
    """A CPU generator seeded by (seed, layer) alone; `salt` keeps different draws of one seed apart (17: the
    control keys; other draws name their own)."""
    return torch.Generator(device="cpu").manual_seed(int(seed) * 1_000_003 + 7_919 * int(layer) + int(salt))


def _directions(n: int, d: int, norms: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    g = torch.randn(n, d, generator=gen, dtype=torch.float32)
    return g / g.norm(dim=1, keepdim=True).clamp_min(1e-12) * norms[:, None]


@dataclass
class ControlLayer:
    """The control memories of one layer.

    Attributes:
        source: (n,) the real memory each control memory borrows its norms, biases and value from.
        keys: (n, d) random key (gate) rows with the source keys' norms.
        bias: (n,) the source keys' biases, or None.
        up: (n, d) random up rows with the source up rows' norms (gated layers), else None.
        up_bias: (n,) the source up biases, or None.
    """

    source: Int[torch.Tensor, "n"]
    keys: Float[torch.Tensor, "n d_model"]
    bias: Float[torch.Tensor, "n"] | None
    up: Float[torch.Tensor, "n d_model"] | None
    up_bias: Float[torch.Tensor, "n"] | None


class RandomKeys:
    """Seeded random control memories of every layer of a model (see the module docstring).

    Args:
        view: the model's memory view (its keys, biases, activations and device).
        n: control memories per layer (at least 1).
        seed: the control's seed (recorded in the run's identity).
    """

    def __init__(self, view: MemoryView, n: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError("a control needs at least one memory per layer")
        self.view, self.n, self.seed = view, int(n), int(seed)
        self.layers = [self._draw(layer) for layer in range(view.n_layers)]

    def _draw(self, layer: int) -> ControlLayer:
        view = self.view
        gen = layer_generator(self.seed, layer)
        keys = view.keys(layer).detach()
        source = torch.randint(0, keys.shape[0], (self.n,), generator=gen)
        dtype, device = keys.dtype, keys.device
        place = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731

        def borrowed(bias: torch.Tensor | None) -> torch.Tensor | None:
            return None if bias is None else bias.detach()[source.to(bias.device)].to(dtype)

        key_norms = keys.float().norm(dim=1).cpu()[source]
        random_keys = place(_directions(self.n, keys.shape[1], key_norms, gen))
        up = view.up(layer)
        random_up = None
        if up is not None:
            up_norms = up.detach().float().norm(dim=1).cpu()[source]
            random_up = place(_directions(self.n, up.shape[1], up_norms, gen))
        return ControlLayer(source=source, keys=random_keys, bias=borrowed(view.key_bias(layer)),
                            up=random_up, up_bias=borrowed(view.up_bias(layer)))

    @torch.no_grad()
    def coefficients(self, layer: int, x: Float[torch.Tensor, "*batch d_model"]) -> Float[torch.Tensor, "*batch n"]:
        """The control memories' coefficients at FF inputs x (the layer's own activation and gating)."""
        c = self.layers[layer]
        z = torch.nn.functional.linear(x, c.keys, c.bias)
        m = self.view.activation(layer)(z)
        if c.up is not None:
            m = m * torch.nn.functional.linear(x, c.up, c.up_bias)
        return m

    def source(self, layer: int) -> Int[torch.Tensor, "n"]:
        """The real memory whose norms, biases and value control memory j of `layer` borrows."""
        return self.layers[layer].source


__all__ = ["DEFAULT_CONTROL_KEYS", "ControlLayer", "RandomKeys", "layer_generator"]
