"""`Dictionary`: one layer's sparse dictionary (a transcoder or an SAE) read as key-value memories.

A sparse dictionary is a second set of memories for a feed-forward layer: latent i has a key (encoder row
i, with its bias) that its coefficient reads, and a value (decoder row i) that it writes. Its coefficient
is the library's own activation of the key's pre-activation:

    pre_i(x) = (x - input_bias) · encoder[i] + encoder_bias[i]
    a_i(x)   = relu(pre_i)                          "relu"
             = relu(pre_i) · [pre_i > threshold_i]  "jumprelu"
             = relu(pre_i) if i is among the k largest pre_j, else 0   "topk"
    out(x)   = Σ_i a_i(x) · decoder[i] + decoder_bias (+ x · skipᵀ for a skip transcoder)

which is what EleutherAI's sparsify and SAELens compute for the dictionaries `ffkv.dictionaries.layouts`
reads (ties in top-k aside: both libraries break them as `torch.topk` does, and so does ffkv).

`kind` says where the key reads and the value writes (docs/definitions.md, "Sparse dictionaries"):
a "transcoder" reads the FF input after its norm and writes the FF output; an "sae" reads and writes the
FF output, so its keys are directions in the FF output, not keys into the FF input.

A model's dictionaries are a plain ``dict[int, Dictionary]`` keyed by the 0-based FF layer (what
`open_dictionary` returns); `check_against` checks either against a model's layer count and width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from jaxtyping import Float, Int

from ffkv.errors import FfkvError

KINDS = ("transcoder", "sae")
ACTIVATIONS = ("topk", "relu", "jumprelu")


@dataclass(frozen=True, eq=False)
class Dictionary:
    """One layer's sparse dictionary read as key-value memories: latent i has key encoder[i] and value decoder[i].

    Attributes:
        kind: "transcoder" (FF input after its norm -> FF output) or "sae" (FF output -> FF output).
        layer: the 0-based FF layer.
        encoder: (n_latents, d_model) the keys, one row per latent.
        encoder_bias: (n_latents,) the keys' biases.
        decoder: (n_latents, d_model) the values, one row per latent.
        decoder_bias: (d_model,) added to every reconstruction.
        activation: "topk", "relu" or "jumprelu".
        k: the number of latents a "topk" dictionary keeps per position (None otherwise).
        threshold: (n_latents,) a "jumprelu" dictionary's thresholds (None otherwise).
        skip: (d_model, d_model) a skip transcoder's linear path: the output adds x · skipᵀ.
        input_bias: (d_model,) subtracted from the input before the encoder (SAEs whose b_dec is applied to
            the input: sparsify's SAEs, SAELens's ``apply_b_dec_to_input``).
        source: what the manifest records: path, layout, sha256 of each file, architecture, hookpoint, and
            which site the keys read and the values write.

    Tensors keep the file's dtype and device; inputs are cast to the encoder's dtype, as the libraries do.
    Shapes are checked at construction (an `FfkvError` says which field is wrong).
    """

    kind: str
    layer: int
    encoder: Float[torch.Tensor, "n_latents d_model"]
    encoder_bias: Float[torch.Tensor, "n_latents"]
    decoder: Float[torch.Tensor, "n_latents d_model"]
    decoder_bias: Float[torch.Tensor, "d_model"]
    activation: str
    k: int | None = None
    threshold: Float[torch.Tensor, "n_latents"] | None = None
    skip: Float[torch.Tensor, "d_model d_model"] | None = None
    input_bias: Float[torch.Tensor, "d_model"] | None = None
    source: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            where = self.source.get("path")
            raise FfkvError(f"{where}: {problem}" if where else f"Dictionary: {problem}")

    @property
    def n_latents(self) -> int:
        return int(self.encoder.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.encoder.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.dtype

    @property
    def device(self) -> torch.device:
        return self.encoder.device

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Dictionary:
        """The same dictionary with every tensor on `device` and (floating) in `dtype`."""
        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)
        return replace(self, encoder=moved(self.encoder), encoder_bias=moved(self.encoder_bias),
                       decoder=moved(self.decoder), decoder_bias=moved(self.decoder_bias),
                       threshold=moved(self.threshold), skip=moved(self.skip), input_bias=moved(self.input_bias))

    def pre_activations(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_latents"]:
        """pre_i(x) = (x - input_bias) · encoder[i] + encoder_bias[i], for every latent."""
        x = x.to(self.encoder.dtype)
        if self.input_bias is not None:
            x = x - self.input_bias
        return torch.nn.functional.linear(x, self.encoder, self.encoder_bias)

    def encode(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... n_latents"]:
        """The latents' activations, dense: exactly the library's (zeros outside the top k for "topk")."""
        pre = self.pre_activations(x)
        if self.activation == "topk":
            values, indices = _top(pre, self.k)
            return torch.zeros_like(pre).scatter_(-1, indices, values)
        acts = torch.relu(pre)
        if self.activation == "jumprelu":
            acts = acts * (pre > self.threshold)
        return acts

    def encode_sparse(self, x: Float[torch.Tensor, "... d_model"], k: int | None = None
                      ) -> tuple[Float[torch.Tensor, "... k"], Int[torch.Tensor, "... k"]]:
        """The k largest activations and their latents, without a dense activation tensor.

        For "topk" `k` defaults to the dictionary's own k (and may not exceed it); "relu" and "jumprelu"
        dictionaries have no fixed k, so `k` must be given: positions with fewer active latents then carry
        zeros (at some inactive latent) in their last places.
        """
        k = self._sparse_k(k)
        pre = self.pre_activations(x)
        if self.activation == "topk":
            return _top(pre, k)
        if self.activation == "jumprelu":
            pre = pre.masked_fill(pre <= self.threshold, 0.0)
        return _top(pre, k)

    def decode(self, activations: Float[torch.Tensor, "... n_latents"],
               x: Float[torch.Tensor, "... d_model"] | None = None) -> Float[torch.Tensor, "... d_model"]:
        """activations · decoder + decoder_bias, plus x · skipᵀ for a skip transcoder (which needs `x`)."""
        out = activations.to(self.decoder.dtype) @ self.decoder + self.decoder_bias
        return self._skipped(out, x)

    def decode_sparse(self, values: Float[torch.Tensor, "... k"], indices: Int[torch.Tensor, "... k"],
                      x: Float[torch.Tensor, "... d_model"] | None = None) -> Float[torch.Tensor, "... d_model"]:
        """`decode` of the activations `encode_sparse` returns, without a dense activation tensor."""
        rows = self.decoder[indices]                                       # (..., k, d_model)
        out = (values.to(self.decoder.dtype).unsqueeze(-2) @ rows).squeeze(-2) + self.decoder_bias
        return self._skipped(out, x)

    def __call__(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        """The reconstruction: decode(encode(x), x)."""
        return self.decode(self.encode(x), x)

    def __repr__(self) -> str:
        extra = f", k={self.k}" if self.k is not None else ""
        return (f"Dictionary({self.kind}, layer={self.layer}, {self.n_latents} latents x d_model {self.d_model}, "
                f"{self.activation}{extra}{', skip' if self.skip is not None else ''}, {self.dtype})")

    def _skipped(self, out: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        if self.skip is None:
            return out
        if x is None:
            raise FfkvError("this skip transcoder's output adds x · skipᵀ: pass the input as decode(..., x=x)")
        return out + x.to(self.skip.dtype) @ self.skip.T

    def _sparse_k(self, k: int | None) -> int:
        if self.activation == "topk":
            assert self.k is not None
            if k is not None and not 0 < k <= self.k:
                raise FfkvError(f"encode_sparse: k must be in 1..{self.k} (this top-k dictionary keeps {self.k})")
            return self.k if k is None else k
        if k is None or not 0 < k <= self.n_latents:
            raise FfkvError(f"encode_sparse: a {self.activation} dictionary has no fixed k: pass k= in "
                            f"1..{self.n_latents}")
        return k


def _top(pre: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest pre-activations and their indices, through relu (sparsify and SAELens both keep
    relu of the top k: relu before or after the selection gives the same values)."""
    values, indices = pre.topk(int(k or 0), dim=-1, sorted=False)
    return torch.relu(values), indices


def shapes(n_latents: int, d_model: int) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor a dictionary of `n_latents` latents and width `d_model` may have (by field)."""
    n, dm = n_latents, d_model
    return {"encoder": (n, dm), "encoder_bias": (n,), "decoder": (n, dm), "decoder_bias": (dm,), "threshold": (n,),
            "skip": (dm, dm), "input_bias": (dm,)}


def _problem(d: Dictionary) -> str | None:
    """What is wrong with a dictionary's fields, in words, or None."""
    if d.kind not in KINDS:
        return f"kind is {d.kind!r}, expected one of {', '.join(KINDS)}"
    if d.activation not in ACTIVATIONS:
        return f"activation is {d.activation!r}, expected one of {', '.join(ACTIVATIONS)}"
    if not isinstance(d.layer, int) or isinstance(d.layer, bool) or d.layer < 0:
        return f"layer is {d.layer!r}, expected a 0-based layer number"
    if d.encoder.ndim != 2:
        return f"encoder has shape {tuple(d.encoder.shape)}, expected (n_latents, d_model)"
    n, dm = d.encoder.shape
    expected = {name: shape for name, shape in shapes(n, dm).items() if name != "encoder"}
    for name, shape in expected.items():
        t = getattr(d, name)
        if t is not None and tuple(t.shape) != shape:
            return f"{name} has shape {tuple(t.shape)}, expected {shape} (n_latents {n}, d_model {dm})"
    for name in ("encoder", *expected):
        t = getattr(d, name)
        if t is not None and not t.is_floating_point():
            return f"{name} is {t.dtype}, expected a floating-point tensor"
    if d.activation == "topk" and (not isinstance(d.k, int) or not 0 < d.k <= n):
        return f"a topk dictionary needs k in 1..n_latents ({n}), got {d.k!r}"
    if d.activation != "topk" and d.k is not None:
        return f"k={d.k} is only for a topk dictionary (this one is {d.activation})"
    if (d.activation == "jumprelu") != (d.threshold is not None):
        return "a jumprelu dictionary needs a threshold, and only a jumprelu dictionary has one"
    if d.kind == "sae" and d.skip is not None:
        return "a skip connection is a transcoder's (an sae has none)"
    return None


def check_against(dictionaries: Dictionary | Mapping[int, Dictionary], n_layers: int, d_model: int) -> None:
    """Refuse (`FfkvError`, one line naming the file) a dictionary that does not fit a model with `n_layers`
    FF layers of width `d_model`: a layer past the last, another width, or a mapping whose key is not the
    dictionary's own layer."""
    items = dictionaries.items() if isinstance(dictionaries, Mapping) else [(dictionaries.layer, dictionaries)]
    for layer, d in items:
        where = d.source.get("path") or f"the layer-{d.layer} dictionary"
        if layer != d.layer:
            raise FfkvError(f"{where}: filed under layer {layer} but is layer {d.layer}'s dictionary")
        if not 0 <= d.layer < n_layers:
            raise FfkvError(f"{where}: is for FF layer {d.layer} ({d.source.get('hookpoint', 'its hookpoint')}), "
                            f"but the model has {n_layers} layers (0..{n_layers - 1}): was it trained on "
                            f"another model?")
        if d.d_model != d_model:
            raise FfkvError(f"{where}: reads vectors of width {d.d_model}, but the model's d_model is {d_model}: "
                            f"was it trained on another model?")
