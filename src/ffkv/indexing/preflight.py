"""Checks `ffkv index` makes before it writes anything, so a run that cannot finish stops at once.

Sequence length against the model's positions (`fit_positions`), an output folder it
can write (`check_output`), and free disk against an estimate of the run's size
(`check_free_space`). The options themselves are checked by `IndexOptions.validate`
and `BatchOptions.validate`, the device by `ffkv.models.load_model`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from ffkv.corpus import CorpusSpec
from ffkv.corpus.spec import DEFAULT_MAX_TOKENS
from ffkv.corpus.sources import is_hf, source_files
from ffkv.errors import FfkvError, StorageError
from ffkv.models.loading import LoadedModel

#: Bytes per top-k entry in the checkpoint: coefficient f32, example id i64, position and next token i32.
CHECKPOINT_ENTRY_BYTES = 20
#: Bytes per trigger row in trigger_examples.parquet, a lower bound (zstd compresses ids and ranks well).
TABLE_ENTRY_BYTES = 8
#: examples.parquet per byte of corpus text, a lower bound (text plus int32 token ids, compressed).
EXAMPLE_BYTES_PER_CORPUS_BYTE = 0.5


def fit_positions(loaded: LoadedModel, spec: CorpusSpec, strict: bool = False) -> CorpusSpec:
    """The spec with `max_tokens` no longer than the model's positions, or an error at once.

    A longer `max_tokens` would fail at the first long example, perhaps hours in. The
    default (`DEFAULT_MAX_TOKENS`, "512 or the model's positions, whichever is less") is
    cut to the model's length, and the run records the cut value; any other value above it
    is an error naming --max-tokens, as is the default itself with `strict` (the user typed it).
    """
    limit = loaded.max_positions
    if limit is None or spec.max_tokens <= limit:
        return spec
    if strict or spec.max_tokens != DEFAULT_MAX_TOKENS:
        raise FfkvError(f"--max-tokens {spec.max_tokens} is more than the {limit} positions of model "
                        f"{loaded.model_id}: give --max-tokens {limit} or less")
    if spec.unit == "window" and spec.window > limit:
        raise FfkvError(f"--window {spec.window} is more than the {limit} positions of model "
                        f"{loaded.model_id}: give --window {limit} or less")
    return replace(spec, max_tokens=limit)


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(path: Path) -> None:
    """Refuse an output path that is a file or lies in a folder this process cannot write."""
    if path.exists() and not path.is_dir():
        raise FfkvError(f"output path {path} is a file; give a directory for the run")
    folder = _existing(path)
    if not os.access(folder, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        raise StorageError(f"cannot write the run into {folder} "
                        f"({'read-only file system' if read_only else 'permission denied'}): choose another --out")


def estimate_bytes(loaded: LoadedModel, spec: CorpusSpec, per_key: int, control_keys: int = 0,
                   latent_entries: int = 0) -> int:
    """A lower bound of the disk a run needs at its peak: the checkpoint, the trigger tables (the model's
    keys and their random control), and the examples twice (parts and the assembled table coexist for a moment).

    Args:
        per_key: trigger entries kept per key (top-k times the directions kept).
        control_keys: random control memories per layer.
        latent_entries: trigger slots of a dictionary's latents and control latents (`ffkv.memories.latent_keys`),
            counted in the checkpoint only: their tables keep only the entries where a latent fired.
    """
    view = loaded.view
    entries = view.n_layers * (view.d_m + control_keys) * per_key
    corpus = 0
    if not is_hf(spec) and spec.max_examples is None:  # a subset's share of the files is unknown
        corpus = sum(source.path.stat().st_size for source in source_files(spec))
    return int(entries * (CHECKPOINT_ENTRY_BYTES + TABLE_ENTRY_BYTES) + latent_entries * CHECKPOINT_ENTRY_BYTES
               + 2 * EXAMPLE_BYTES_PER_CORPUS_BYTE * corpus)


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


def check_free_space(path: Path, need: int) -> None:
    """Refuse a run that cannot fit on the disk of `path` (what the folder already holds counts as room)."""
    folder = _existing(path)
    free = shutil.disk_usage(folder).free
    if path.is_dir():
        free += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    if free < need:
        raise StorageError(f"the run needs at least {_size(need)} on disk but {folder} has {_size(free)} free: "
                        "free space, or choose another --out")


__all__ = ["check_free_space", "check_output", "estimate_bytes", "fit_positions"]
