"""SAELens's layout (PyPI ``sae-lens``): ``cfg.json`` + ``sae_weights.safetensors`` in one folder.

Tensors: ``W_enc`` (d_in, d_sae), ``b_enc`` (d_sae,), ``W_dec`` (d_sae, d_out), ``b_dec`` (d_out,),
``threshold`` (d_sae,) for JumpReLU, ``W_skip`` (d_out, d_in) for skip transcoders. Architectures read
(``cfg["architecture"]``, as SAELens 6 names them; configs older than 6.0 are read as SAELens reads them):

    standard -> sae, relu          transcoder               -> transcoder, relu
    jumprelu -> sae, jumprelu      skip_transcoder          -> transcoder, relu, skip
    topk     -> sae, topk          jumprelu_transcoder      -> transcoder, jumprelu
                                   jumprelu_skip_transcoder -> transcoder, jumprelu, skip

``apply_b_dec_to_input`` makes ``b_dec`` the input bias too. A topk SAE with
``rescale_acts_by_decoder_norm`` is read with the decoder norms folded in (encoder rows and biases times
‖W_dec[i]‖, decoder rows unit norm): the same activations and reconstruction. Refused, each in one line:
another architecture (gated, abstopk, temporal, matching pursuit), an input normalization
(``normalize_activations`` other than "none": SAELens computes it from each input or from a factor the
folder does not hold), a fine-tuning scaling factor, hook_z reshaping or a head index (attention).
Tensors are cast to the config's ``dtype``, as SAELens does when it loads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ffkv.dictionaries.dictionary import Dictionary
from ffkv.dictionaries.files import (about, boolean, expect_shape, positive_int, provenance, read_config,
                                     read_safetensors)
from ffkv.dictionaries.hookpoints import sites
from ffkv.errors import FfkvError
from ffkv.store.untrusted import quoted

CONFIG, WEIGHTS = "cfg.json", "sae_weights.safetensors"

#: architecture -> (kind, activation, skip)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "standard": ("sae", "relu", False),
    "jumprelu": ("sae", "jumprelu", False),
    "topk": ("sae", "topk", False),
    "transcoder": ("transcoder", "relu", False),
    "skip_transcoder": ("transcoder", "relu", True),
    "jumprelu_transcoder": ("transcoder", "jumprelu", False),
    "jumprelu_skip_transcoder": ("transcoder", "jumprelu", True),
}
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float64", "float16", "bfloat16")}


def is_saelens_folder(folder: Path) -> bool:
    return (folder / CONFIG).is_file() and (folder / WEIGHTS).is_file()


def read_saelens(folder: Path, hookpoint: str | None = None) -> Dictionary:
    """The dictionary in one SAELens folder; `hookpoint` stands in for the config's ``hook_name``."""
    config_path, weights_path = folder / CONFIG, folder / WEIGHTS
    cfg = _modern(read_config(config_path))
    meta = cfg["metadata"]
    architecture = cfg.get("architecture", "standard")
    if architecture not in ARCHITECTURES:
        raise FfkvError(f"{config_path}: architecture {quoted(architecture)}: ffkv reads {', '.join(ARCHITECTURES)}")
    kind, activation, skip = ARCHITECTURES[architecture]
    b_dec_to_input = boolean(config_path, cfg, "apply_b_dec_to_input", kind == "sae")
    _refuse_what_ffkv_cannot_compute(config_path, cfg, meta, kind, b_dec_to_input)

    d_in, n = positive_int(config_path, cfg, "d_in"), positive_int(config_path, cfg, "d_sae")
    d_out = positive_int(config_path, cfg, "d_out", d_in) if kind == "transcoder" else d_in
    if d_out != d_in:
        raise FfkvError(f"{config_path}: a transcoder from width {d_in} to width {d_out}: an FF layer's input and "
                        f"output have one width")
    k = positive_int(config_path, cfg, "k") if activation == "topk" else None
    if k is not None and k > n:
        raise FfkvError(f"{config_path}: k = {k} is more than its {n} latents")

    optional = ["threshold"] * (activation == "jumprelu") + ["W_skip"] * skip + ["scaling_factor"]
    t = read_safetensors(weights_path, ["W_enc", "b_enc", "W_dec", "b_dec"], optional)
    what = f"{CONFIG}: d_in {d_in}, d_sae {n}"
    for name, shape in {"W_enc": (d_in, n), "b_enc": (n,), "W_dec": (n, d_in), "b_dec": (d_in,),
                        "threshold": (n,), "W_skip": (d_in, d_in)}.items():
        if name in optional or name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            if name not in t:
                raise FfkvError(f"{weights_path}: missing tensor {name!r} (architecture {quoted(architecture)} has "
                                f"one)")
            expect_shape(weights_path, name, t[name], shape, what)
    if "scaling_factor" in t and not bool((t["scaling_factor"] == 1).all()):
        raise FfkvError(f"{weights_path}: holds a fine-tuning scaling_factor, which ffkv does not apply")
    dtype = _dtype(config_path, cfg, t["W_enc"].dtype)
    t = {name: tensor.to(dtype) for name, tensor in t.items()}

    encoder, encoder_bias, decoder = t["W_enc"].T.contiguous(), t["b_enc"], t["W_dec"]
    folded = activation == "topk" and boolean(config_path, cfg, "rescale_acts_by_decoder_norm")
    if folded:   # SAELens ranks pre_i·‖W_dec[i]‖ and writes a_i·W_dec[i]/‖W_dec[i]‖: fold the norms in
        norms = decoder.norm(dim=-1)
        encoder, encoder_bias, decoder = encoder * norms[:, None], encoder_bias * norms, decoder / norms[:, None]

    hookpoint = hookpoint or meta.get("hook_name")
    if not isinstance(hookpoint, str) or not hookpoint:
        raise FfkvError(f"{config_path}: names no hook_name: pass hookpoint= (e.g. 'blocks.3.hook_mlp_out')")
    hookpoint_out = meta.get("hook_name_out") if kind == "transcoder" else None
    with about(folder):
        layer, reads, writes = sites(kind, hookpoint, hookpoint_out)
        if isinstance(meta.get("hook_layer"), int) and meta["hook_layer"] != layer:
            raise FfkvError(f"{CONFIG} says hook_layer {meta['hook_layer']} but hook_name {quoted(hookpoint)} is layer "
                            f"{layer}")
        return Dictionary(
            kind=kind, layer=layer, encoder=encoder, encoder_bias=encoder_bias, decoder=decoder,
            decoder_bias=t["b_dec"], activation=activation, k=k, threshold=t.get("threshold"), skip=t.get("W_skip"),
            input_bias=t["b_dec"] if b_dec_to_input else None,
            source=provenance(folder, "saelens", [config_path, weights_path], architecture=architecture,
                              hookpoint=hookpoint, hookpoint_out=hookpoint_out, reads=reads, writes=writes,
                              model_name=meta.get("model_name"), decoder_norms_folded=folded))


def _modern(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config in SAELens 6's terms: a config older than 6.0 (no ``metadata``; ``hook_point``,
    ``activation_fn_str``, a topk given as ``activation_fn_kwargs``, a boolean ``normalize_activations``)
    read as SAELens's own loader reads it."""
    cfg = dict(cfg)
    meta = cfg.get("metadata")
    meta = dict(meta) if isinstance(meta, dict) else {}
    for old, new in (("hook_point", "hook_name"), ("hook_point_head_index", "hook_head_index")):
        if old in cfg and new not in cfg:
            cfg[new] = cfg[old]
    for key in ("hook_name", "hook_name_out", "hook_head_index", "hook_layer", "model_name"):
        if key in cfg and key not in meta:
            meta[key] = cfg[key]
    cfg["metadata"] = meta
    activation_fn = cfg.get("activation_fn", cfg.get("activation_fn_str"))
    kwargs = cfg.get("activation_fn_kwargs")
    if "architecture" not in cfg or activation_fn == "topk":
        if activation_fn == "topk" and isinstance(kwargs, dict) and kwargs.get("k") is not None:
            cfg["architecture"], cfg["k"] = "topk", kwargs["k"]
        elif activation_fn not in (None, "relu"):
            cfg["architecture"] = f"{cfg.get('architecture', 'standard')} with activation {activation_fn}"
    if isinstance(cfg.get("normalize_activations"), bool) or cfg.get("normalize_activations") is None:
        cfg["normalize_activations"] = "expected_average_only_in" if cfg.get("normalize_activations") else "none"
    return cfg


def _refuse_what_ffkv_cannot_compute(config_path: Path, cfg: dict[str, Any], meta: dict[str, Any], kind: str,
                                     b_dec_to_input: bool) -> None:
    norm = cfg["normalize_activations"]
    if norm != "none":
        why = {"expected_average_only_in": "its inputs must be scaled by a factor this folder does not hold: "
                                            "fold it with SAE.fold_activation_norm_scaling_factor and save again",
               "covariance_whitening": "fold it with SAE.fold_activation_whitening and save again"}
        reason = why.get(norm, "it is computed from each input, so latents are no longer fixed keys")
        raise FfkvError(f"{config_path}: normalize_activations {quoted(norm)}: ffkv reads dictionaries whose input is "
                        f"the model's own vector ({reason})")
    if cfg.get("reshape_activations", "none") != "none" or meta.get("hook_head_index") is not None:
        raise FfkvError(f"{config_path}: an SAE on attention heads (hook_z reshaping or a head index): ffkv reads "
                        f"dictionaries of FF layers")
    scaling = cfg.get("finetuning_scaling_factor")
    if scaling is not None and scaling is not False:   # older configs say false or null; anything else is refused
        raise FfkvError(f"{config_path}: finetuning_scaling_factor is {quoted(scaling)}: a fine-tuning scaling factor, "
                        f"which ffkv does not apply")
    if kind == "transcoder" and b_dec_to_input:
        raise FfkvError(f"{config_path}: apply_b_dec_to_input on a transcoder (SAELens refuses it too: b_dec is "
                        f"in the output space)")


def _dtype(config_path: Path, cfg: dict[str, Any], file_dtype: torch.dtype) -> torch.dtype:
    name = cfg.get("dtype")
    if name is None:
        return file_dtype
    dtype = _DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise FfkvError(f"{config_path}: dtype {quoted(name)}, expected one of {', '.join(_DTYPES)}")
    return dtype
