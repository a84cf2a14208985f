"""The layouts read back what was written bit for bit, and every damaged or mismatched file is refused in one
line that names it. Files are written here by hand (no sparsify or SAELens needed)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ffkv.dictionaries import Dictionary, check_against, open_dictionary, save_npz, save_sparsify
from ffkv.dictionaries.files import MAX_ELEMENTS
from ffkv.errors import FfkvError

N, DM = 24, 6
GIB = 1 << 30
TENSORS = ("encoder", "encoder_bias", "decoder", "decoder_bias", "threshold", "skip", "input_bias")


def make(kind="transcoder", activation="topk", layer=1, skip=False, sae_bias=True, seed=0) -> Dictionary:
    g = torch.Generator().manual_seed(seed)
    b_dec = torch.randn(DM, generator=g)
    return Dictionary(kind, layer, torch.randn(N, DM, generator=g), torch.randn(N, generator=g),
                      torch.randn(N, DM, generator=g), b_dec, activation,
                      k=4 if activation == "topk" else None,
                      threshold=torch.rand(N, generator=g) if activation == "jumprelu" else None,
                      skip=torch.randn(DM, DM, generator=g) if skip else None,
                      input_bias=b_dec if kind == "sae" and sae_bias else None)


def same(a: Dictionary, b: Dictionary) -> bool:
    fields_equal = all((getattr(a, n) is None and getattr(b, n) is None) or
                       (getattr(a, n) is not None and getattr(b, n) is not None and
                        getattr(a, n).dtype == getattr(b, n).dtype and torch.equal(getattr(a, n), getattr(b, n)))
                       for n in TENSORS)
    return fields_equal and (a.kind, a.layer, a.activation, a.k) == (b.kind, b.layer, b.activation, b.k)


def refused(path: Path, match: str, **kwargs) -> str:
    """open_dictionary(path) is refused with one line naming `path`; the message."""
    with pytest.raises(FfkvError, match=match) as caught:
        open_dictionary(path, **kwargs)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message, message
    return message


# -- round trips ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, skip", [("sae", False), ("transcoder", False), ("transcoder", True)])
def test_sparsify_round_trip_is_bit_exact(tmp_path, kind, skip):
    d = make(kind, skip=skip)
    save_sparsify(d, tmp_path / "layers.1.mlp")
    back = open_dictionary(tmp_path / "layers.1.mlp")
    assert list(back) == [1] and same(d, back[1])
    assert back[1].source["layout"] == "sparsify" and back[1].source["hookpoint"] == "layers.1.mlp"
    assert back[1].source["reads"] == ("ff_input" if kind == "transcoder" else "ff_output")
    weights = tmp_path / "layers.1.mlp" / "sae.safetensors"
    assert back[1].source["sha256"]["sae.safetensors"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    written = {"encoder.weight", "encoder.bias", "W_dec", "b_dec"} | ({"W_skip"} if skip else set())
    assert set(load_file(weights)) == written


def test_a_sparsify_run_folder_is_read_by_layer_and_the_hookpoint_is_kept_off_folder(tmp_path):
    for layer in (2, 0):
        save_sparsify(make(layer=layer, seed=layer), tmp_path / f"layers.{layer}.mlp")
    save_sparsify(make(layer=1, seed=1), tmp_path / "my_transcoder", hookpoint="model.layers.1.mlp")
    (tmp_path / "config.json").write_text("{}")                          # a run's own files are left alone
    found = open_dictionary(tmp_path)
    assert list(found) == [0, 1, 2]
    assert found[1].source["hookpoint"] == "model.layers.1.mlp"
    assert same(found[2], make(layer=2, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind, activation, skip", [("transcoder", "topk", True), ("sae", "jumprelu", False),
                                                    ("sae", "relu", False)])
def test_npz_round_trip_is_bit_exact(tmp_path, dtype, kind, activation, skip):
    d = make(kind, activation, skip=skip).to(dtype=dtype)
    save_npz(d, tmp_path / "d.npz")
    back = open_dictionary(tmp_path / "d.npz")[1]
    assert same(d, back) and back.source["layout"] == "npz"


def test_a_gemma_scope_npz_needs_its_kind_and_layer(tmp_path):
    d = make("transcoder", "jumprelu", layer=3)
    np.savez(tmp_path / "params.npz", W_enc=d.encoder.T.numpy(), b_enc=d.encoder_bias.numpy(), W_dec=d.decoder.numpy(),
             b_dec=d.decoder_bias.numpy(), threshold=d.threshold.numpy())
    refused(tmp_path / "params.npz", "pass kind=")
    back = open_dictionary(tmp_path / "params.npz", kind="transcoder", hookpoint="blocks.3.ln2.hook_normalized")[3]
    assert same(d, back)
    refused(tmp_path / "params.npz", "layer 2 but hookpoint", kind="transcoder", layer=2,
            hookpoint="blocks.3.ln2.hook_normalized")


def saelens_folder(folder: Path, cfg: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "sae_weights.safetensors"))
    return folder


def saelens_of(d: Dictionary) -> dict:
    out = {"W_enc": d.encoder.T, "b_enc": d.encoder_bias, "W_dec": d.decoder, "b_dec": d.decoder_bias}
    if d.threshold is not None:
        out["threshold"] = d.threshold
    return out


def test_a_saelens_folder_and_an_old_saelens_config(tmp_path):
    d = make("sae", "jumprelu")
    cfg = {"architecture": "jumprelu", "d_in": DM, "d_sae": N, "dtype": "float32", "apply_b_dec_to_input": True,
           "normalize_activations": "none", "metadata": {"hook_name": "blocks.1.hook_mlp_out", "model_name": "m"}}
    back = open_dictionary(saelens_folder(tmp_path / "new", cfg, saelens_of(d)))[1]
    assert same(d, back) and back.source["model_name"] == "m"
    old = {"d_in": DM, "d_sae": N, "hook_point": "blocks.1.hook_mlp_out", "hook_point_layer": 1,
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 4}, "normalize_activations": False,
           "apply_b_dec_to_input": True}
    back = open_dictionary(saelens_folder(tmp_path / "old", old, saelens_of(make("sae"))))[1]
    assert same(make("sae"), back) and back.source["architecture"] == "topk"


# -- refusals --------------------------------------------------------------------------------------------------

def sparsify_folder(tmp_path: Path, **d_kwargs) -> tuple[Path, Path, Path]:
    folder = save_sparsify(make(**d_kwargs), tmp_path / "layers.1.mlp")
    return folder, folder / "cfg.json", folder / "sae.safetensors"


def rewrite(weights: Path, change) -> None:
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, str(weights))


def test_a_missing_tensor_is_refused_naming_the_file(tmp_path):
    folder, _, weights = sparsify_folder(tmp_path)
    rewrite(weights, lambda t: t.pop("W_dec"))
    assert str(weights) in refused(folder, "missing tensor.*'W_dec'")


def test_a_wrong_shape_is_refused_naming_the_file(tmp_path):
    folder, _, weights = sparsify_folder(tmp_path)
    rewrite(weights, lambda t: t.update(W_dec=torch.zeros(N, DM + 1)))
    assert str(weights) in refused(folder, r"'W_dec' has shape \(24, 7\), expected \(24, 6\)")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_is_refused_naming_the_file(tmp_path, bad):
    folder, _, weights = sparsify_folder(tmp_path)
    rewrite(weights, lambda t: t["encoder.weight"].__setitem__((3, 2), bad))
    assert str(weights) in refused(folder, "'encoder.weight' has 1 NaN or infinite")


def test_a_truncated_or_missing_file_is_refused_naming_it(tmp_path):
    folder, config, weights = sparsify_folder(tmp_path)
    weights.write_bytes(weights.read_bytes()[:-40])
    assert str(weights) in refused(folder, "not a readable safetensors file")
    config.write_text("{not json")
    assert str(config) in refused(folder, "not a JSON config")
    config.unlink()
    assert str(config) in refused(folder, "missing")


def test_a_skip_connection_the_weights_lack_is_refused(tmp_path):
    folder, config, weights = sparsify_folder(tmp_path)
    config.write_text(json.dumps({**json.loads(config.read_text()), "skip_connection": True}))
    assert str(weights) in refused(folder, "lacks 'W_skip'")


def test_huge_declared_sizes_are_refused_before_reading(tmp_path):
    folder, config, _ = sparsify_folder(tmp_path)
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_latents": 10**12}))
    assert str(config) in refused(folder, "num_latents")
    # an .npy header that declares 2^40 elements over a few bytes of data: refused from its header
    header = {"descr": "<f4", "fortran_order": False, "shape": (2**20, 2**20)}
    npz = tmp_path / "huge.npz"
    with zipfile.ZipFile(npz, "w") as archive, archive.open("encoder.npy", "w") as member:
        np.lib.format.write_array_header_1_0(member, header)
        member.write(b"\0" * 64)
    assert 2**40 > MAX_ELEMENTS
    refused(npz, "declares shape")


def zeros_member(archive: zipfile.ZipFile, name: str, descr: str, shape: tuple, nbytes: int) -> None:
    """An ``.npy`` member of `archive` whose header declares `descr` and `shape`, followed by `nbytes` zeros,
    compressed as they are written (a gigabyte takes a megabyte, and never the test's memory)."""
    with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, {"descr": descr, "fortran_order": False, "shape": shape})
        chunk = bytes(1 << 20)
        for start in range(0, nbytes, len(chunk)):
            member.write(chunk[:min(len(chunk), nbytes - start)])


def npz_with(path: Path, dictionary, bomb: tuple[str, str, tuple, int]) -> Path:
    """`dictionary` as ffkv's npz arrays (`save_npz`), compressed, with `bomb` (name, descr, shape, bytes of
    zeros: `zeros_member`) in place of its array of that name, or beside them."""
    save_npz(dictionary, path)
    with np.load(path) as saved:
        arrays = {name: saved[name] for name in saved.files if name != bomb[0]}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
        zeros_member(archive, *bomb)
    return path


@contextlib.contextmanager
def traced_peak() -> Iterator[list]:
    """Within it, Python's and numpy's allocations are traced; the list then holds their peak, in bytes."""
    peak: list = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


@pytest.mark.parametrize("bomb, match", [
    # a jumprelu's threshold of a gigabyte (2^28 float32): its shape is not the encoder's latents
    (("threshold", "<f4", (GIB // 4,), GIB), r"'threshold' declares shape \(268435456,\), expected \(24,\)"),
    # 2^32 float64 elements: within an element count, 32 GiB of bytes (the data is cut short: never reached)
    (("encoder", "<f8", (2**16, 2**16), 1 << 20), "declares shape .* 34,359,738,368 bytes: more than the"),
    # an encoder of 576 bytes whose zip member holds a gigabyte more
    (("encoder", "<f4", (N, DM), N * DM * 4 + GIB), "its zip member declares"),
])
def test_an_npz_bomb_in_a_needed_array_is_refused_before_it_is_decompressed(tmp_path, bomb, match):
    path = npz_with(tmp_path / "bomb.npz", make("transcoder", "jumprelu"), bomb)
    assert path.stat().st_size < 4 << 20 and 2**32 <= MAX_ELEMENTS
    with traced_peak() as peak:
        refused(path, match)
    assert peak[0] < 64 << 20, f"{peak[0]:,} bytes traced"


def test_an_npz_array_the_layout_does_not_name_is_never_read(tmp_path):
    d = make("transcoder", "jumprelu")
    path = npz_with(tmp_path / "d.npz", d, ("notes", "|u1", (GIB,), GIB))
    with traced_peak() as peak:
        assert same(open_dictionary(path)[1], d)
    assert peak[0] < 64 << 20, f"{peak[0]:,} bytes traced"


def test_a_fifo_or_a_device_named_npz_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo.npz")
    refused(tmp_path / "fifo.npz", r"a FIFO \(named pipe\), not a regular file")
    (tmp_path / "zero.npz").symlink_to("/dev/zero")
    refused(tmp_path / "zero.npz", "a character device, not a regular file")


def test_a_pickled_npz_is_refused(tmp_path):
    np.savez(tmp_path / "p.npz", encoder=np.array([{"a": 1}], dtype=object))
    refused(tmp_path / "p.npz", "Python objects")


def test_an_attention_or_residual_hookpoint_is_refused_naming_the_folder(tmp_path):
    save_sparsify(make(), tmp_path / "layers.1.self_attn", hookpoint="layers.1.mlp")
    (tmp_path / "layers.1.self_attn" / "cfg.json").write_text(json.dumps(
        {**json.loads((tmp_path / "layers.1.self_attn" / "cfg.json").read_text()), "hookpoint": "layers.1.self_attn"}))
    refused(tmp_path / "layers.1.self_attn", "attention; ffkv reads dictionaries of FF layers")
    save_sparsify(make(), tmp_path / "layers.4")
    (tmp_path / "layers.4" / "cfg.json").write_text(json.dumps(
        {k: v for k, v in json.loads((tmp_path / "layers.4" / "cfg.json").read_text()).items() if k != "hookpoint"}))
    refused(tmp_path / "layers.4", "residual stream")


@pytest.mark.parametrize("change, match", [
    ({"normalize_activations": "layer_norm"}, "normalize_activations 'layer_norm'"),
    ({"normalize_activations": "expected_average_only_in"}, "does not hold"),
    ({"architecture": "gated"}, "architecture 'gated'"),
    ({"reshape_activations": "hook_z"}, "attention heads"),
    ({"metadata": {"hook_name": "blocks.1.hook_resid_pre"}}, "residual stream"),
    ({"metadata": {}}, "pass hookpoint="),
    ({"d_sae": 25}, r"'W_enc' has shape \(6, 24\), expected \(6, 25\)"),
    ({"dtype": "int8"}, "dtype 'int8'"),
])
def test_what_saelens_folders_ffkv_cannot_compute_are_refused(tmp_path, change, match):
    cfg = {"architecture": "standard", "d_in": DM, "d_sae": N, "apply_b_dec_to_input": True,
           "normalize_activations": "none", "metadata": {"hook_name": "blocks.1.hook_mlp_out"}, **change}
    refused(saelens_folder(tmp_path / "sae", cfg, saelens_of(make("sae", "relu"))), match)


@pytest.mark.parametrize("change, match", [
    ({"transcode": "false"}, "'transcode' is 'false', expected true or false"),
    ({"skip_connection": 0}, "'skip_connection' is 0, expected true or false"),
    ({"transcode": None}, "'transcode' is None, expected true or false"),
    # sparsify refuses a num_latents of "" (int("")); ffkv read it as 0 and took expansion_factor's 4 x 6 = 24
    ({"num_latents": "", "expansion_factor": 4}, "'num_latents' is '', expected a positive integer"),
])
def test_a_sparsify_config_that_does_not_say_what_sparsify_reads_is_refused(tmp_path, change, match):
    folder, config, _ = sparsify_folder(tmp_path)
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    assert str(config) in refused(folder, match)


def test_sparsify_reads_num_latents_0_as_its_expansion_factor(tmp_path):
    folder, config, _ = sparsify_folder(tmp_path)
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_latents": 0, "expansion_factor": 4}))
    assert same(open_dictionary(folder)[1], make())


@pytest.mark.parametrize("architecture, change, match", [
    ("standard", {"apply_b_dec_to_input": "false"}, "'apply_b_dec_to_input' is 'false', expected true or false"),
    ("topk", {"rescale_acts_by_decoder_norm": "false"}, "'rescale_acts_by_decoder_norm' is 'false'"),
    ("standard", {"finetuning_scaling_factor": "false"}, "finetuning_scaling_factor is 'false'"),
])
def test_a_saelens_boolean_that_is_no_json_boolean_is_refused(tmp_path, architecture, change, match):
    """A string "false" is true to SAELens (it tests the field's truth) and false to a reader: refused."""
    activation = "topk" if architecture == "topk" else "relu"
    cfg = {"architecture": architecture, "d_in": DM, "d_sae": N, "apply_b_dec_to_input": True, "k": 4,
           "normalize_activations": "none", "metadata": {"hook_name": "blocks.1.hook_mlp_out"}, **change}
    refused(saelens_folder(tmp_path / "sae", cfg, saelens_of(make("sae", activation))), match)


def test_a_model_mismatch_is_refused_naming_the_folder(tmp_path):
    folder, _, _ = sparsify_folder(tmp_path)
    found = open_dictionary(folder)
    check_against(found, n_layers=2, d_model=DM)
    for n_layers, d_model, match in ((1, DM, "the model has 1 layers"), (2, 8, "d_model is 8")):
        with pytest.raises(FfkvError, match=match) as caught:
            check_against(found, n_layers=n_layers, d_model=d_model)
        assert str(folder) in str(caught.value)


def test_two_dictionaries_for_one_layer_or_none_at_all_are_refused(tmp_path):
    save_sparsify(make(layer=1), tmp_path / "layers.1.mlp")
    save_npz(make(layer=1), tmp_path / "also_layer_1.npz")
    refused(tmp_path, "a second dictionary for FF layer 1")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "holds no dictionary")
    refused(tmp_path / "nothing_here", "no such file")
