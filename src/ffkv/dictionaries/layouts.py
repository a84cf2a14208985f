"""`open_dictionary`: which layout a path is, and a model's dictionaries read from it.

A path may be one dictionary (a sparsify hookpoint folder, a SAELens folder, an ``.npz`` file) or a
folder of them (sparsify's run folder of hookpoint folders, or any folder whose sub-folders and ``.npz``
files are dictionaries). The result is a plain ``dict[int, Dictionary]``: FF layer -> its dictionary.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ffkv.dictionaries import npz_layout, saelens_layout, sparsify_layout
from ffkv.dictionaries.dictionary import Dictionary
from ffkv.errors import FfkvError, one_line
from ffkv.store.integrity import Problem

LAYOUTS = ("sparsify", "saelens", "npz")


def layout_of(path: Path) -> str | None:
    """The layout of one dictionary at `path` ("sparsify", "saelens" or "npz"), or None if `path` is not one
    (a folder of them, or something else). A folder with a ``cfg.json`` but no weights file is refused.

    What is there is told by its name, whatever kind of file it is: a FIFO named ``cfg.json`` or ``x.npz`` makes
    a dictionary whose reader then refuses it, rather than a folder without one."""
    if not path.is_dir():
        return "npz" if path.suffix == ".npz" else None
    sparsify, saelens = _there(path / sparsify_layout.WEIGHTS), _there(path / saelens_layout.WEIGHTS)
    if sparsify and saelens:
        raise FfkvError(f"{path}: holds both {sparsify_layout.WEIGHTS} (sparsify) and {saelens_layout.WEIGHTS} "
                        f"(SAELens): open one of them from a folder of its own")
    if sparsify or saelens:
        return "sparsify" if sparsify else "saelens"
    if _there(path / sparsify_layout.CONFIG):
        raise FfkvError(f"{path}: holds {sparsify_layout.CONFIG} but no weights: expected {sparsify_layout.WEIGHTS} "
                        f"(sparsify) or {saelens_layout.WEIGHTS} (SAELens) beside it")
    return None


def _there(path: Path) -> bool:
    """Whether anything is at `path` (a file of any kind, or a symlink, even a broken one)."""
    return path.is_symlink() or path.exists()


def read_one(path: Path, *, kind: str | None = None, layer: int | None = None,
             hookpoint: str | None = None) -> Dictionary:
    """The one dictionary at `path`, in whichever layout it is. `hookpoint` stands in for the one the files
    name (sparsify: the folder's name; SAELens: ``hook_name``); `kind` and `layer` are for an ``.npz`` that
    does not say them (Gemma Scope's)."""
    layout = layout_of(path)
    if layout is None:
        raise FfkvError(f"{path}: not a dictionary ffkv reads (a sparsify folder with {sparsify_layout.WEIGHTS}, "
                        f"a SAELens folder with {saelens_layout.WEIGHTS}, or an .npz file)")
    if layout == "npz":
        return npz_layout.read_npz_dictionary(path, kind=kind, layer=layer, hookpoint=hookpoint)
    if kind is not None or layer is not None:
        raise FfkvError(f"{path}: kind= and layer= are for an .npz file; a {layout} folder says them itself")
    reader = sparsify_layout.read_sparsify if layout == "sparsify" else saelens_layout.read_saelens
    return reader(path, hookpoint)


def open_dictionary(path: str | Path, *, kind: str | None = None, layer: int | None = None,
                    hookpoint: str | None = None) -> dict[int, Dictionary]:
    """A model's sparse dictionaries from `path`, by FF layer: one dictionary, or a folder of them (each
    sub-folder or ``.npz`` file that is one; other files are left alone).

    Every file read is recorded in each dictionary's `source` (path, layout, sha256, architecture,
    hookpoint, and which site the keys read and the values write). A damaged or unsupported file, or two
    dictionaries for one layer, is refused with one line (`FfkvError`) that names the file. `kind`,
    `layer` and `hookpoint` describe a single dictionary (see `read_one`).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FfkvError(f"{path}: no such file or folder")
    if layout_of(path) is not None:
        one = read_one(path, kind=kind, layer=layer, hookpoint=hookpoint)
        return {one.layer: one}
    if any(v is not None for v in (kind, layer, hookpoint)):
        raise FfkvError(f"{path}: a folder of dictionaries; kind=, layer= and hookpoint= describe one dictionary "
                        f"(open its own folder or file)")
    found: dict[int, Dictionary] = {}
    for child in sorted(path.iterdir()) if path.is_dir() else []:
        if child.name.startswith(".") or layout_of(child) is None:
            continue
        one = read_one(child)
        if one.layer in found:
            raise FfkvError(f"{child}: a second dictionary for FF layer {one.layer} (the first is "
                            f"{found[one.layer].source['path']}): open the one you mean")
        found[one.layer] = one
    if not found:
        raise FfkvError(f"{path}: holds no dictionary ffkv reads (sparsify hookpoint folders with "
                        f"{sparsify_layout.WEIGHTS}, SAELens folders with {saelens_layout.WEIGHTS}, or .npz files)")
    return dict(sorted(found.items()))


def reopen(recorded: Mapping[str, Mapping[str, Any]], where: str | Path | None = None) -> dict[int, Dictionary]:
    """The dictionaries a run was indexed with, read again from their files and checked to be the same files.

    Args:
        recorded: what the run's manifest records of them (``index.dictionary``): FF layer -> the dictionary's
            `source` (path, layout, sha256 of each file, hookpoint, ...) with its kind.
        where: where they lie now, if they moved (any path `open_dictionary` reads); default: the recorded paths.

    Raises:
        FfkvError: in one line naming the file: a dictionary gone or unreadable, a layer `where` lacks, or a
            file whose sha256 is not the one recorded (another dictionary: the run's latent tables are not its).
    """
    found = open_dictionary(where) if where is not None else None
    out: dict[int, Dictionary] = {}
    for key, record in sorted(recorded.items(), key=lambda item: int(item[0])):
        layer, path = int(key), record.get("path")
        if found is not None:
            if layer not in found:
                raise FfkvError(f"{where}: holds no dictionary for FF layer {layer + 1} (counted from 1), which the "
                                f"run was indexed with")
            one = found[layer]
        elif path is None:
            raise FfkvError(f"the run's dictionary of FF layer {layer + 1} was built in memory, not read from files: "
                            f"name the files it was saved to (--dictionary PATH)")
        elif not Path(path).exists():
            raise FfkvError(f"{path}: the dictionary this run was indexed with is gone; name where it lies now "
                            f"(--dictionary PATH)")
        else:
            npz = record.get("layout") == "npz"
            one = read_one(Path(path), hookpoint=record.get("hookpoint"), kind=record.get("kind") if npz else None,
                           layer=layer if npz else None)
        if dict(one.source.get("sha256", {})) != dict(record.get("sha256", {})):
            raise FfkvError(f"{one.source.get('path')}: not the dictionary this run was indexed with (its files' "
                            f"sha256 differ from those the manifest records): its latent tables are not this "
                            f"dictionary's")
        out[layer] = one
    return out


def file_problems(recorded: Mapping[str, Mapping[str, Any]], verify: bool = False) -> list[Problem]:
    """What `ffkv status` says of the dictionaries a run was indexed with (`recorded`: its manifest's
    ``index.dictionary``): each one whose files are gone, and with `verify` (``--verify``) each that cannot be read
    again as the one indexed (`reopen`: its files read and hashed against the record). A dictionary built in memory,
    with no files, is not checked."""
    fix = ("name where it lies now with --dictionary PATH (analyze, serve, intervene), or put it back where the "
           "run records it")
    found = []
    for key, record in sorted(recorded.items(), key=lambda item: int(item[0])):
        path = record.get("path")
        if path is None:
            continue
        about = f"the sparse dictionary of FF layer {int(key) + 1} the run was indexed with"
        if not Path(path).exists():
            found.append(Problem(str(path), "missing", about, fix))
        elif verify:
            try:
                reopen({key: record})
            except FfkvError as error:
                found.append(Problem(str(path), "damaged", f"{about}: {one_line(error)}", fix))
    return found
