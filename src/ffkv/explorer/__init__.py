"""The explorer: a local web app over a run directory, and the same views inline in notebooks.

`serve(run_dir)` starts it; `create_app(run_dir, loaded)` builds the app (tests, embedding);
notebooks reach the same views through `ffkv.open_run(path).memory(layer, key)` / `.trace(prompt)`.
Imports are lazy so that `import ffkv.explorer` costs nothing without the web dependencies.
"""

from __future__ import annotations

__all__ = ["serve", "create_app", "ExplorerData"]


def __getattr__(name: str):
    if name in ("serve", "create_app"):
        from ffkv.explorer import app

        return getattr(app, name)
    if name == "ExplorerData":
        from ffkv.explorer.data import ExplorerData

        return ExplorerData
    raise AttributeError(f"module 'ffkv.explorer' has no attribute {name!r}")
