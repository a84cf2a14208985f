"""Notebook objects: a memory and a trace that render inline in Jupyter as the explorer's HTML.

`ffkv.open_run(path).memory(layer, key)` and `.trace(prompt)` return them (`ffkv.api`);
layers are 0-based in code, as in the run's tables, and shown counted from 1.
"""

from __future__ import annotations

from typing import Iterable

from ffkv.errors import FfkvError
from ffkv.explorer import pages, validation
from ffkv.explorer.data import ExplorerData
from ffkv.explorer.tracing import LENSES, TraceResult, generate, max_prompt_tokens, trace
from ffkv.memories.interventions import Intervention, NonFiniteOutput
from ffkv.memories.projection import DEFAULT_FOR_RESIDUALS, TRANSLATOR
from ffkv.memories.translators import Translators


class Memory:
    """Memory (layer, key) of a run (0-based layer); `_repr_html_` is the explorer's memory page content."""

    def __init__(self, data: ExplorerData, layer: int, key: int, root: str = "", projection: str | None = None,
                 shown: str = "p") -> None:
        self.layer = validation.integer(layer, "layer index", 0, data.n_layers - 1)
        self.key = validation.integer(key, "key", 0, data.d_m - 1)
        self.projection, self.shown = projection, shown
        self._data, self._root = data, root

    def _repr_html_(self) -> str:
        return pages.memory_fragment(self._data, self.layer, self.key, self._root, standalone=True,
                                     projection=self.projection, shown=self.shown)

    def to_dict(self) -> dict:
        """The memory as the explorer's JSON export gives it."""
        return pages.memory_json(self._data, self.layer + 1, self.key, self.projection, self._root, self.shown)

    def __repr__(self) -> str:
        top = self._data.token(int(self._data.key_stats.loc[(self.layer, self.key), "top_token_id"]))
        return f"Memory(layer={self.layer}, key={self.key}, top_token={top!r})"


class Trace:
    """A prompt traced through the memories at one position, with interventions shown beside the original
    and, when asked for, the greedy continuation with and without them."""

    def __init__(self, data: ExplorerData, prompt: str, base: TraceResult, edited: TraceResult | None,
                 root: str = "", generation: dict | None = None) -> None:
        self.prompt, self.base, self.edited, self.generation = prompt, base, edited, generation
        self._data, self._root = data, root

    def _repr_html_(self) -> str:
        return pages.trace_fragment(self._data, self.base, self.edited, self._root, standalone=True,
                                    generation=self.generation)

    def __repr__(self) -> str:
        final = self._data.token(self.base.final[0].token_id)
        edits = len(self.edited.edits) + len(self.edited.latent_edits) if self.edited is not None else 0
        return f"Trace({self.prompt[:40]!r}, position={self.base.position}, prediction={final!r}, edits={edits})"


def run_trace(data: ExplorerData, prompt: str, position: int = -1, target: str | int | None = None,
              edits: Iterable[Intervention] = (), generate_tokens: int = 0, root: str = "",
              lens: str = DEFAULT_FOR_RESIDUALS) -> Trace:
    """Trace a prompt at a position (negative: from the end), for the trace page and notebooks alike.

    Args:
        target: the token (text, or id) whose memory contributions are listed; default the model's prediction.
        edits: memories switched off, scaled or set at every position (layers from 0; a scale of 1 is dropped).
        generate_tokens: also continue the prompt greedily by this many tokens, with and without the edits.
        lens: how the residual columns are read (`ffkv.explorer.tracing.LENSES`): "final-norm" (the logit lens)
            or "translator" (the run's fitted translators, the tuned lens).
    """
    prompt = validation.prompt(prompt)
    if lens not in LENSES:
        raise validation.BadRequest(f"lens must be one of {', '.join(LENSES)}, got {str(lens)[:40]!r}", 422)
    if lens == TRANSLATOR and not data.translators_file.is_file():
        raise validation.BadRequest("this run has no fitted translators: `ffkv analyze RUN --only translators` "
                                    "fits them", 404)
    loaded = data.loaded
    if getattr(loaded, "view", None) is None:  # a tokenizer without the weights
        raise validation.BadRequest("a trace runs the model, and this run's model weights are not loaded", 503)
    token_ids = list(loaded.tokenizer.encode(prompt))
    limit = max_prompt_tokens(loaded)
    if not token_ids:
        raise validation.BadRequest("the prompt gives no tokens", 422)
    if len(token_ids) > limit:
        raise validation.BadRequest(f"the prompt has {len(token_ids):,} tokens; this model takes at most {limit:,}", 413)
    if not -len(token_ids) <= position < len(token_ids):
        raise validation.BadRequest(f"position {position} is outside the prompt's {len(token_ids)} tokens", 422)
    if isinstance(target, str):
        target = data.token_ids_for(target)[0]
    edits = [e for e in edits if not (e.op == "scale" and e.value == 1.0)]
    for e in edits:
        if e.kind == "neuron":
            validation.integer(e.layer, "layer index", 0, data.n_layers - 1, 422)
            validation.integer(e.key, "key", 0, data.d_m - 1, 422)
    generation = None
    with data.model.lock:
        if lens == TRANSLATOR and loaded.view.translators is None:
            data.run.require_file(data.translators_file)  # a damaged file: one line naming it and the command
            loaded.view.translators = Translators.load(data.translators_file, loaded.view.device)
        # a run indexed with a dictionary: its latents beside the neurons (None if it cannot be reopened)
        latents = data.latents.memories() if data.latents is not None else None
        if latents is None and any(e.kind != "neuron" for e in edits):
            why = data.latents.memories_error if data.latents is not None else \
                "this run was indexed without a dictionary: it has no latents"
            raise validation.BadRequest(f"an edit of a latent needs the run's dictionary: {why}", 422)
        for e in edits:
            if e.kind != "neuron":
                try:
                    latents.layout.check_latent(e.layer, e.key, e.kind)
                except FfkvError as exc:  # a latent the dictionary does not have, or of another kind
                    raise validation.BadRequest(str(exc), 422) from None
        base = trace(loaded, token_ids, position=position, target=target, lens=lens, latents=latents,
                     show=[(e.layer, e.key) for e in edits if e.kind == "neuron"],
                     show_latents=[(e.layer, e.key) for e in edits if e.kind != "neuron"])
        try:
            edited = trace(loaded, token_ids, edits, position=position, target=base.target, lens=lens,
                           latents=latents) if edits else None
            if generate_tokens and not data.encoder:
                original = generate(loaded, token_ids, generate_tokens)
                changed = generate(loaded, token_ids, generate_tokens, edits, latents=latents) if edits else None
                generation = pages.generation_view(data, token_ids, original, changed)
        except NonFiniteOutput as exc:  # the edits the request asks for overflowed the model: that input
            raise validation.BadRequest(str(exc), 422) from None
    return Trace(data, prompt, base, edited, root, generation)
