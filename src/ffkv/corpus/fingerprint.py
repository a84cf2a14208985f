"""A fingerprint of a corpus for the run manifest: the same content read the same way?

A corpus is known by what it holds, not by where it lies: the digest covers every
byte of every source file (with, for a folder, each file's path inside it, which
fixes the reading order), each file's format, and the options that cut it into
examples, but not the source path itself. A relative and an absolute path to one
corpus, or a copy of it elsewhere, give the same fingerprint; a changed byte does not.
Reading the whole corpus costs a few seconds per GB, a small share of indexing it,
and shows progress when it is large.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tqdm.auto import tqdm

from ffkv.corpus.sources import is_hf, source_files
from ffkv.corpus.spec import CorpusSpec
from ffkv.errors import FfkvError

READ_BYTES = 1 << 20
#: Corpora larger than this show a progress bar while they are hashed.
PROGRESS_BYTES = 256 << 20


def fingerprint(spec: CorpusSpec, progress: bool = True) -> str:
    """sha256 hex digest over the corpus content, file formats and the spec's options (not its source)."""
    digest = hashlib.sha256()
    options = {k: v for k, v in spec.to_dict().items() if k != "source"}
    digest.update(json.dumps(options, sort_keys=True).encode())
    if is_hf(spec):
        digest.update(spec.source.encode())  # a hub dataset is named by its id, config and split
        return digest.hexdigest()
    root = Path(spec.source).expanduser()
    files = source_files(spec)
    try:
        total = sum(source.path.stat().st_size for source in files)
        with tqdm(total=total, unit="B", unit_scale=True, desc="corpus fingerprint", leave=False,
                  disable=not progress or total < PROGRESS_BYTES) as bar:
            for source in files:
                inside = source.path.relative_to(root).as_posix() if root.is_dir() else ""
                digest.update(f"\0{inside}\0{source.format}\0{source.path.stat().st_size}\0".encode())
                with open(source.path, "rb") as handle:
                    while chunk := handle.read(READ_BYTES):
                        digest.update(chunk)
                        bar.update(len(chunk))
    except OSError as error:
        raise FfkvError(f"corpus file {error.filename or spec.source} cannot be read ({error.strerror}): "
                        "check its permissions") from error
    return digest.hexdigest()
