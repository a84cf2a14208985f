"""Read a torch checkpoint without running anything from it: weights and plain settings only.

`torch.load` unpickles, and a pickle names functions to call: a crafted ``model.pt`` runs what it
names (``os.system``, ``builtins.exec``) the moment it is opened. Every checkpoint ffkv opens (a
fairseq model, `ffkv train`'s and `ffkv index`'s own checkpoints) goes through `load_checkpoint`:
torch's weights-only unpickler (tensors, containers, numbers, strings) and an allow-list of the
plain types real checkpoints hold (`ALLOWED`: the ``argparse.Namespace`` of the paper's fairseq
checkpoint). The configs newer fairseq checkpoints pickle as omegaconf objects, and what they name
(their dataclass types, enums, fairseq's meters, NumPy scalars), are read as inert `Stub`s: nothing
of omegaconf, fairseq or NumPy is imported or called, and `plain` turns them into dicts and values.
A file that names anything else is refused with one line (`UnsafeCheckpoint`); no option of ffkv
loads it anyway.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ffkv.errors import FfkvError

#: Classes a checkpoint may name beyond torch's own allow-list: built from their stored attributes, or (the
#: builtin types, which omegaconf configs name as the types of their fields) plain values; no code of the file.
ALLOWED: tuple[type, ...] = (argparse.Namespace, collections.defaultdict, int, float, bool, str, bytes, list, dict,
                             tuple, set, frozenset)
#: Modules whose names are read as inert stubs (configs, enums, dataclass types, meters, scalars).
STUB_MODULES = ("omegaconf", "fairseq", "typing", "numpy")
#: How many different stub names a checkpoint of the old (not zip) format may bring (each costs one more read).
MAX_STUBS = 200


class UnsafeCheckpoint(FfkvError):
    """A checkpoint that names code to run when loaded: refused, naming what it names."""


class Stub:
    """An object a checkpoint names (its ``name``, e.g. ``omegaconf.dictconfig.DictConfig``), kept inert:
    what the pickle gives it (arguments, state, items) is stored, nothing is imported or run."""

    name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Stub":
        obj = super().__new__(cls)
        obj.args, obj.kwargs, obj.state, obj.items, obj.values = args, kwargs, None, {}, []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # a REDUCE calls it with the pickle's arguments
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.values.append(value)

    def extend(self, values: Any) -> None:
        self.values.extend(values)

    def __repr__(self) -> str:
        return f"<inert {self.name}>"


_STUBS: dict[str, type] = {}


def _stub(name: str) -> type:
    if name not in _STUBS:
        _STUBS[name] = type(f"Stub[{name}]", (Stub,), {"name": name})
    return _STUBS[name]


def stubbable(name: str) -> bool:
    """Whether a global the checkpoint names is read as an inert stub (see `STUB_MODULES`)."""
    return name.split(".", 1)[0] in STUB_MODULES


def _refuse(path: Path, name: str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{what} {path} names {name!r}, which loading it would import and run: ffkv reads only weights and "
        "plain settings from a checkpoint and has no option that runs a file's code. If you trust the file, "
        "load it yourself and save its tensors and settings as plain dicts")


#: torch's words for a name outside its allow-list (or in a module it blocks), in its long message.
_UNSUPPORTED = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")


def _reason(text: str) -> str:
    """The line of torch's weights-only message that says what it met (not its advice to load unsafely)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    specific = [line for line in lines if "weights_only" not in line and "Weights only" not in line
                and "documentation" not in line and "trusted source" not in line]
    return (specific or lines or ["unknown"])[0][:200]


def refusal(error: BaseException, path: str | Path, what: str) -> UnsafeCheckpoint | None:
    """The one-line refusal for torch's weights-only error raised inside another library (transformers reads
    ``pytorch_model.bin`` weights-only), or None when `error` is not one."""
    text = str(error)
    if not isinstance(error, pickle.UnpicklingError) and "Weights only load failed" not in text:
        return None
    found = _UNSUPPORTED.search(text)
    if found is not None:
        name = found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"
        return _refuse(Path(path), name, what)
    return UnsafeCheckpoint(f"{what} {path} cannot be read without running code from it ({_reason(text)}); "
                            "ffkv reads only weights and plain settings")


def load_checkpoint(path: str | Path, map_location: Any = "cpu", what: str = "checkpoint") -> Any:
    """`torch.load` that runs nothing from the file: weights-only, `ALLOWED` classes, and inert `Stub`s for
    the names of `STUB_MODULES`; anything else is refused (`UnsafeCheckpoint`, one line naming it).

    Args:
        path: a file written by `torch.save` (zip or the old format).
        map_location: as for `torch.load`.
        what: how messages name the file ("fairseq checkpoint", "training checkpoint", ...).

    Raises:
        UnsafeCheckpoint: the file names a function or class outside the allow-list.
        FfkvError: the file is not a torch checkpoint, or is damaged.
    """
    path = Path(path)
    names: set[str] = set()
    with torch.serialization.safe_globals(list(ALLOWED)):
        try:
            names = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except (ValueError, RuntimeError, pickle.UnpicklingError, EOFError, OSError):
            names = set()  # the old format (or not a checkpoint): names are found while loading, below
    for name in sorted(names):
        if not stubbable(name):
            raise _refuse(path, name, what)
    for _ in range(MAX_STUBS):
        stubs = [(_stub(n), n) for n in sorted(names)]
        try:
            with torch.serialization.safe_globals([*ALLOWED, *stubs]):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as error:
            text = str(error)
            found = _UNSUPPORTED.search(text)
            if found is None:
                raise UnsafeCheckpoint(f"{what} {path} cannot be read without running code from it "
                                       f"({_reason(text)}); ffkv reads only weights and plain settings") from None
            name = found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"
            if not stubbable(name) or name in names:
                raise _refuse(path, name, what) from None
            names.add(name)
        except FfkvError:
            raise
        except Exception as error:  # noqa: BLE001 - torch raises many kinds for a file that is not its checkpoint
            raise FfkvError(f"cannot read {what} {path}: {type(error).__name__}: "
                            f"{str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}") from None
    raise _refuse(path, sorted(names)[-1], what)


def plain(obj: Any) -> Any:
    """A loaded config as plain Python: Namespaces and omegaconf stubs as dicts and lists, enum stubs as their
    value, nodes as their value; types and stubs of unknown shape as None."""
    if isinstance(obj, argparse.Namespace):
        return {k: plain(v) for k, v in vars(obj).items()}
    if isinstance(obj, dict):
        return {plain(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, type):
        return None
    if isinstance(obj, Stub):
        state = obj.state if isinstance(obj.state, dict) else {}
        if "_content" in state:  # DictConfig / ListConfig
            return plain(state["_content"])
        if "_val" in state:  # a value node
            return plain(state["_val"])
        if obj.items:
            return plain(obj.items)
        if obj.values:
            return plain(obj.values)
        if len(obj.args) == 1 and not isinstance(obj.args[0], Stub):  # an enum member: Enum(value)
            return plain(obj.args[0])
        return None
    return obj


__all__ = ["ALLOWED", "STUB_MODULES", "Stub", "UnsafeCheckpoint", "load_checkpoint", "plain", "refusal", "stubbable"]
