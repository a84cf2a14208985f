"""Reading a dictionary's files safely: nothing in them runs, and every damaged file is refused in one line.

Every file is read as one someone else made (`ffkv.store.untrusted`): regular files only (a FIFO or a device
is refused, never waited on or read without end), configs within a byte budget and a nesting depth.
Tensors come only from safetensors (`safe_open`) or `.npz` (numpy's `.npy` reader, ``allow_pickle=False``):
no pickle, no `torch.load`, no code from the files. Sizes are checked from each file's header before a
tensor is read, so a file that declares a huge tensor is refused without allocating it; of an `.npz`, only
the arrays a layout names are ever decompressed, each no further than its header says. Every tensor read
is checked to be floating point and finite. Each refusal is an `FfkvError` naming the file.
"""

from __future__ import annotations

import hashlib
import math
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from ffkv.errors import FfkvError
from ffkv.store import untrusted
from ffkv.store.untrusted import quoted

#: The most elements one tensor may declare (2^32: 16 GiB in float32; a 1M-latent dictionary of a 2304-wide
#: model has 2.4e9). A file that declares more is refused before anything is read.
MAX_ELEMENTS = 2**32
#: The most bytes one array of an `.npz` may declare (itemsize x elements: MAX_ELEMENTS in float32).
MAX_ARRAY_BYTES = 4 * MAX_ELEMENTS
#: The most bytes the arrays read from one `.npz` may declare together (an encoder, a decoder and a skip matrix
#: of the largest size).
MAX_NPZ_BYTES = 3 * MAX_ARRAY_BYTES
#: The most bytes a config file may have (a config is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20


def sha256(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with untrusted.open_regular(path, "a dictionary's file") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_config(path: Path) -> dict[str, Any]:
    """A JSON object from a small config file (`cfg.json`), read as `ffkv.store.untrusted` reads one."""
    return untrusted.read_json_object(path, MAX_CONFIG_BYTES, "a JSON config")


def read_safetensors(path: Path, required: Iterable[str], optional: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The `required` tensors (and those of `optional` present) of a safetensors file, each checked."""
    required, optional = list(required), list(optional)
    try:
        untrusted.check_regular(path, "a safetensors file")   # safe_open would wait on a FIFO, or read a device
        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            require(path, required, present)
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


@dataclass(frozen=True)
class NpyHeader:
    """What an `.npz` array's ``.npy`` header declares, read before any of its data."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """The bytes its data takes: itemsize x elements."""
        return math.prod(self.shape) * self.dtype.itemsize


class Npz:
    """An open `.npz` file (`open_npz`) whose arrays are read by name: `names` come from the zip's directory,
    `headers` reads only the ``.npy`` headers of the arrays asked for, and `arrays` decompresses only those,
    each no further than its header says. An array no one asks for is never read."""

    def __init__(self, path: Path, archive: zipfile.ZipFile) -> None:
        self.path = path
        self._archive = archive
        self._members: dict[str, zipfile.ZipInfo] = {}
        for info in archive.infolist():
            name = info.filename.removesuffix(".npy")
            if name in self._members:
                raise FfkvError(f"{path}: holds array {quoted(name)} twice (a damaged or hostile file?)")
            self._members[name] = info

    @property
    def names(self) -> frozenset[str]:
        """The names of the arrays the file holds."""
        return frozenset(self._members)

    def headers(self, names: Iterable[str]) -> dict[str, NpyHeader]:
        """The headers of those of `names` the file holds. Refused: an array of Python objects (a pickle), one
        that declares more than `MAX_ARRAY_BYTES` (itemsize x elements), all of them more than `MAX_NPZ_BYTES`,
        and a zip member whose declared size is not its header's and its data's (more data than the array)."""
        out = {}
        for name in names:
            if name not in self._members or name in out:
                continue
            info = self._members[name]
            with _npz_errors(self.path), self._archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = _NPY_HEADERS.get(version)
                if read_header is None:
                    raise FfkvError(f"{self.path}: array {name!r} is .npy version {version}, which ffkv does not read")
                shape, _, dtype = read_header(member)   # the header only: nothing is allocated yet
                start = member.tell()
            header = NpyHeader(tuple(int(n) for n in shape), dtype)
            if dtype.hasobject:
                raise FfkvError(f"{self.path}: array {name!r} holds Python objects, which ffkv does not unpickle")
            if header.nbytes > MAX_ARRAY_BYTES:
                raise FfkvError(f"{self.path}: array {name!r} declares shape {header.shape} of {dtype}, "
                                f"{header.nbytes:,} bytes: more than the {MAX_ARRAY_BYTES:,} ffkv reads of one array "
                                f"(a damaged or hostile file?)")
            if info.file_size != start + header.nbytes:
                raise FfkvError(f"{self.path}: array {name!r}: its zip member declares {info.file_size:,} bytes, but "
                                f"its .npy header {start + header.nbytes:,} (a damaged or hostile file?)")
            out[name] = header
        total = sum(header.nbytes for header in out.values())
        if total > MAX_NPZ_BYTES:
            raise FfkvError(f"{self.path}: its arrays declare {total:,} bytes together, more than the "
                            f"{MAX_NPZ_BYTES:,} ffkv reads of one file (a damaged or hostile file?)")
        return out

    def arrays(self, headers: Mapping[str, NpyHeader]) -> dict[str, np.ndarray]:
        """The data of the arrays whose `headers` were read (and checked by the caller), with numpy's ``.npy``
        reader (``allow_pickle=False``); each member's checksum is verified as its last byte is read."""
        out = {}
        for name in headers:
            with _npz_errors(self.path), self._archive.open(self._members[name]) as member:
                out[name] = np.lib.format.read_array(member, allow_pickle=False)
        return out


@contextmanager
def open_npz(path: Path) -> Iterator[Npz]:
    """`path` open as an `Npz` (a regular file only: `ffkv.store.untrusted.open_regular`)."""
    with untrusted.open_regular(path, "an .npz file") as handle:
        with _npz_errors(path):
            archive = zipfile.ZipFile(handle)
        with archive:
            yield Npz(path, archive)


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


@contextmanager
def _npz_errors(path: Path) -> Iterator[None]:
    """Within it, what a damaged zip or ``.npy`` raises is one line naming `path`."""
    try:
        yield
    except FfkvError:
        raise
    except Exception as error:   # zipfile, zlib and numpy raise their own error types for a damaged file
        raise FfkvError(f"{path}: not a readable .npz file ({_first_line(error)})") from None


def tensors_of(path: Path, arrays: Mapping[str, np.ndarray], required: Iterable[str],
               optional: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The `required` (and present `optional`) arrays of an npz file as checked tensors (in native byte order)."""
    required = list(required)
    require(path, required, set(arrays))
    names = [*required, *(n for n in optional if n in arrays)]
    return {name: checked(path, name, torch.from_numpy(_native(arrays[name]))) for name in names}


def _native(array: np.ndarray) -> np.ndarray:
    """`array` as torch takes it: C-contiguous, in the machine's byte order (a copy only where it is not)."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))


def checked(path: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, refused unless floating point and finite everywhere."""
    if not tensor.is_floating_point():
        raise FfkvError(f"{path}: tensor {name!r} is {tensor.dtype}, expected floating point")
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise FfkvError(f"{path}: tensor {name!r} has {bad} NaN or infinite value(s): the file is damaged or the "
                        f"training diverged")
    return tensor


def require(path: Path, names: list[str], present: set[str]) -> None:
    """Refuse, naming them, the tensors of `names` not in `present`."""
    missing = [n for n in names if n not in present]
    if missing:
        found = sorted(present)
        shown = ", ".join(map(quoted, found[:10])) + (f", ... ({len(found):,} in all)" if len(found) > 10 else "")
        raise FfkvError(f"{path}: missing tensor(s) {', '.join(map(repr, missing))} (found {shown or 'none'})")


def expect_shape(path: Path, name: str, tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    """Refuse a tensor whose shape is not `shape` (`what` says where the expected sizes come from)."""
    if tuple(tensor.shape) != shape:
        raise FfkvError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} ({what})")


def positive_int(path: Path, cfg: Mapping[str, Any], key: str, default: Any = None) -> int:
    """A config's positive integer `key`, refused when missing, not an integer, or huge."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_ELEMENTS:
        raise FfkvError(f"{path}: {key!r} is {quoted(value)}, expected a positive integer up to {MAX_ELEMENTS}")
    return value


def boolean(path: Path, cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """A config's boolean `key` (`default` when absent), refused unless JSON's true or false: the string "false"
    is true to Python and false to some libraries' parsers, so such a file does not say which it means."""
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise FfkvError(f"{path}: {key!r} is {quoted(value)}, expected true or false (a JSON boolean, not a string or "
                        f"a number)")
    return value


def provenance(path: Path, layout: str, files: Iterable[Path], **fields: Any) -> dict[str, Any]:
    """A dictionary's `source`: where it was read (`path`, absolute and resolved, so that a run indexed from one
    folder finds it from any other), `layout`, the sha256 of each file read (by its name), and `fields`
    (architecture, hookpoint, reads, writes, ...)."""
    return {"path": str(Path(path).resolve()), "layout": layout, "sha256": {f.name: sha256(f) for f in files},
            **fields}


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


def _check_size(path: Path, name: str, shape: Iterable[int]) -> None:
    shape = tuple(shape)
    if math.prod(shape) > MAX_ELEMENTS:
        raise FfkvError(f"{path}: tensor {name!r} declares shape {shape}, more than {MAX_ELEMENTS} elements: "
                        f"not a dictionary ffkv reads (a damaged or hostile file?)")


def _first_line(error: BaseException, limit: int = 300) -> str:
    """An error's first line, cut to `limit` characters (it may quote a name from the file)."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= limit else f"{line[:limit]}..."
