"""Notebook objects: a memory and a trace that render inline in Jupyter as the explorer's HTML.

    from ffkv.explorer import Explorer
    ex = Explorer("runs/gpt2", loaded)        # loaded: optional, else the run's model is loaded
    ex.memory(3, 17)                           # shows the memory page's content
    ex.trace("The capital of France is", off=[(11, 2048)])
"""

from __future__ import annotations

from pathlib import Path

from ffkv.explorer import pages, validation
from ffkv.explorer.data import ExplorerData
from ffkv.explorer.tracing import TraceResult, max_prompt_tokens, trace


class Memory:
    """Memory (layer, key) of a run; `_repr_html_` is the explorer's memory page content."""

    def __init__(self, data: ExplorerData, layer: int, key: int, root: str) -> None:
        self.layer, self.key = data.check(layer, key)
        self._data, self._root = data, root
        self.info = data.memory(self.layer, self.key)

    def _repr_html_(self) -> str:
        return pages.memory_fragment(self._data, self.layer, self.key, self._root, standalone=True)

    def __repr__(self) -> str:
        return f"Memory(layer={self.layer}, key={self.key}, top_token={self.info['top_token']!r})"


class Trace:
    """A prompt traced through the memories, with optional interventions shown beside the original."""

    def __init__(self, data: ExplorerData, prompt: str, base: TraceResult, edited: TraceResult | None,
                 root: str) -> None:
        self.prompt, self.base, self.edited = prompt, base, edited
        self._data, self._root = data, root

    def _repr_html_(self) -> str:
        return pages.trace_fragment(self._data, self.base, self.edited, self._root, standalone=True)

    def __repr__(self) -> str:
        final = self._data.token(self.base.final[0].token_id)
        return f"Trace({self.prompt[:40]!r}, prediction={final!r}, edits={len(self.base.edits or {}) + len(getattr(self.edited, 'edits', {}) or {})})"


class Explorer:
    """A run opened for a notebook; links in the HTML point to `root` (where `ffkv serve` runs)."""

    def __init__(self, run_dir: str | Path, loaded=None, root: str = "http://127.0.0.1:8000") -> None:
        if loaded is None:
            from ffkv.explorer.app import load_run_model

            loaded = load_run_model(run_dir)
        self.data = ExplorerData(run_dir, loaded, progress=True)
        self.root = root.rstrip("/")

    def memory(self, layer: int, key: int) -> Memory:
        return Memory(self.data, layer, key, self.root)

    def trace(self, prompt: str, off=(), scale: dict | None = None) -> Trace:
        """Trace a prompt; `off` lists (layer, key) to switch off, `scale` maps (layer, key) to a factor."""
        prompt = validation.prompt(prompt)
        token_ids = list(self.data.loaded.tokenizer.encode(prompt))
        limit = max_prompt_tokens(self.data.loaded)
        if not token_ids or len(token_ids) > limit:
            raise validation.BadRequest(f"the prompt must give 1 to {limit} tokens, got {len(token_ids)}", 413)
        edits = {}
        for (layer, key), factor in dict(scale or {}).items():
            edits[self.data.check(layer, key)] = validation.scale(factor, f"{layer}:{key}")
        for layer, key in off:
            edits[self.data.check(layer, key)] = 0.0
        edits = {k: v for k, v in edits.items() if v != 1.0}
        base = trace(self.data.loaded, token_ids)
        edited = trace(self.data.loaded, token_ids, edits) if edits else None
        return Trace(self.data, prompt, base, edited, self.root)
