"""The explorer's lookup tables in RUN/explorer/: their names, what they were built from, whether they are current.

`ffkv analyze` builds them (`ffkv.experiments.lookups`); the explorer only reads them, and
builds them itself only for a run that was never analysed (docs/run-directory.md, "explorer/"):

    info.json                  what the tables were built from (written last: the tables are whole)
    key_stats.parquet          one row per (layer, key): value statistics, activation frequency and
                               histogram over a corpus sample, the trigger prefixes' common last token
    value_top_tokens.parquet   layer, key, rank, token_id, prob: each value's top tokens (identity)
    explorer.duckdb            the trigger examples in (layer, key) order and in example order, and the texts
                               of their examples
    trigger_coefficients.npy   each trigger example's per-token coefficients (`ffkv.experiments.trigger_contexts`;
                               absent for an index too large to store them)

A run indexed with a sparse dictionary (``--dictionary``: latent_trigger_examples.parquet) also gets its latents'
tables (`ffkv.experiments.latent_lookups`; nothing of them for a run without):

    latent_stats.parquet                one row per (layer, latent): `LATENT_STATS`' columns
    latent_value_top_tokens.parquet     layer, key (the latent), rank, token_id, prob: each decoder row's top tokens
    latent_trigger_coefficients.npy     each latent trigger example's per-token activations
    explorer.duckdb                     also latent_triggers and latent_triggers_by_example (the texts of their
                                        examples in texts)

The tables are current when info.json names this run's identity and the size and time of
its index tables, and each file has the size it had when built; any new index (or a newer
format of these tables) makes them stale, and a damaged one is rebuilt. info.json's ``files``
records each file as the run's manifest records a figure (`ffkv.store.integrity.describe_file`: size,
SHA-256); `verify` (`ffkv status --verify`) hashes them, so that a file edited in place is named.
Tables built before the hashes were recorded (``sizes`` alone) still read, and are checked by size.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ffkv.errors import DamagedRun
from ffkv.store import atomic, integrity
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

#: Bumped when what the tables hold changes; older tables are rebuilt (3: activation_frequency follows the signed
#: active rule, was m > 0; 4: explorer.duckdb holds triggers_by_example and no ART index on the triggers,
#: trigger coefficients stored, activation statistics on the robust scale that leaves massive activations out;
#: 6: activation_frequency with the run's s_l, of the held-out examples, not the sample's; common_last_token_id's
#: ties to the lowest id; 7: explorer.duckdb's m_start: a real model's index stores the
#: coefficients of a window around each trigger when its whole examples would not fit; 8: that window narrowed to
#: fit rather than none stored, `trigger_contexts.window_for`).
VERSION = 9
FILES = ("explorer.duckdb", "key_stats.parquet", "value_top_tokens.parquet")
#: Per-token coefficients of the trigger examples (np.save format, no pickle), when the index was small enough.
COEFFICIENTS = "trigger_coefficients.npy"
#: The latents' tables, built only for a run that holds latents (`has_latents`).
LATENT_FILES = ("latent_stats.parquet", "latent_value_top_tokens.parquet")
#: Per-token activations of the latents' trigger examples (as `COEFFICIENTS`; info.json's
#: ``latent_trigger_coefficients`` describes it).
LATENT_COEFFICIENTS = "latent_trigger_coefficients.npy"
#: Every file info.json may record.
ALL_FILES = (*FILES, COEFFICIENTS, *LATENT_FILES, LATENT_COEFFICIENTS)
INFO = "info.json"
#: The command that writes the tables again, for a refusal that cannot name the run.
REBUILD = "rebuild it with `ffkv analyze RUN --only lookups`"


def has_latents(run: RunDir, manifest: Manifest) -> bool:
    """Whether the run was indexed with a sparse dictionary whose latents it holds (its manifest records the
    dictionary and latent_trigger_examples.parquet exists): its lookups then include `LATENT_FILES`."""
    return bool(manifest.index.get("dictionary")) and run.table("latent_trigger_examples").is_file()


def fingerprint(run: RunDir, manifest: Manifest) -> dict[str, Any]:
    """What the tables of a run are built from: its identity and its index tables' size and time (the latents'
    trigger table too, for a run that holds latents: a run without them keeps the fingerprint it always had)."""
    files = {}
    for name in ("trigger_examples", "examples") + (("latent_trigger_examples",) if has_latents(run, manifest) else ()):
        st = run.table(name).stat()
        files[name] = [st.st_size, st.st_mtime_ns]
    return {"version": VERSION, "identity": manifest.identity.to_dict(), "files": files}


def is_current(run: RunDir, manifest: Manifest, folder: Path) -> bool:
    """Whether `folder` holds every lookup table, built from exactly this run's index (and the latents' tables,
    for a run that holds latents)."""
    info = folder / INFO
    needed = FILES + (LATENT_FILES if has_latents(run, manifest) else ())
    if not info.exists() or not all((folder / name).exists() for name in needed):
        return False
    try:
        recorded = json.loads(info.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    if not isinstance(recorded, dict) or recorded.get("fingerprint") != fingerprint(run, manifest):
        return False
    # tables built before their sizes were recorded are taken as they are; a recorded file that is gone is stale
    return all((folder / name).is_file() and (folder / name).stat().st_size == record.get("size")
               for name, record in _records(recorded).items())


def _records(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """info.json's record of each lookup file (`integrity.describe_file`); from the ``sizes`` of an older build."""
    files = info.get("files")
    if isinstance(files, dict):
        return {str(name): dict(record) for name, record in files.items()
                if name in ALL_FILES and isinstance(record, dict)}
    sizes = info.get("sizes") or {}
    return {name: {"size": size} for name, size in sizes.items() if name in FILES}


def file_record(info: dict[str, Any], name: str) -> dict[str, Any] | None:
    """info.json's record of the lookup file `name` (size, SHA-256: `integrity.describe_file`), or None."""
    return _records(info).get(name)


def read_info(folder: Path) -> dict[str, Any]:
    """info.json of a folder of lookup tables (empty when absent or unreadable)."""
    try:
        return json.loads((folder / INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_info(run: RunDir, manifest: Manifest, folder: Path, **details: Any) -> None:
    """Mark the tables in `folder` as built for this run's index; call after every table is written. Each file is
    recorded (size, SHA-256: a truncated one is rebuilt, one edited in place is named by `verify`)."""
    files = {name: integrity.describe_file(folder / name, "lookups")
             for name in ALL_FILES if (folder / name).is_file()}
    atomic.write_json(folder / INFO, {"fingerprint": fingerprint(run, manifest), "files": files, **details})


def verify(run: RunDir) -> list[integrity.Problem]:
    """The lookup files of RUN/explorer whose bytes are not those its info.json records (SHA-256; a build without
    hashes is checked by size), each with the command that rebuilds them."""
    fix = f"rebuild them with `ffkv analyze {run.path} --only lookups`"
    found = []
    for name, record in _records(read_info(run.cache_dir)).items():
        issue = integrity.file_problem(run.path, f"{run.cache_dir.name}/{name}", record, fix, verify=True)
        if issue is not None:
            found.append(issue)
    return found


def writable_folder(run: RunDir) -> Path:
    """RUN/explorer when it can be written, else a new temporary folder (a read-only run directory)."""
    folder = run.cache_dir
    try:
        folder.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe", delete=True):
            pass
        return folder
    except OSError:
        return Path(tempfile.mkdtemp(prefix="ffkv-explorer-"))


def find(run: RunDir, manifest: Manifest) -> Path | None:
    """The folder holding current lookup tables of a run (RUN/explorer), or None when they must be built."""
    folder = run.cache_dir
    return folder if folder.is_dir() and os.access(folder, os.R_OK) and is_current(run, manifest, folder) else None


def read_coefficients(folder: Path, info: dict[str, Any], fix: str = REBUILD, latents: bool = False) -> Any:
    """The trigger examples' per-token coefficients (a memory-mapped 1-D float16 or float32 numpy array), or None
    when the build stored none (info.json's ``trigger_coefficients.file`` is null); with `latents`, the latents'
    (`LATENT_COEFFICIENTS`, described by ``latent_trigger_coefficients``).

    The file must be the one info.json records: its size and SHA-256 (`integrity.file_problem`, about 0.2 s for
    100 MB; a build from before info.json recorded hashes, by its shape alone), and a 1-D array of the recorded
    ``dtype`` and ``cells``; a page never reads coefficients that differ from those written.

    Args:
        fix: the command that writes the file again, for the refusal's line.

    Raises:
        DamagedRun: naming the file and `fix`: missing, another size or other bytes, not a .npy array, or not the
            array info.json describes.
    """
    import numpy as np

    name = LATENT_COEFFICIENTS if latents else COEFFICIENTS
    described = info.get("latent_trigger_coefficients" if latents else "trigger_coefficients") or {}
    if described.get("file") is None:
        return None
    path = folder / name
    if described.get("file") != name:
        raise DamagedRun(f"{folder / INFO} is damaged (it names the coefficient file {str(described['file'])[:60]!r}, "
                         f"not {name}): {fix}")
    if isinstance(info.get("files"), dict):  # a build that records hashes; an older one's is checked by its shape
        record = _records(info).get(name)
        if record is None or not record.get("sha256"):
            raise DamagedRun(f"{path} is damaged (info.json records no size and SHA-256 for it): {fix}")
        found = integrity.file_problem(folder, name, record, fix, verify=True)
        if found is not None:
            raise DamagedRun(found.line(folder))
    elif not path.is_file():
        raise DamagedRun(f"{path} is missing: {fix}")
    try:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as error:
        raise DamagedRun(f"{path} is damaged (not a NumPy .npy array: {str(error)[:80]}): {fix}") from None
    expected = f"{described.get('cells')} {described.get('dtype')} values"
    if data.ndim != 1 or data.dtype.name != described.get("dtype") or len(data) != described.get("cells"):
        raise DamagedRun(f"{path} is damaged (an array of shape {data.shape} and dtype {data.dtype.name}; info.json "
                         f"records {expected}): {fix}")
    return data


__all__ = ["VERSION", "FILES", "COEFFICIENTS", "LATENT_FILES", "LATENT_COEFFICIENTS", "ALL_FILES", "has_latents", "file_record", "REBUILD", "read_coefficients", "fingerprint", "is_current", "read_info",
           "verify", "write_info", "writable_folder", "find"]
