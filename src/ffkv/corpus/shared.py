"""Where the shared real-data folder is (WikiText, tokenizers), for tests and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path


def shared_data_dir() -> Path | None:
    """``$FFKV_SHARED_DATA``, else ``<repo>/../shared/data``; None when neither exists.

    When the variable is set it is the only place looked at, so a test run can point
    elsewhere or (set to a missing path) pretend no data is present.
    """
    configured = os.environ.get("FFKV_SHARED_DATA")
    if configured:
        path = Path(configured).expanduser()
        return path if path.is_dir() else None
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file():
            candidate = parent.parent / "shared" / "data"
            return candidate if candidate.is_dir() else None
    return None
