"""A dictionary as one plain ``.npz`` file (numpy's ``.npy`` arrays in a zip, read without pickles): ffkv's
own arrays, or Gemma Scope's ``params.npz``.

ffkv's arrays (what `save_npz` writes):

    encoder (n_latents, d_model)   encoder_bias (n_latents,)   decoder (n_latents, d_model)   decoder_bias (d_model,)
    threshold (n_latents,)  skip (d_model, d_model)  input_bias (d_model,)      where the dictionary has them
    kind, activation, dtype (0-d strings)   layer, k (0-d integers; k for topk)   hookpoint (0-d string, optional)

``dtype`` is the tensors' torch dtype ("bfloat16" is stored as float32, which holds it exactly, and cast
back). Gemma Scope's arrays: ``W_enc`` (d_model, n_latents), ``b_enc``, ``W_dec`` (n_latents, d_model),
``b_dec``, ``threshold``: a JumpReLU dictionary with no input bias, whose kind and layer the file does not
say, so the caller does (``kind=`` and ``hookpoint=`` or ``layer=``).

Only these arrays are read, and only after every one's header is checked against the others (the shapes of
one dictionary, floating point; the scalars 0-d and small): an array the layout does not name, or one whose
header does not fit, is never decompressed (`ffkv.dictionaries.files.Npz`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ffkv.dictionaries.dictionary import Dictionary, shapes
from ffkv.dictionaries.files import NpyHeader, about, open_npz, provenance, require, tensors_of
from ffkv.dictionaries.hookpoints import sites
from ffkv.errors import FfkvError
from ffkv.store.atomic import atomic_path
from ffkv.store.untrusted import quoted

_TENSORS = ("encoder", "encoder_bias", "decoder", "decoder_bias")
_OPTIONAL = ("threshold", "skip", "input_bias")
_GEMMA_SCOPE = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
#: ffkv's 0-d arrays: name -> the dtype kinds it may have ("U" a string, "iu" an integer).
_SCALARS = {"kind": "U", "layer": "iu", "activation": "U", "k": "iu", "hookpoint": "U", "dtype": "U"}
#: The most bytes one of ffkv's 0-d arrays may declare (a string of 1,024 characters).
MAX_SCALAR_BYTES = 4096
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float64", "float16", "bfloat16")}


def read_npz_dictionary(path: Path, *, kind: str | None = None, layer: int | None = None,
                        hookpoint: str | None = None) -> Dictionary:
    """The dictionary in one ``.npz`` file; `kind`, `layer` and `hookpoint` say what the file does not (and
    must agree with what it does say)."""
    with open_npz(path) as npz:
        gemma = "encoder" not in npz.names and set(_GEMMA_SCOPE) <= npz.names
        names = _GEMMA_SCOPE if gemma else (*_TENSORS, *_OPTIONAL, *_SCALARS)
        headers = npz.headers(names)
        _check_headers(path, headers, gemma)
        arrays = npz.arrays(headers)
    if gemma:
        t = tensors_of(path, arrays, _GEMMA_SCOPE)
        t = {"encoder": t["W_enc"].T.contiguous(), "encoder_bias": t["b_enc"], "decoder": t["W_dec"],
             "decoder_bias": t["b_dec"], "threshold": t["threshold"]}
        said = {"activation": "jumprelu", "k": None}
        architecture = "gemma scope jumprelu"
    else:
        t = tensors_of(path, arrays, _TENSORS, _OPTIONAL)
        said = {name: arrays[name].item() if name in arrays else None for name in _SCALARS}
        if said["dtype"] is not None:
            if said["dtype"] not in _DTYPES:
                raise FfkvError(f"{path}: dtype {quoted(said['dtype'])}, expected one of {', '.join(_DTYPES)}")
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
            raise FfkvError(f"layer {layer} but hookpoint {quoted(hookpoint)} is layer {at}")
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


def _check_headers(path: Path, headers: dict[str, NpyHeader], gemma: bool) -> None:
    """Refuse, before any array is decompressed, headers that are not one dictionary's: a tensor not floating
    point or not of the shape the encoder's implies, a scalar not 0-d, of another kind, or of more than
    `MAX_SCALAR_BYTES`, and missing tensors."""
    require(path, list(_GEMMA_SCOPE if gemma else _TENSORS), set(headers))
    first = "W_enc" if gemma else "encoder"
    encoder = headers[first].shape
    if len(encoder) != 2:
        raise FfkvError(f"{path}: array {first!r} declares shape {encoder}, expected "
                        f"{'(d_model, n_latents)' if gemma else '(n_latents, d_model)'}")
    n, dm = encoder[::-1] if gemma else encoder
    expected = shapes(n, dm)
    if gemma:
        expected = {"W_enc": (dm, n), "b_enc": expected["encoder_bias"], "W_dec": expected["decoder"],
                    "b_dec": expected["decoder_bias"], "threshold": expected["threshold"]}
    for name, header in headers.items():
        if name in _SCALARS:
            kinds = _SCALARS[name]
            if header.shape != () or header.dtype.kind not in kinds or header.nbytes > MAX_SCALAR_BYTES:
                raise FfkvError(f"{path}: {name!r} is a {header.dtype} array of shape {header.shape}, expected a "
                                f"single {'string' if kinds == 'U' else 'integer'} (of at most {MAX_SCALAR_BYTES:,} "
                                f"bytes)")
            continue
        if header.dtype.kind != "f" or header.dtype.itemsize not in (2, 4, 8):
            raise FfkvError(f"{path}: array {name!r} is {header.dtype}, expected floating point (float16, float32 or "
                            f"float64)")
        if header.shape != expected[name]:
            raise FfkvError(f"{path}: array {name!r} declares shape {header.shape}, expected {expected[name]} "
                            f"(n_latents {n}, d_model {dm}, from {first!r})")


def _agreed(path: Path, name: str, given: Any, said: Any) -> Any:
    if given is not None and said is not None and given != said:
        raise FfkvError(f"{path}: the file says {name} {quoted(said)}, but {quoted(given)} was passed")
    return given if given is not None else said
