"""The library in a notebook: index a corpus, analyse the run, read it back as DataFrames and inline views.

    import ffkv
    run = ffkv.index("ffkv-tiny", ffkv.embedded_corpus("train"), "runs/nb", unit="line", max_examples=2000)
    run = ffkv.analyze(run, n_eval=200)
    run.triggers(2, 17)                       # DataFrame: the key's trigger examples, with text
    run.values(2, 17, projection="final-norm")  # DataFrame: the value's top and bottom tokens
    run.metric("values")                      # any metrics table by name (run.metrics lists them)
    run.memory(2, 17)                         # renders inline as the explorer's memory page
    run.trace("And God said", off=[(5, 3)])   # renders inline: the trace, with memory 5:3 switched off
    run.concepts([5])                         # (concepts, members): values grouped by shared top tokens
    run.triggers(3, 42, of="latents")         # a run indexed with --dictionary: latent 42 of layer 3's dictionary
    run.layout.parse("t4:42")                 # an address as readers write it -> LatentRef(layer=3, latent=42, ...)
    ffkv.intervene(run, set={(5, 55): 5.0}, tokens=" three, five")  # change in perplexity and p(S) over held-out text

In code, layers are 0-based, as in the run's Parquet tables (docs/run-directory.md); what the
views render counts layers from 1, as the paper, the report and the explorer do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import pandas as pd

from ffkv.errors import FfkvError
from ffkv.store.run import RunDir
from ffkv.store.schemas import Direction

if TYPE_CHECKING:
    from ffkv.memories.address import MemoryLayout
    from ffkv.memories.sets import MemorySet

__all__ = ["Run", "open_run", "index", "analyze", "intervene", "embedded_corpus"]

#: A memory as the library names one: a neuron (layer, key) with the layer from 0, or an address as readers
#: write it, layers from 1 (``"4:17"``, ``"t4:42"``: `ffkv.memories.address`).
Memory = tuple[int, int] | str


def embedded_corpus(split: str = "all") -> Path:
    """The corpus ffkv-tiny was trained on, offline: King James Bible verses, one per line
    (split "all", "train" or "heldout"; read it with ``unit="line"``)."""
    from ffkv.models.default_corpus import default_corpus_path

    return default_corpus_path(split)


class Run:
    """A complete run directory, read back: DataFrames of its tables and inline views of its memories.

    Args:
        path: the run directory.
        loaded: the run's model, if already loaded (else loaded by the manifest's model id when needed).
        dictionary: where the sparse dictionary the run was indexed with (``--dictionary``) lies now, if it
            moved (else read from the path the manifest records); its files must be the ones indexed.
    """

    def __init__(self, path: str | Path, loaded: Any = None, dictionary: str | Path | None = None) -> None:
        self.dir = RunDir(path)
        self.manifest = self.dir.require_complete()
        self._loaded = loaded
        self._data = None
        self._dictionary_at = dictionary
        self._latents = None

    # ------------------------------------------------------------------ basics
    @property
    def path(self) -> Path:
        return self.dir.path

    @property
    def n_layers(self) -> int:
        return self.manifest.model.n_layers

    @property
    def d_m(self) -> int:
        return self.manifest.model.d_m

    @property
    def model(self):
        """The run's `LoadedModel` (loaded once, by the manifest's model id and dtype)."""
        if self._loaded is None:
            from ffkv.explorer.model import load_run_model

            self._loaded = load_run_model(self.path)
        return self._loaded

    @property
    def layout(self) -> MemoryLayout:
        """The memories this run can name: the model's neurons, and the latents of the dictionary it was indexed
        with (`MemoryLayout.parse` reads ``3:17``, ``t4:42``); read from the manifest, no model loaded."""
        from ffkv.memories.address import MemoryLayout

        return MemoryLayout.recorded(self.n_layers, self.d_m, self.manifest.index.get("dictionary"))

    def memories(self, of: str = "neurons") -> MemorySet:
        """The run's memories of one source (`ffkv.memories.sets`): ``neurons``, the model's own, or ``latents``,
        the dictionary the run was indexed with, read again from its files and checked to be the same ones, and
        attached to the model (`Latents.attach`) so that edits may name its latents."""
        from ffkv.memories.sets import Latents, Neurons

        if of == "neurons":
            return Neurons(self.model.view)
        if of != "latents":
            raise FfkvError(f"of= must be 'neurons' or 'latents', got {str(of)[:40]!r}")
        if self._latents is None:
            self._latents = Latents.of_run(self.model.view, self.manifest.index.get("dictionary"),
                                           self._dictionary_at, self.path).attach()
        return self._latents

    def __repr__(self) -> str:
        return repr(self.dir).replace("RunDir(", "Run(", 1)

    def _repr_html_(self) -> str:
        from ffkv.presentation.style import CSS
        from ffkv.presentation.summary import NUMBERING, manifest_summary
        import html

        rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in manifest_summary(self.manifest))
        metrics = ", ".join(self.metrics) or "none yet (ffkv.analyze)"
        return (f'<div class="ffkv-run"><style>{CSS}</style><h3>Run {html.escape(self.path.name)}</h3>'
                f'<dl class="run">{rows}<dt>metrics</dt><dd>{html.escape(metrics)}</dd></dl>'
                f'<p class="note">{html.escape(NUMBERING)}</p></div>')

    def _check(self, layer: int, key: int, of: str = "neurons") -> tuple[int, int]:
        for name, value in (("layer", layer), ("key", key)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise FfkvError(f"{name} must be an integer (0-based in code, as in the run's tables), got {value!r}")
        if of == "latents":
            self.layout.check_latent(layer, key)
            return layer, key
        if of != "neurons":
            raise FfkvError(f"of= must be 'neurons' or 'latents', got {str(of)[:40]!r}")
        for name, value, high in (("layer", layer, self.n_layers - 1), ("key", key, self.d_m - 1)):
            if not 0 <= value <= high:
                raise FfkvError(f"{name} {value!r} does not exist: this run has {name}s 0 to {high} "
                                "(0-based in code, as in its tables)")
        return layer, key

    def _explorer(self):
        if self._data is None:
            from ffkv.explorer.data import ExplorerData

            self._data = ExplorerData(self.path, self.model, dictionary_at=self._dictionary_at)
        return self._data

    # ------------------------------------------------------------------ tables
    @property
    def metrics(self) -> list[str]:
        """Names of the metrics tables of `ffkv analyze` in this run."""
        return self.dir.metric_names()

    def metric(self, name: str) -> pd.DataFrame:
        """A metrics table by name (RUN/metrics/NAME.parquet), as written (0-based layers)."""
        return self.dir.read_metric(name)

    def describe(self, name: str) -> dict:
        """How a metrics table was computed: projection, options, sample sizes, warnings."""
        if not self.dir.has_metric(name):
            self.dir.read_metric(name)  # the clear error
        return self.dir.metric_description(name)

    def explanations(self) -> pd.DataFrame:
        """The memories' explanations (`ffkv explain`) with their simulation score and the shuffled baseline's
        (`ffkv score`; NaN before it): layer (0-based), key, direction, explanation, explainer, score,
        shuffled_score, simulator. Empty before `ffkv explain`."""
        from ffkv.experiments.explanations import memory_explanations

        return memory_explanations(self.dir)

    def __getitem__(self, name: str) -> pd.DataFrame:
        return self.metric(name)

    def triggers(self, layer: int, key: int, direction: "Direction | str | int" = "positive", of: str = "neurons"
                 ) -> pd.DataFrame:
        """The trigger examples of key `key` of layer `layer` (0-based), strongest first: the columns of
        trigger_examples.parquet, then ``trigger_token``, ``next_token``, ``prefix`` (the text up to and
        including the trigger position) and ``text`` (the whole example).

        Args:
            direction: a `ffkv.store.schemas.Direction`, by name or as the tables' integer: ``positive`` / 1
                (the largest coefficients, the paper's trigger examples), ``negative`` / -1 (the most negative
                coefficients: runs indexed with ``--sign both``, the default for gated and GELU models), or
                ``both`` (positive rows first, then negative).
            of: ``neurons`` (the model's keys) or ``latents`` (`key` is then latent `key` of the dictionary of
                `layer` the run was indexed with: latent_trigger_examples.parquet, positive only).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        layer, key = self._check(layer, key, of)
        te = self.dir.read_triggers(direction, filters=[("layer", "=", layer), ("key", "=", key)], source=of)
        te = te.sort_values(["direction", "rank"], ascending=[False, True], kind="stable").reset_index(drop=True)
        ids = pa.array(sorted(set(int(i) for i in te["example_id"])), pa.int64())
        examples = pq.read_table(self.dir.table("examples"), filters=[("example_id", "in", ids)]).to_pandas() \
            .set_index("example_id")
        tok = self.model.tokenizer
        token_ids = [list(examples.at[int(e), "token_ids"]) for e in te["example_id"]]
        te["trigger_token"] = [tok.token_strings([int(ids_[p])])[0] for ids_, p in zip(token_ids, te["position"])]
        te["next_token"] = [tok.token_strings([int(n)])[0] if n >= 0 else "" for n in te["next_token_id"]]
        te["prefix"] = [tok.decode([int(t) for t in ids_[:p + 1]]) for ids_, p in zip(token_ids, te["position"])]
        te["text"] = [examples.at[int(e), "text"] for e in te["example_id"]]
        return te

    def values(self, layer: int, key: int, projection: str = "identity", k: int = 10, shown: str = "p",
               of: str = "neurons") -> pd.DataFrame:
        """The k top and k bottom tokens of value v_i (layer 0-based) under `projection`: ``identity``
        (softmax(v·Eᵀ), the paper's) or ``final-norm`` (softmax(N(v)·Eᵀ)), read as probabilities (`shown`
        ``p``) or as the raw logits (``logit``); `of` ``latents``: the value is the dictionary's decoder row `key`.
        Columns: end (top / bottom), rank (1 = most extreme), token_id, token, and p or logit."""
        from ffkv.explorer import live

        layer, key = self._check(layer, key, of)
        live.check_reading(projection, shown)
        out = live.value_tokens(self.model, layer, key, projection, k, shown=shown, memories=self.memories(of))
        tok = self.model.tokenizer
        rows = [{"end": end, "rank": r + 1, "token_id": t, "token": tok.token_strings([t])[0], out["shown"]: v}
                for end in ("top", "bottom") for r, (t, v) in enumerate(out[end])]
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ views
    def memory(self, layer: int, key: int, projection: str | None = None, shown: str = "p"):
        """Memory (layer, key), 0-based layer: shows inline as the explorer's memory page (its value read under
        `projection` as `shown`, as `values` reads it; None: as the page opens, through the model's final norm
        where it has one); `.to_dict()` is its JSON."""
        from ffkv.explorer.notebook import Memory

        layer, key = self._check(layer, key)
        return Memory(self._explorer(), layer, key, projection=projection, shown=shown)

    def trace(self, prompt: str, position: int = -1, target: str | int | None = None,
              off: Iterable[Memory] = (), scale: Mapping[Memory, float] | None = None,
              set: Mapping[Memory, float] | None = None, generate: int = 0, lens: str = "final-norm"):
        """Trace a prompt at a position: per layer, predictions and the memories that push the target token most.

        Args:
            position: which token to read (negative: from the end).
            target: the token whose contributions rank the memories (default: the model's prediction).
            off, scale, set: edits applied at every position, as `intervene` takes them: memories switched off;
                {memory: factor} scaled; {memory: value} set. A memory is (layer, key), 0-based, or an address
                (``"4:17"``, layers from 1), or a latent of the run's dictionary (``"t4:42"``): the layer's
                output then becomes the dictionary's reconstruction with the edit plus its error term.
            generate: also continue the prompt greedily by this many tokens, with and without the edits.
            lens: how the residual is read per layer: "final-norm" (the logit lens) or "translator" (the run's
                fitted translators, `ffkv analyze RUN --only translators`: the tuned lens).
        """
        from ffkv.explorer.notebook import run_trace

        return run_trace(self._explorer(), prompt, position, target, self._edits(off, scale, set), generate,
                         lens=lens)

    def _edits(self, off: Iterable[Memory], scale: Mapping[Memory, float] | None,
               set: Mapping[Memory, float] | None) -> list:
        """The library's edits as `Intervention`s, one per memory (`ffkv.memories.address`): a memory is a
        neuron (layer, key), 0-based, or an address as readers write it (``"4:17"``, ``"t4:42"``: layers from 1).
        An edit of a latent attaches the run's dictionary to its model (`memories`)."""
        from ffkv.memories import Intervention
        from ffkv.memories.address import LatentRef, one_per_memory

        def memory(named: Memory) -> tuple[int, int, str]:
            if isinstance(named, str):
                ref = self.layout.parse(named)
                return (ref.layer, ref.latent, ref.kind) if isinstance(ref, LatentRef) else (*ref, "neuron")
            layer, key = named
            return (*self._check(int(layer), int(key)), "neuron")

        edits = [Intervention(layer, key, "off", kind=kind) for layer, key, kind in map(memory, off)]
        # `Intervention` refuses a factor or value that is not a number, or not finite within its bound.
        edits += [Intervention.scaled(layer, key, f, kind)
                  for (layer, key, kind), f in ((memory(m), f) for m, f in dict(scale or {}).items())]
        edits += [Intervention(layer, key, "set", v, kind)
                  for (layer, key, kind), v in ((memory(m), v) for m, v in dict(set or {}).items())]
        if any(e.kind != "neuron" for e in edits):
            self.memories("latents")
        return one_per_memory(edits)

    def concepts(self, layers: Sequence[int] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Values grouped by shared top tokens (`ffkv.tools.concepts.concepts`; layers 0-based, default
        all): (concepts, members), so a concept's memories can be promoted or suppressed with `intervene`."""
        from ffkv.tools.concepts import concepts

        return concepts(self.model, layers)


def intervene(run: Run | str | Path, *, set: Mapping[Memory, float] | None = None,
              off: Iterable[Memory] = (), scale: Mapping[Memory, float] | None = None,
              eval_corpus: Any = None, eval_split: str | None = None, n_eval: int = 1000,
              tokens: str | Sequence[str | int] | None = None, seed: int = 0, out: str | Path | None = None,
              progress: bool = False):
    """`ffkv intervene` as a function: rewrite memories at every position and measure, over held-out examples,
    the change in perplexity and in the probability mass of a token set, with n and 95% intervals
    (`ffkv.tools.intervene`).

    Args:
        set, off, scale: {memory: value}, [memory], {memory: factor}; a memory is (layer, key), layers 0-based
            as in code and the run's tables, or an address as the command line writes it (``"4:17"``, a latent
            ``"t4:42"``: layers from 1).
        eval_corpus, eval_split, n_eval, seed: the evaluation examples, as `analyze` reads them (default: the
            run's own corpus, held-out split; a seeded subset of n_eval).
        tokens: the token set S (strings that are single tokens, or ids); None: the memories' own top tokens.
        out: also write the result atomically to this .json or .parquet file.

    Returns:
        An `InterventionResult` (``summary`` and ``examples`` DataFrames, ``to_text()``).
    """
    from ffkv.experiments.common import eval_spec
    from ffkv.tools.intervene import evaluate_corpus, token_ids

    run = run if isinstance(run, Run) else Run(run)
    edits = run._edits(off, scale, set)
    spec = eval_spec(run.manifest, eval_corpus, eval_split, n_eval, seed)
    chosen = token_ids(run.model, tokens) if tokens is not None else None
    result = evaluate_corpus(run.model, spec, edits, chosen, progress=progress)
    if out is not None:
        result.write(out)
    return result


def open_run(path: str | Path, loaded: Any = None, dictionary: str | Path | None = None) -> Run:
    """A complete run directory, opened for reading (`Run`); the model loads when a view needs it."""
    return Run(path, loaded, dictionary)


def index(model: str | Any, corpus: str | Path | Any, out: str | Path, *, top_k: int = 50, mode: str = "example",
          sign: str | None = None, unit: str = "sentence", max_examples: int | None = None, seed: int | None = None, max_tokens: int = 512,
          split: str = "all", dtype: str = "float32", device: str = "cpu", batch_size: int = 32,
          control_keys: int | None = None, dictionary: str | Path | None = None, resume: bool = False,
          progress: bool = True, **corpus_options: Any) -> Run:
    """`ffkv index` as a function: the top-k trigger examples of every key of every layer (docs/definitions.md).

    Args:
        model: a model name or path (as `ffkv index --model`), or a `LoadedModel`.
        corpus: a path or hf:<dataset id> (read with `unit`, `max_examples`, `seed`, `max_tokens`, `split` and
            any other `CorpusSpec` option), or a `CorpusSpec`.
        out: the run directory to create (or, with `resume`, to continue).
        top_k, mode: trigger examples kept per key (and direction); ``example`` or ``prefix`` (as `ffkv index`).
        sign: ``positive`` or ``both`` trigger directions; None: ``both`` when the model's coefficients can
            be negative (gated, GELU, SiLU), else ``positive`` (`ffkv.indexing.indexer.IndexOptions`).
        control_keys: random control memories per layer (`ffkv.memories.controls`); None: the default.
        dictionary: a sparse dictionary (transcoder or SAE, `ffkv.dictionaries.open_dictionary`) whose latents are
            indexed in the same pass (as `ffkv index --dictionary`); `Run.triggers(..., of="latents")` reads them.
    """
    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
    from ffkv.models import load_model

    loaded = load_model(model, dtype=dtype, device=device) if isinstance(model, (str, Path)) else model
    spec = corpus if isinstance(corpus, CorpusSpec) else CorpusSpec(
        source=str(corpus), unit=unit, max_examples=max_examples, shuffle_seed=seed, max_tokens=max_tokens,
        split=split, **corpus_options)
    controls = {} if control_keys is None else {"control_keys": control_keys}
    build_index(loaded, spec, out, IndexOptions(top_k=top_k, mode=mode, sign=sign, **controls),
                BatchOptions(batch_size=batch_size), resume=resume, progress=progress, dictionary=dictionary)
    return Run(out, loaded)


def analyze(run: Run | str | Path, only: Sequence[str] | str | None = None, *, eval_corpus: Any = None,
            eval_split: str | None = None, n_eval: int = 4000, projection: str | None = None, seed: int = 0,
            progress: bool = True, device: str = "cpu", dtype: str | None = None,
            options: dict[str, dict] | None = None) -> Run:
    """`ffkv analyze` as a function: the paper's experiments on a run, each a table in RUN/metrics and a
    figure in RUN/figures, and the explorer's lookup tables (see `ffkv.experiments.analyze`). Returns the run.

    `options` gives experiments their own options, e.g. ``{"membership": {"member_corpus": "train.txt",
    "nonmember_corpus": "unseen.txt", "n": 1000}}`` (ffkv-tiny's own split is the default for it)."""
    from ffkv.experiments import analyze as run_experiments

    run = run if isinstance(run, Run) else Run(run)
    same_model = device == "cpu" and dtype in (None, run.manifest.model.dtype)
    loaded = run.model if same_model else None  # else analyze loads it where and how it is asked to
    run_experiments(run.path, only=only, eval_corpus=eval_corpus, eval_split=eval_split, n_eval=n_eval,
                    projection=projection, progress=progress, loaded=loaded, device=device, dtype=dtype, seed=seed,
                    options=options)
    return Run(run.path, loaded)
