"""A sparse dictionary's latents as keys of the index, and their random control latents (docs/definitions.md).

`ffkv index --dictionary PATH` reduces, in the pass that reduces the model's keys, every latent of every layer
the dictionary covers: latent j's coefficient is its activation a_j (`ffkv.dictionaries.Dictionary`), computed
from the site its key reads (a transcoder's: the FF input after its norm; an SAE's: the FF output). A TopK
dictionary's k active latents per position are reduced as they are (`SparseCoefficients`, reduced by `ffkv.indexing.sparse`), never as a dense
(B, T, n_latents) tensor; ReLU and JumpReLU activations are dense.

Every activation ffkv reads (TopK, ReLU, JumpReLU) is a ReLU of the pre-activation, never negative, so latents
keep one direction (`DIRECTIONS`); and a latent's trigger is an example where it fires (a_j > 0), so the
latent tables keep only positive entries: a dead latent has none (docs/definitions.md, "Sparse dictionaries").

The control (docs/definitions.md): per dictionary layer, `n` control latents; control latent c borrows a real
latent ``source[c]`` (drawn uniformly with replacement, seeded) and keeps its encoder row's norm, its encoder
bias and (JumpReLU) its threshold, with an isotropic Gaussian direction. It is read as one more latent of the
dictionary, judged alone against the real ones: ReLU relu(pre_c); JumpReLU relu(pre_c)·[pre_c > θ_source];
TopK relu(pre_c) where pre_c beats the k-th largest real pre-activation at that position (where it would enter
the dictionary's top k, a tie going to the real latent, the lower index), else 0. So a control latent fires
about as often as a real latent with that norm and bias would, and no control depends on how many were drawn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int

from ffkv.dictionaries import Dictionary
from ffkv.memories.controls import layer_generator
from ffkv.memories.sets import READS

@dataclass(frozen=True)
class SparseCoefficients:
    """The coefficients of `n_keys` keys of which only a few are non-zero at each position.

    Attributes:
        values: (B, T, k) the active coefficients, never negative (a TopK dictionary's relu of its k largest
            pre-activations; a zero among them is a key that did not fire).
        indices: (B, T, k) int64 the key of each, distinct within a position.
        n_keys: the number of keys; every key not in `indices` at a position has coefficient 0 there.
    """

    values: Float[torch.Tensor, "batch pos k"]
    indices: Int[torch.Tensor, "batch pos k"]
    n_keys: int

    def dense(self) -> Float[torch.Tensor, "batch pos n_keys"]:
        """The (B, T, n_keys) coefficients, zeros outside the active entries."""
        shape = (*self.values.shape[:-1], self.n_keys)
        return self.values.new_zeros(shape).scatter_(-1, self.indices, self.values)



#: The trigger directions a latent keeps: +1 only, every activation ffkv reads being a ReLU at heart.
DIRECTIONS = (1,)
#: What the latent control's draws add to a seed (`layer_generator`), apart from the control keys' 17.
LATENT_SALT = 29


@dataclass
class ControlLatents:
    """The control latents of one dictionary layer.

    Attributes:
        source: (n,) the real latent each borrows its norm, bias and threshold from.
        encoder: (n, d_model) random rows with the source rows' norms.
        encoder_bias: (n,) the source latents' biases.
        threshold: (n,) the source latents' thresholds (JumpReLU), else None.
    """

    source: Int[torch.Tensor, "n"]
    encoder: Float[torch.Tensor, "n d_model"]
    encoder_bias: Float[torch.Tensor, "n"]
    threshold: Float[torch.Tensor, "n"] | None


class LatentKeys:
    """A model's dictionaries on its device, with their control latents (see the module docstring).

    Args:
        dictionaries: FF layer -> its dictionary (`ffkv.dictionaries.open_dictionary`), checked against the model.
        n_control: control latents per dictionary layer (0: none).
        seed: the control's seed.
        device: where the model runs; each dictionary computes there, in its own dtype.
    """

    def __init__(self, dictionaries: Mapping[int, Dictionary], n_control: int, seed: int,
                 device: torch.device | str) -> None:
        self.dictionaries = {layer: d.to(device) for layer, d in sorted(dictionaries.items())}
        self.n_control, self.seed = int(n_control), int(seed)
        self.controls = {layer: self._draw(d) for layer, d in self.dictionaries.items()} if n_control else {}

    @property
    def layers(self) -> list[int]:
        return list(self.dictionaries)

    def reads(self, layer: int) -> str:
        """The captured quantity the layer's latents read."""
        return READS[self.dictionaries[layer].kind]

    def _draw(self, d: Dictionary) -> ControlLatents:
        gen = layer_generator(self.seed, d.layer, salt=LATENT_SALT)
        source = torch.randint(0, d.n_latents, (self.n_control,), generator=gen)
        norms = d.encoder.detach().float().norm(dim=1).cpu()[source]
        g = torch.randn(self.n_control, d.d_model, generator=gen, dtype=torch.float32)
        rows = g / g.norm(dim=1, keepdim=True).clamp_min(1e-12) * norms[:, None]
        on_device = source.to(d.device)
        threshold = None if d.threshold is None else d.threshold[on_device].clone()
        return ControlLatents(source=source, encoder=rows.to(device=d.device, dtype=d.dtype),
                              encoder_bias=d.encoder_bias[on_device].clone(), threshold=threshold)

    @torch.no_grad()
    def coefficients(self, layer: int, x: Float[torch.Tensor, "*batch d_model"]
                     ) -> tuple[torch.Tensor | SparseCoefficients, ...]:
        """The latents' activations at x (exactly `Dictionary.encode`; a TopK dictionary's as `SparseCoefficients`,
        its k active latents per position), and the control latents' (if drawn), dense."""
        d = self.dictionaries[layer]
        pre = d.pre_activations(x)
        latents: torch.Tensor | SparseCoefficients
        if d.activation == "topk":  # only k latents per position can be non-zero: kept sparse
            values, indices = pre.topk(int(d.k), dim=-1, sorted=False)
            latents = SparseCoefficients(torch.relu(values), indices, d.n_latents)
            kth = values.amin(dim=-1, keepdim=True)  # the k-th largest real pre-activation
        else:
            latents = torch.relu(pre)
            if d.activation == "jumprelu":
                latents = latents * (pre > d.threshold)
        if not self.n_control:
            return (latents,)
        c = self.controls[layer]
        xin = x.to(d.dtype)
        if d.input_bias is not None:
            xin = xin - d.input_bias
        pre_c = torch.nn.functional.linear(xin, c.encoder, c.encoder_bias)
        control = torch.relu(pre_c)
        if d.activation == "topk":
            control = control * (pre_c > kth)
        elif d.activation == "jumprelu":
            control = control * (pre_c > c.threshold)
        return latents, control

    def source(self, layer: int) -> Int[torch.Tensor, "n"]:
        """The real latent whose norm, bias and threshold control latent c of `layer` borrows."""
        return self.controls[layer].source

    def identity(self) -> dict[str, Any]:
        """What the run's identity records of the dictionaries: their content (files' sha256, architecture,
        hookpoint, sites), not where they lie, so a copy elsewhere resumes and another dictionary is refused."""
        out = {}
        for layer, d in self.dictionaries.items():
            content = {k: v for k, v in d.source.items() if k != "path"}
            if "sha256" not in content:  # built in memory, not read from files: its weights are its identity
                content["weights_sha256"] = weights_sha256(d)
            out[str(layer)] = {**content, "kind": d.kind, "n_latents": d.n_latents}
        return json.loads(json.dumps(out))  # as a manifest reads it back (lists, not tuples)

    def described(self) -> dict[str, Any]:
        """What the manifest records of the dictionaries: each layer's `source`, its path included."""
        return json.loads(json.dumps({str(layer): {**d.source, "kind": d.kind, "n_latents": d.n_latents,
                                                   "activation": d.activation, "k": d.k}
                                      for layer, d in self.dictionaries.items()}))


def weights_sha256(d: Dictionary) -> str:
    """The sha256 of a dictionary's tensors and settings (for one built in memory, with no files to name it)."""
    digest = hashlib.sha256(f"{d.kind} {d.layer} {d.activation} {d.k}".encode())
    for t in (d.encoder, d.encoder_bias, d.decoder, d.decoder_bias, d.threshold, d.skip, d.input_bias):
        if t is not None:
            digest.update(str(t.dtype).encode())
            digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


__all__ = ["DIRECTIONS", "LATENT_SALT", "READS", "ControlLatents", "LatentKeys", "weights_sha256"]
