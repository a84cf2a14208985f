"""EleutherAI sparsify's layout (PyPI ``eai-sparsify``): read it, and write it so that sparsify reads it back.

A folder per hookpoint (``layers.3.mlp``), holding ``cfg.json`` (``d_in``, ``num_latents`` or
``expansion_factor``, ``k``, ``activation``, ``transcode``, ``skip_connection``, ...) and
``sae.safetensors`` (``encoder.weight`` (n_latents, d_in), ``encoder.bias``, ``W_dec`` (n_latents, d_in),
``b_dec`` (d_in,), and ``W_skip`` (d_in, d_in) for a skip transcoder). The parent folder may hold many.

sparsify's `SparseCoder.encode` is relu(x' · Wᵀ + b), then the top k, where x' = x - b_dec for an SAE and
x' = x for a transcoder: an SAE's `b_dec` is its `input_bias` too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ffkv.dictionaries.dictionary import Dictionary
from ffkv.dictionaries.files import (about, boolean, expect_shape, positive_int, provenance, read_config,
                                     read_safetensors)
from ffkv.dictionaries.hookpoints import ff_site, sites
from ffkv.errors import FfkvError
from ffkv.store.untrusted import quoted
from ffkv.store.atomic import atomic_path, make_readable, write_json

CONFIG, WEIGHTS = "cfg.json", "sae.safetensors"
#: sparsify's default `expansion_factor` (when `num_latents` is 0 or absent).
DEFAULT_EXPANSION = 32


def is_sparsify_folder(folder: Path) -> bool:
    return (folder / CONFIG).is_file() and (folder / WEIGHTS).is_file()


def read_sparsify(folder: Path, hookpoint: str | None = None) -> Dictionary:
    """The dictionary in one sparsify hookpoint folder.

    Its hookpoint is `hookpoint` if given, else the one ffkv's `save_sparsify` recorded in ``cfg.json``,
    else the folder's name (sparsify names each folder after its hookpoint).
    """
    config_path, weights_path = folder / CONFIG, folder / WEIGHTS
    cfg = read_config(config_path)
    d_in = positive_int(config_path, cfg, "d_in")
    n = cfg.get("num_latents", 0)
    if n == 0 and type(n) is int:   # sparsify's "use expansion_factor"
        n = d_in * positive_int(config_path, cfg, "expansion_factor", DEFAULT_EXPANSION)
    n = positive_int(config_path, {"num_latents": n}, "num_latents")
    k = positive_int(config_path, cfg, "k", 32)
    if cfg.get("activation", "topk") != "topk":
        raise FfkvError(f"{config_path}: activation {quoted(cfg['activation'])}: ffkv reads sparsify's topk coders "
                        f"only")
    if k > n:
        raise FfkvError(f"{config_path}: k = {k} is more than its {n} latents")
    transcode, skip = boolean(config_path, cfg, "transcode"), boolean(config_path, cfg, "skip_connection")

    t = read_safetensors(weights_path, ["encoder.weight", "encoder.bias", "W_dec", "b_dec"], ["W_skip"])
    what = f"{CONFIG}: {n} latents, d_in {d_in}"
    for name, shape in {"encoder.weight": (n, d_in), "encoder.bias": (n,), "W_dec": (n, d_in), "b_dec": (d_in,),
                        "W_skip": (d_in, d_in)}.items():
        if name in t:
            expect_shape(weights_path, name, t[name], shape, what)
    if skip != ("W_skip" in t):
        raise FfkvError(f"{weights_path}: {CONFIG} says skip_connection={skip} but the file "
                        f"{'lacks' if skip else 'holds'} 'W_skip'")
    dtype = t["encoder.weight"].dtype   # sparsify builds the coder in one dtype and loads every tensor into it
    t = {name: tensor.to(dtype) for name, tensor in t.items()}

    kind = "transcoder" if transcode else "sae"
    hookpoint = _hookpoint(config_path, folder, cfg, hookpoint)
    with about(folder):
        layer, reads, writes = sites(kind, hookpoint)
        return Dictionary(
            kind=kind, layer=layer, encoder=t["encoder.weight"], encoder_bias=t["encoder.bias"],
            decoder=t["W_dec"], decoder_bias=t["b_dec"], activation="topk", k=k, skip=t.get("W_skip"),
            input_bias=None if transcode else t["b_dec"],
            source=provenance(folder, "sparsify", [config_path, weights_path],
                              architecture=("skip transcoder" if skip else "transcoder") if transcode else "topk sae",
                              hookpoint=hookpoint, reads=reads, writes=writes))


def save_sparsify(dictionary: Dictionary, folder: str | Path, hookpoint: str | None = None) -> Path:
    """Write `dictionary` as one sparsify hookpoint folder (``cfg.json`` + ``sae.safetensors``), which
    `sparsify.SparseCoder.load_from_disk(folder)` and `read_sparsify` read back exactly.

    Name the folder after the hookpoint, sparsify's convention (``root / "layers.3.mlp"``, which
    ``SparseCoder.load_many(root, local=True)`` reads as a set); where the folder's name is not `hookpoint`
    (default: the one the dictionary was read from, else ``layers.{layer}.mlp``), ``cfg.json`` records it
    as ``hookpoint`` (sparsify drops the field with a notice). Only what sparsify can compute is written:
    a topk dictionary, whose input bias (an SAE's) is its decoder bias, and a transcoder's none. Each file
    is written atomically.
    """
    d, folder = dictionary, Path(folder)
    hookpoint = hookpoint or d.source.get("hookpoint") or f"layers.{d.layer}.mlp"
    if d.activation != "topk":
        raise FfkvError(f"save_sparsify: sparsify computes topk coders only, this dictionary is {d.activation}")
    if d.kind == "sae" and (d.input_bias is None or not torch.equal(d.input_bias, d.decoder_bias)):
        raise FfkvError("save_sparsify: a sparsify SAE subtracts its decoder bias from its input, this one does not")
    if d.kind == "transcoder" and d.input_bias is not None:
        raise FfkvError("save_sparsify: a sparsify transcoder subtracts nothing from its input, this one does")
    with about(folder):
        sites(d.kind, hookpoint)
    tensors = {"encoder.weight": d.encoder, "encoder.bias": d.encoder_bias, "W_dec": d.decoder,
               "b_dec": d.decoder_bias}
    if d.skip is not None:
        tensors["W_skip"] = d.skip
    tensors = {name: t.detach().to("cpu", d.dtype).contiguous().clone() for name, t in tensors.items()}
    cfg = {"activation": "topk", "expansion_factor": DEFAULT_EXPANSION, "normalize_decoder": True,
           "num_latents": d.n_latents, "k": d.k, "multi_topk": False, "skip_connection": d.skip is not None,
           "transcode": d.kind == "transcoder", "d_in": d.d_model}
    if folder.name != hookpoint:
        cfg["hookpoint"] = hookpoint
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        make_readable(tmp)  # safetensors writes the file anew, 0600
    write_json(folder / CONFIG, cfg)
    return folder


def _hookpoint(config_path: Path, folder: Path, cfg: dict, given: str | None) -> str:
    if given:
        return given
    recorded = cfg.get("hookpoint")
    if recorded is None:
        return folder.name
    if not isinstance(recorded, str):
        raise FfkvError(f"{config_path}: 'hookpoint' is {quoted(recorded)}, expected a module name like layers.3.mlp")
    with about(config_path):
        layer = ff_site(recorded).layer
    try:
        named = ff_site(folder.name).layer
    except FfkvError:   # a folder not named after its hookpoint: the recorded one stands
        named = layer
    if named != layer:
        raise FfkvError(f"{config_path}: records hookpoint {quoted(recorded)} (layer {layer}) but its folder is named "
                        f"{folder.name!r} (layer {named}): which is it? (pass hookpoint=)")
    return recorded
