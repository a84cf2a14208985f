"""A dictionary as one plain ``.npz`` file (read with ``numpy.load(allow_pickle=False)``): ffkv's own
arrays, or Gemma Scope's ``params.npz``.

ffkv's arrays (what `save_npz` writes):

    encoder (n_latents, d_model)   encoder_bias (n_latents,)   decoder (n_latents, d_model)   decoder_bias (d_model,)
    threshold (n_latents,)  skip (d_model, d_model)  input_bias (d_model,)      where the dictionary has them
    kind, activation, dtype (0-d strings)   layer, k (0-d integers; k for topk)   hookpoint (0-d string, optional)

``dtype`` is the tensors' torch dtype ("bfloat16" is stored as float32, which holds it exactly, and cast
back). Gemma Scope's arrays: ``W_enc`` (d_model, n_latents), ``b_enc``, ``W_dec`` (n_latents, d_model),
``b_dec``, ``threshold``: a JumpReLU dictionary with no input bias, whose kind and layer the file does not
say, so the caller does (``kind=`` and ``hookpoint=`` or ``layer=``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ffkv.dictionaries.dictionary import Dictionary
from ffkv.dictionaries.files import about, provenance, read_npz, tensors_of
from ffkv.dictionaries.hookpoints import sites
from ffkv.errors import FfkvError
from ffkv.store.atomic import atomic_path

_TENSORS = ("encoder", "encoder_bias", "decoder", "decoder_bias")
_OPTIONAL = ("threshold", "skip", "input_bias")
_GEMMA_SCOPE = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float64", "float16", "bfloat16")}


def read_npz_dictionary(path: Path, *, kind: str | None = None, layer: int | None = None,
                        hookpoint: str | None = None) -> Dictionary:
    """The dictionary in one ``.npz`` file; `kind`, `layer` and `hookpoint` say what the file does not (and
    must agree with what it does say)."""
    arrays = read_npz(path)
    if "encoder" not in arrays and set(_GEMMA_SCOPE) <= set(arrays):
        t = tensors_of(path, arrays, _GEMMA_SCOPE)
        t = {"encoder": t["W_enc"].T.contiguous(), "encoder_bias": t["b_enc"], "decoder": t["W_dec"],
             "decoder_bias": t["b_dec"], "threshold": t["threshold"]}
        said = {"activation": "jumprelu", "k": None}
        architecture = "gemma scope jumprelu"
    else:
        t = tensors_of(path, arrays, _TENSORS, _OPTIONAL)
        said = {name: _scalar(path, arrays, name, kind_of) for name, kind_of in
                (("kind", "U"), ("layer", "iu"), ("activation", "U"), ("k", "iu"), ("hookpoint", "U"), ("dtype", "U"))}
        if said["dtype"] is not None:
            if said["dtype"] not in _DTYPES:
                raise FfkvError(f"{path}: dtype {said['dtype']!r}, expected one of {', '.join(_DTYPES)}")
            t = {name: tensor.to(_DTYPES[said["dtype"]]) for name, tensor in t.items()}
        architecture = f"{said['activation']} {said['kind']}"
    kind = _agreed(path, "kind", kind, said.get("kind"))
    hookpoint = _agreed(path, "hookpoint", hookpoint, said.get("hookpoint"))
    layer = _agreed(path, "layer", layer, said.get("layer"))
    if kind is None or (hookpoint is None and layer is None):
        raise FfkvError(f"{path}: the file does not say which FF layer it is for: pass kind= ('transcoder' or 'sae') "
                        f"and hookpoint= or layer=")
    with about(path):
        at, reads, writes = sites(kind, hookpoint or f"layers.{layer}.mlp")
        if layer is not None and layer != at:
            raise FfkvError(f"layer {layer} but hookpoint {hookpoint!r} is layer {at}")
        return Dictionary(kind=kind, layer=at, activation=said["activation"], k=said["k"], **t,
                          source=provenance(path, "npz", [path], architecture=architecture, hookpoint=hookpoint,
                                            reads=reads, writes=writes))


def save_npz(dictionary: Dictionary, path: str | Path) -> Path:
    """Write `dictionary` as one ``.npz`` file of ffkv's arrays (atomically), which `read_npz_dictionary`
    reads back bit for bit."""
    d, path = dictionary, Path(path)
    stored = torch.float32 if d.dtype == torch.bfloat16 else d.dtype
    arrays: dict[str, Any] = {name: getattr(d, name).detach().to("cpu", stored).numpy()
                              for name in (*_TENSORS, *_OPTIONAL) if getattr(d, name) is not None}
    arrays.update(kind=np.array(d.kind), layer=np.array(d.layer), activation=np.array(d.activation),
                  dtype=np.array(str(d.dtype).removeprefix("torch.")))
    if d.k is not None:
        arrays["k"] = np.array(d.k)
    if d.source.get("hookpoint"):
        arrays["hookpoint"] = np.array(d.source["hookpoint"])
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    return path


def _scalar(path: Path, arrays: dict[str, np.ndarray], name: str, kinds: str) -> Any:
    """A 0-d array's value (None if absent), refused unless of the expected kind ("U" string, "iu" integer)."""
    if name not in arrays:
        return None
    value = arrays[name]
    if value.ndim != 0 or value.dtype.kind not in kinds:
        raise FfkvError(f"{path}: {name!r} is a {value.dtype} array of shape {value.shape}, expected a single "
                        f"{'string' if kinds == 'U' else 'integer'}")
    return value.item()


def _agreed(path: Path, name: str, given: Any, said: Any) -> Any:
    if given is not None and said is not None and given != said:
        raise FfkvError(f"{path}: the file says {name} {said!r}, but {given!r} was passed")
    return given if given is not None else said
