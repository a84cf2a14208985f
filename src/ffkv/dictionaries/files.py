"""Reading a dictionary's files safely: nothing in them runs, and every damaged file is refused in one line.

Tensors come only from safetensors (`safe_open`) or `.npz` (`numpy.load(allow_pickle=False)`): no pickle,
no `torch.load`, no code from the files. Sizes are checked from each file's header before a tensor is
read, so a file that declares a huge tensor is refused without allocating it; every tensor read is
checked to be floating point and finite. Each refusal is an `FfkvError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from ffkv.errors import FfkvError

#: The most elements one tensor may declare (2^32: 16 GiB in float32; a 1M-latent dictionary of a 2304-wide
#: model has 2.4e9). A file that declares more is refused before anything is read.
MAX_ELEMENTS = 2**32
#: The most bytes a config file may have (a config is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20


def sha256(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_config(path: Path) -> dict[str, Any]:
    """A JSON object from a small config file (`cfg.json`)."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise FfkvError(f"{path}: {path.stat().st_size} bytes, too large for a dictionary's config")
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FfkvError(f"{path}: missing (a dictionary folder holds its config here)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FfkvError(f"{path}: not a JSON config ({error})") from None
    if not isinstance(cfg, dict):
        raise FfkvError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def read_safetensors(path: Path, required: Iterable[str], optional: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The `required` tensors (and those of `optional` present) of a safetensors file, each checked."""
    required, optional = list(required), list(optional)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            _require(path, required, present)
            out = {}
            for name in [*required, *(n for n in optional if n in present)]:
                piece = f.get_slice(name)
                _check_size(path, name, piece.get_shape())
                out[name] = f.get_tensor(name)
    except FfkvError:
        raise
    except FileNotFoundError:
        raise FfkvError(f"{path}: missing (a dictionary folder holds its weights here)") from None
    except Exception as error:   # safetensors raises its own error types for a damaged header or body
        raise FfkvError(f"{path}: not a readable safetensors file ({_first_line(error)})") from None
    return {name: checked(path, name, t) for name, t in out.items()}


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an `.npz` file, headers checked before any array is read, pickles refused."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                name = info.filename.removesuffix(".npy")
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read_header = _NPY_HEADERS.get(version)
                    if read_header is None:
                        raise FfkvError(f"{path}: array {name!r} is .npy version {version}, which ffkv does not read")
                    shape, _, dtype = read_header(member)   # the header only: nothing is allocated yet
                _check_size(path, name, shape)
                if dtype.hasobject:
                    raise FfkvError(f"{path}: array {name!r} holds Python objects, which ffkv does not unpickle")
        with np.load(path, allow_pickle=False) as arrays:
            return {name: arrays[name] for name in arrays.files}
    except FfkvError:
        raise
    except FileNotFoundError:
        raise FfkvError(f"{path}: missing") from None
    except Exception as error:   # a damaged zip or .npy header
        raise FfkvError(f"{path}: not a readable .npz file ({_first_line(error)})") from None


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def tensors_of(path: Path, arrays: Mapping[str, np.ndarray], required: Iterable[str],
               optional: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The `required` (and present `optional`) arrays of an npz file as checked tensors."""
    required = list(required)
    _require(path, required, set(arrays))
    names = [*required, *(n for n in optional if n in arrays)]
    return {name: checked(path, name, torch.from_numpy(np.array(arrays[name]))) for name in names}


def checked(path: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, refused unless floating point and finite everywhere."""
    if not tensor.is_floating_point():
        raise FfkvError(f"{path}: tensor {name!r} is {tensor.dtype}, expected floating point")
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise FfkvError(f"{path}: tensor {name!r} has {bad} NaN or infinite value(s): the file is damaged or the "
                        f"training diverged")
    return tensor


def expect_shape(path: Path, name: str, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Refuse a tensor whose shape is not `shape` (`what` says where the expected sizes come from)."""
    if tuple(tensor.shape) != shape:
        raise FfkvError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} ({what})")


def positive_int(path: Path, cfg: Mapping[str, Any], key: str, default: Any = None) -> int:
    """A config's positive integer `key`, refused when missing, not an integer, or huge."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_ELEMENTS:
        raise FfkvError(f"{path}: {key!r} is {value!r}, expected a positive integer up to {MAX_ELEMENTS}")
    return value


def provenance(path: Path, layout: str, files: Iterable[Path], **fields: Any) -> dict[str, Any]:
    """A dictionary's `source`: where it was read (`path`, `layout`), the sha256 of each file read (by its name), and
    `fields` (architecture, hookpoint, reads, writes, ...)."""
    return {"path": str(path), "layout": layout, "sha256": {f.name: sha256(f) for f in files}, **fields}


@contextmanager
def about(path: Path) -> Iterator[None]:
    """Within it, an `FfkvError` that does not name `path` is raised again with `path` in front: every
    refusal of a file's content names the file."""
    try:
        yield
    except FfkvError as error:
        if str(path) in str(error):
            raise
        raise FfkvError(f"{path}: {error}") from None


def _require(path: Path, names: list[str], present: set[str]) -> None:
    missing = [n for n in names if n not in present]
    if missing:
        raise FfkvError(f"{path}: missing tensor(s) {', '.join(map(repr, missing))} "
                        f"(found {', '.join(map(repr, sorted(present))) or 'none'})")


def _check_size(path: Path, name: str, shape: Iterable[int]) -> None:
    shape = tuple(shape)
    if math.prod(shape) > MAX_ELEMENTS:
        raise FfkvError(f"{path}: tensor {name!r} declares shape {shape}, more than {MAX_ELEMENTS} elements: "
                        f"not a dictionary ffkv reads (a damaged or hostile file?)")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
