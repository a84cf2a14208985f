"""The run's model for the explorer: loaded in the background, so the first page answers before it is ready.

`ffkv serve` starts the load right after its first response (`start`), so that importing torch
and reading the weights do not compete with that response for the CPU; a page that needs the
model first starts it itself and waits in `get`. Pages that read only the run's tables (the
overview, figures, files) never wait. Hooks live on the model, so everything that runs it
holds `ModelHandle.lock` (one forward at a time).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ffkv.explorer.validation import BadRequest


def load_run_model(run_dir: str | Path):
    """The model a complete run was indexed with, loaded as the manifest names it."""
    from ffkv.models.loading import load_model
    from ffkv.store.run import RunDir

    model = RunDir(run_dir).require_complete().model
    return load_model(model.id, dtype=model.dtype)


class ModelHandle:
    """A run's `LoadedModel`, given, or loaded by a background thread (`start`, or the first `get`).

    Args:
        run_dir: the run whose manifest names the model.
        loaded: the model, already loaded (then nothing is loaded).
    """

    def __init__(self, run_dir: str | Path, loaded: Any = None) -> None:
        self.lock = threading.Lock()
        self._run_dir = run_dir
        self._loaded = loaded
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._started = loaded is not None
        self._start_lock = threading.Lock()
        self._after_load: list = []
        if loaded is not None:
            self._ready.set()

    def after_load(self, function) -> None:
        """Run `function()` in the loading thread once the model is loaded there (warming what the first pages
        need); nothing when the model was given. Its errors are ignored: the pages compute what it would have."""
        self._after_load.append(function)

    def start(self) -> None:
        """Start loading the model in a background thread (once; later calls do nothing)."""
        with self._start_lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._load, args=(self._run_dir,), name="ffkv-model", daemon=True).start()

    def _load(self, run_dir: str | Path) -> None:
        try:
            self._loaded = load_run_model(run_dir)
        except BaseException as exc:  # noqa: BLE001 - reported to every page that needs the model
            self._error = exc
        finally:
            self._ready.set()
        for function in self._after_load if self._error is None else ():
            try:
                function()
            except Exception:  # noqa: BLE001 - a warm-up only
                pass

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def get(self):
        """The loaded model (starts the load if need be, and waits for it); a 503 page when it could not be loaded."""
        self.start()
        self._ready.wait()
        if self._error is not None:
            raise BadRequest(f"the run's model could not be loaded ({type(self._error).__name__}: "
                             f"{str(self._error)[:300]}); pages that need it are unavailable", 503)
        return self._loaded
