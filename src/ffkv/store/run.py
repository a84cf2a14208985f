"""The run directory: one per model and corpus, readable without ffkv (SPEC section 10).

Layout (the public contract is docs/run-directory.md):

    RUN/manifest.json              what was run, on what, with which versions; status
    RUN/examples.parquet           example_id, token_ids, text
    RUN/trigger_examples.parquet   layer, key, rank, coefficient, example_id, position, next_token_id
    RUN/metrics/, RUN/figures/     written by `ffkv analyze`
    RUN/.partial/                  checkpoints of an unfinished run (removed when complete)
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

from ffkv.errors import FfkvError
from ffkv.store import atomic

FORMAT_VERSION = 1


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour shapes the results."""
    import numpy
    import pyarrow
    import torch
    import transformers

    import ffkv

    return {
        "ffkv": ffkv.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
    }


class RunDir:
    """A run directory on disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def partial(self) -> Path:
        """Folder for checkpoints and table parts of an unfinished run."""
        return self.path / ".partial"

    def table(self, name: str) -> Path:
        """Path of a top-level table, e.g. ``table('examples')``."""
        return self.path / f"{name}.parquet"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict[str, Any]:
        """The manifest, or a clear error when this is not a run directory."""
        if not self.manifest_path.exists():
            raise FfkvError(f"{self.path} is not an ffkv run directory (no manifest.json); run `ffkv index` first")
        try:
            return json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FfkvError(f"cannot read {self.manifest_path}: {exc}") from None

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        atomic.write_json(self.manifest_path, manifest)

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        """Read, update top-level fields, write back atomically."""
        manifest = self.manifest()
        manifest.update(fields)
        self.write_manifest(manifest)
        return manifest

    def require_complete(self) -> dict[str, Any]:
        """The manifest of a finished index, or an error saying what to do."""
        manifest = self.manifest()
        if manifest.get("status") != "complete":
            raise FfkvError(
                f"run {self.path} is not complete (status {manifest.get('status')!r}); "
                "finish it with `ffkv index ... --resume`"
            )
        return manifest

    def prepare(self, identity: dict[str, Any], resume: bool) -> dict[str, Any] | None:
        """Check that the folder can hold this run; return the existing manifest when resuming.

        Raises a clear error for a folder that holds a different run, a finished run,
        an interrupted run without ``--resume``, or other files.
        """
        if self.path.exists() and not self.path.is_dir():
            raise FfkvError(f"output path {self.path} is a file; give a directory for the run")
        if not self.exists():
            if resume:
                raise FfkvError(f"nothing to resume in {self.path}: no run was started there")
            if self.path.exists() and any(self.path.iterdir()):
                raise FfkvError(f"output directory {self.path} is not empty and holds no ffkv run; choose a new --out")
            return None
        manifest = self.manifest()
        if manifest.get("identity") != identity:
            raise FfkvError(
                f"output directory {self.path} holds a different run (other model, corpus or options); "
                "choose a new --out"
            )
        if manifest.get("status") == "complete":
            raise FfkvError(f"output directory {self.path} already holds this run, complete; nothing to do")
        if not resume:
            raise FfkvError(
                f"output directory {self.path} holds an interrupted run of the same job; "
                "add --resume to continue it, or choose a new --out"
            )
        return manifest


__all__ = ["RunDir", "FORMAT_VERSION", "library_versions"]
