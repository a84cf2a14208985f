"""What every experiment shares: the run and its model, projections, held-out examples, tables.

`RunContext` opens a complete run directory once (manifest, model, trigger examples,
example token ids) and is handed to each experiment's ``run(ctx)``. Tables go to
``RUN/metrics/NAME.parquet`` with a JSON description (projection, options) in the
Parquet schema metadata under ``b"ffkv"``, so each table says how it was computed.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ffkv.errors import FfkvError, FfkvWarning
from ffkv.experiments.sharding import is_writer, owned
from ffkv.index.batching import Batch, collate, length_batches
from ffkv.memories.projection import DEFAULT_FOR_RESIDUALS, DEFAULT_FOR_VALUES, check_projection
from ffkv.models.loading import LoadedModel
from ffkv.store import atomic
from ffkv.store.run import RunDir

#: Batch shape of the experiments' own forward passes (speed only, never the result).
BATCH_SIZE = 32
MAX_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class Projections:
    """Which normalization N each kind of vector goes through before Eᵀ (SPEC section 1).

    Attributes:
        values: value vectors, memory sub-updates m_i·v_i and the FF output.
        residuals: residual-stream vectors (resid_mid, resid_post).
    """

    values: str = DEFAULT_FOR_VALUES
    residuals: str = DEFAULT_FOR_RESIDUALS

    @classmethod
    def choose(cls, projection: str | None) -> "Projections":
        """SPEC defaults for None; one name forces that projection on every vector."""
        if projection is None or projection == "default":
            return cls()
        check_projection(projection)
        return cls(projection, projection)

    def to_dict(self) -> dict[str, str]:
        return {"values_and_sub_updates": self.values, "residuals": self.residuals}


@dataclass(frozen=True)
class HeldOut:
    """The held-out examples of SPEC sections 7-8, each with one seeded position.

    Attributes:
        examples: the examples (token ids as the corpus gives them).
        positions: (N,) the analysed position of each example; for a causal LM the
            prefix x_1..x_{j+1} predicts the token after it, for an encoder the token at
            the position is masked.
        targets: (N,) the gold token: the next token (causal) or the masked token (encoder).
        spec: the corpus spec they were read with (for the manifest).
    """

    examples: list
    positions: np.ndarray
    targets: np.ndarray
    spec: Any

    @property
    def example_ids(self) -> np.ndarray:
        return np.array([e.example_id for e in self.examples], dtype=np.int64)


@dataclass
class RunContext:
    """A complete run opened for analysis, shared by the experiments of one `analyze` call."""

    run: RunDir
    manifest: dict
    loaded: LoadedModel
    projections: Projections = field(default_factory=Projections)
    progress: bool = True
    seed: int = 0
    eval_spec: Any = None
    n_eval: int = 4000
    analyses: dict = field(default_factory=dict)
    _triggers: pd.DataFrame | None = None
    _examples: dict | None = None
    _held_out: HeldOut | None = None
    _value_tops: dict = field(default_factory=dict)
    _eval_capture: Any = None

    # ----------------------------------------------------------- run tables
    @property
    def view(self):
        return self.loaded.view

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def top_k(self) -> int:
        return int(self.manifest.get("index", {}).get("top_k", 50))

    def triggers(self) -> pd.DataFrame:
        """trigger_examples.parquet, sorted by (layer, key, rank)."""
        if self._triggers is None:
            df = pd.read_parquet(self.run.table("trigger_examples"))
            self._triggers = df.sort_values(["layer", "key", "rank"], kind="stable").reset_index(drop=True)
        return self._triggers

    def examples(self) -> dict[int, tuple[np.ndarray, str]]:
        """example_id -> (token ids, text) of every example that is some key's trigger."""
        if self._examples is None:
            import pyarrow.parquet as pq

            wanted = pa.array(np.unique(self.triggers()["example_id"].to_numpy()), pa.int64())
            table = pq.read_table(self.run.table("examples"), filters=[("example_id", "in", wanted)]) \
                if len(wanted) else pq.read_table(self.run.table("examples")).slice(0, 0)
            ids = table.column("example_id").to_numpy()
            tokens = table.column("token_ids").to_pylist()
            texts = table.column("text").to_pylist()
            self._examples = {int(i): (np.asarray(t, dtype=np.int64), s) for i, t, s in zip(ids, tokens, texts)}
        return self._examples

    def prefix(self, example_id: int, position: int) -> np.ndarray:
        """Token ids x_1..x_{position+1} of a stored example."""
        return self.examples()[int(example_id)][0][: int(position) + 1]

    def token(self, token_id: int) -> str:
        """Readable string of one token id; the end marker for -1."""
        if token_id is None or int(token_id) < 0:
            return "⟨end⟩"
        try:
            return self.tokenizer.token_strings([int(token_id)])[0]
        except Exception:  # noqa: BLE001 - ids past the tokenizer's own vocabulary (padded heads)
            return f"<{int(token_id)}>"

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.token(i) for i in ids]

    def prefix_text(self, example_id: int, position: int) -> str:
        """Readable text of a stored prefix (decoded; special tokens kept as the tokenizer shows them)."""
        try:
            return self.tokenizer.decode([int(t) for t in self.prefix(example_id, position)])
        except Exception:  # noqa: BLE001
            return "".join(self.tokens(self.prefix(example_id, position)))

    # --------------------------------------------------------------- output
    def write_table(self, name: str, df: pd.DataFrame, **meta: Any) -> Path:
        """Write RUN/metrics/NAME.parquet atomically, with how it was computed in its metadata.

        Under torchrun only rank 0 writes; every rank gets the path.
        """
        path = self.run.path / "metrics" / f"{name}.parquet"
        if not is_writer():
            return path
        table = pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False)
        description = {"name": name, "model_id": self.loaded.model_id, **meta}
        metadata = dict(table.schema.metadata or {})
        metadata[b"ffkv"] = json.dumps(description, default=str).encode()
        table = table.replace_schema_metadata(metadata)
        atomic.write_parquet(path, table)
        return path

    def record(self, experiment: str, **info: Any) -> None:
        """Note what an experiment wrote and how (merged into manifest['analyses'] at the end)."""
        self.analyses[experiment] = info

    # -------------------------------------------------------------- held out
    def held_out(self) -> HeldOut:
        """The held-out examples with their seeded positions (read once per `analyze`)."""
        if self._held_out is None:
            self._held_out = select_held_out(self.loaded, self.eval_spec, self.seed)
        return self._held_out


def table_metadata(path: str | Path) -> dict:
    """The ``ffkv`` description stored in a metrics table's schema metadata."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta.get(b"ffkv", b"{}"))


def open_run(run_dir: str | Path, loaded: LoadedModel | None = None, device: str = "cpu",
             dtype: str | None = None) -> tuple[RunDir, dict, LoadedModel]:
    """A complete run, its manifest, and its model (loaded from the manifest unless given)."""
    run = RunDir(run_dir)
    if run.path.exists() and not run.path.is_dir():
        raise FfkvError(f"{run.path} is a file; give a run directory")
    manifest = run.require_complete()
    if loaded is None:
        from ffkv.models import load_model

        model_id = manifest.get("model", {}).get("id") or manifest.get("identity", {}).get("model_id")
        if not model_id:
            raise FfkvError(f"the manifest of {run.path} names no model; it was not written by `ffkv index`")
        loaded = load_model(model_id, dtype=dtype or manifest["model"].get("dtype", "float32"), device=device)
        expected = manifest.get("identity", {}).get("weights_sha256")
        if expected and loaded.weights_hash() != expected:
            warnings.warn(f"the weights of {model_id!r} differ from those the run was indexed with; "
                          "trigger examples may not match this model", FfkvWarning, stacklevel=2)
    model = manifest.get("model", {})
    if model.get("n_layers") not in (None, loaded.view.n_layers) or model.get("d_m") not in (None, loaded.view.d_m):
        raise FfkvError(f"the model ({loaded.view.n_layers} layers x {loaded.view.d_m} memories) does not match "
                        f"the run ({model.get('n_layers')} x {model.get('d_m')}); analyse the run with its own model")
    return run, manifest, loaded


def default_eval_spec(manifest: dict, n_eval: int, eval_spec=None, seed: int = 0):
    """The held-out examples' corpus spec: the run's corpus with split="heldout" unless one is given.

    Either way a seeded uniform subset of `n_eval` examples (SPEC section 7: 4,000 by default).
    """
    from ffkv.corpus import CorpusSpec

    if not isinstance(n_eval, int) or isinstance(n_eval, bool) or n_eval < 1:
        raise FfkvError(f"--n-eval must be a positive integer, got {n_eval!r}")
    if eval_spec is None:
        corpus = manifest.get("identity", {}).get("corpus") or manifest.get("corpus")
        if not corpus:
            raise FfkvError("the run's manifest records no corpus: give the held-out examples with --eval-corpus")
        eval_spec = replace(CorpusSpec.from_dict(corpus), split="heldout")
    elif isinstance(eval_spec, dict):
        eval_spec = CorpusSpec.from_dict(eval_spec)
    seed_ = eval_spec.shuffle_seed if eval_spec.shuffle_seed is not None else seed
    return replace(eval_spec, max_examples=n_eval, shuffle_seed=seed_)


def eval_spec_for(run_dir: str | Path, corpus: str | None = None, split: str | None = None, **options):
    """The CLI's --eval-corpus/--eval-split as a corpus spec (None: the run's corpus, held-out split).

    A given corpus is read with the run's unit and length options unless `options` override them.
    """
    from ffkv.corpus import CorpusSpec

    manifest = RunDir(run_dir).manifest()
    base = manifest.get("identity", {}).get("corpus") or manifest.get("corpus") or {}
    if corpus is None:
        if not base:
            raise FfkvError("the run's manifest records no corpus: give --eval-corpus")
        return replace(CorpusSpec.from_dict(base), split=split or "heldout", **options)
    keep = {k: base[k] for k in ("unit", "window", "max_tokens", "min_tokens", "text_field") if k in base}
    return CorpusSpec(source=str(corpus), split=split or "all", **{**keep, **options})


def mask_token_id(tokenizer) -> int | None:
    """The [MASK] id of an encoder's tokenizer, if it has one."""
    for owner in (tokenizer, getattr(tokenizer, "hf", None)):
        for name in ("mask_id", "mask_token_id"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
    return None


def choose_position(token_ids: np.ndarray, special: frozenset, seed: int, example_id: int, encoder: bool) -> int | None:
    """One position per example, seeded by (seed, example id) alone, so it never depends on the others.

    Causal LM: a non-special position with a next token (the prediction can be checked);
    encoder: any non-special position (it will be masked). None when there is none.
    """
    n = len(token_ids)
    ok = np.array([int(t) not in special for t in token_ids], dtype=bool)
    if not encoder:
        ok[n - 1:] = False
    candidates = np.flatnonzero(ok)
    if not len(candidates):
        return None
    rng = np.random.default_rng([seed, int(example_id)])
    return int(candidates[rng.integers(len(candidates))])


def select_held_out(loaded: LoadedModel, spec, seed: int = 0) -> HeldOut:
    """Read the held-out examples and draw one position in each (examples with none are skipped)."""
    from ffkv.corpus import iter_examples

    special = frozenset(int(i) for i in (getattr(loaded.tokenizer, "special_ids", ()) or ()))
    encoder = loaded.view.encoder
    kept, positions, targets = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FfkvWarning)  # an empty split is reported below, as an error
        for e in iter_examples(spec, loaded.tokenizer):
            ids = np.asarray(e.token_ids, dtype=np.int64)
            j = choose_position(ids, special, seed, e.example_id, encoder)
            if j is None:
                continue
            kept.append(e)
            positions.append(j)
            targets.append(int(ids[j]) if encoder else int(ids[j + 1]))
    if not kept:
        raise FfkvError(f"no held-out examples with a position to analyse in {spec.source} "
                        f"(split {spec.split!r}); give another --eval-corpus or --eval-split")
    return HeldOut(kept, np.array(positions, dtype=np.int64), np.array(targets, dtype=np.int64), spec)


@dataclass
class _Row:
    example_id: int
    token_ids: np.ndarray


@dataclass
class RowBatches:
    """This rank's padded batches of some rows (every batch in one process; `ffkv.experiments.sharding`).

    Iterating yields (row indices of the batch, in batch order; the batch on the model's device).
    """

    loaded: LoadedModel
    groups: list[list[_Row]]

    @property
    def rows(self) -> np.ndarray:
        """The row indices of this rank's batches: what it passes to `gather_rows`."""
        return np.array([r.example_id for group in self.groups for r in group], dtype=np.int64)

    def __iter__(self) -> Iterator[tuple[np.ndarray, Batch]]:
        tok = self.loaded.tokenizer
        special = getattr(tok, "special_ids", ()) or ()
        for group in self.groups:
            batch = collate(group, tok.pad_id, special).to(self.loaded.view.device)
            yield batch.example_ids.cpu().numpy(), batch


def batches(loaded: LoadedModel, rows: Sequence[tuple[int, np.ndarray]], batch_size: int = BATCH_SIZE,
            max_batch_tokens: int | None = MAX_BATCH_TOKENS) -> RowBatches:
    """The padded batches of (row index, token ids) pairs, grouped by length, that this rank runs.

    All rows are cut into the batches one process would run, then each rank keeps its
    share (`owned`), so every row goes through the same padded batch in any world size.
    The row index stands in for the example id, so `collate` keeps rows in index order.
    """
    items = [_Row(i, np.asarray(t)) for i, t in rows]
    return RowBatches(loaded, owned(length_batches(items, batch_size, max_batch_tokens)))


def progress_bar(ctx_progress: bool, total: int, desc: str, unit: str = "it"):
    """A progress bar, shown by the writing rank only (one bar for a torchrun job)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not (ctx_progress and is_writer()), dynamic_ncols=True,
                leave=False)


def check_only(only, names: Sequence[str]) -> list[str]:
    """Validate an --only list (names or a comma-separated string) against the experiments."""
    if only is None:
        return list(names)
    if isinstance(only, str):
        only = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [n for n in only if n not in names]
    if unknown or not only:
        raise FfkvError(f"unknown experiment {unknown[0]!r} in --only; choose from {', '.join(names)}"
                        if unknown else f"--only names no experiment; choose from {', '.join(names)}")
    return [n for n in names if n in only]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()
