"""A fingerprint of a corpus for the run manifest: did the source or the options change?

Cheap by design: it hashes each file's path, size and modification time and its
first and last MiB, not the whole corpus, and the spec's options.
"""

from __future__ import annotations

import hashlib
import json

from ffkv.corpus.sources import is_hf, source_files
from ffkv.corpus.spec import CorpusSpec
from ffkv.errors import FfkvError

EDGE_BYTES = 1 << 20


def fingerprint(spec: CorpusSpec) -> str:
    """sha256 hex digest over the source files' sizes, mtimes, first/last MiB, and the spec."""
    digest = hashlib.sha256()
    digest.update(json.dumps(spec.to_dict(), sort_keys=True).encode())
    if is_hf(spec):
        return digest.hexdigest()  # a hub dataset is named by its id, config and split
    root = spec.source
    for source in source_files(spec):
        try:
            stat = source.path.stat()
            digest.update(f"\0{source.path.as_posix()}\0{source.format}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
            with open(source.path, "rb") as handle:
                digest.update(handle.read(EDGE_BYTES))
                if stat.st_size > EDGE_BYTES:
                    handle.seek(max(EDGE_BYTES, stat.st_size - EDGE_BYTES))
                    digest.update(handle.read(EDGE_BYTES))
        except OSError as error:
            raise FfkvError(f"corpus file {source.path} under {root} cannot be read ({error.strerror}): "
                            "check its permissions") from error
    return digest.hexdigest()
