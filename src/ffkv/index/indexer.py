"""`ffkv index`: the top-t trigger examples of every key in every layer, in one streaming pass.

SPEC section 3. The corpus is read once, in windows of consecutive examples; each
window is cut into batches of similar length, run through the model with a
coefficient capture that reduces every layer at once (`TriggerReducer`), and
merged into an exact running top-k kept on the model's device. After a window,
the run may checkpoint; `resume=True` continues from the last checkpoint and ends
with the identical result. Peak memory: one layer's activations for one batch,
the (L, d_m, k) state, and at most `part_rows` buffered examples.
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from ffkv.corpus import CorpusSpec, CorpusReader, fingerprint
from ffkv.errors import FfkvError, FfkvWarning
from ffkv.batching import Batch, collate, length_batches, windows
from ffkv.index.reducer import MODES, TriggerReducer
from ffkv.index.interrupt import deferred_interrupt
from ffkv.index.prefetch import default_workers, prefetched_examples
from ffkv.index.progress import IndexBar
from ffkv.index.topk import TopKState
from ffkv.models.loading import LoadedModel
from ffkv.index.tables import examples_table, parquet_batches, write_examples, write_triggers
from ffkv.store import atomic
from ffkv.store.manifest import Identity, Manifest, ModelInfo, library_versions
from ffkv.store.run import RunDir


@dataclass(frozen=True)
class IndexOptions:
    """Options of `build_index` that shape the result (batching never does)."""

    top_k: int = 50
    mode: str = "example"

    def validate(self) -> None:
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= 32767:
            raise FfkvError(f"--top-k must be an integer from 1 to 32767, got {self.top_k!r}")
        if self.mode not in MODES:
            raise FfkvError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class BatchOptions:
    """How examples are grouped for the forward pass (speed only, never the result)."""

    batch_size: int = 32
    max_batch_tokens: int | None = 16384
    window_batches: int = 16
    checkpoint_seconds: float = 300.0
    part_rows: int = 50_000
    tokenizer_workers: int | None = None  # processes tokenizing ahead; 0: in this process; None: see workers()
    pad_multiple: int | None = None  # round padded lengths up; None: 32 on a GPU, 1 on a CPU

    def pad_to(self, device: torch.device) -> int:
        """The padding multiple used on `device`."""
        if self.pad_multiple is not None:
            return self.pad_multiple
        return 32 if device.type == "cuda" else 1

    def workers(self, device: torch.device, spec: CorpusSpec) -> int:
        """Tokenizing processes: by default several on a GPU (it outruns one tokenizer), none on a CPU."""
        if self.tokenizer_workers is not None:
            return self.tokenizer_workers
        return default_workers(spec) if device.type == "cuda" else 0

    def validate(self) -> None:
        if self.tokenizer_workers is not None and (not isinstance(self.tokenizer_workers, int)
                                                   or self.tokenizer_workers < 0):
            raise FfkvError(f"--tokenizer-workers must be an integer >= 0, got {self.tokenizer_workers!r}")
        for name in ("batch_size", "window_batches", "part_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise FfkvError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise FfkvError(f"--max-batch-tokens must be positive, got {self.max_batch_tokens!r}")
        if self.checkpoint_seconds < 0:
            raise FfkvError(f"--checkpoint-seconds must be >= 0, got {self.checkpoint_seconds!r}")


class _ExampleParts:
    """Examples buffered and written as numbered, id-sorted Parquet parts under RUN/.partial/."""

    def __init__(self, folder: Path, part_rows: int, first_part: int) -> None:
        self.folder = folder
        self.part_rows = part_rows
        self.n_parts = first_part
        self.rows: list = []
        for path in folder.glob("examples-*.parquet"):  # parts written after the checkpoint resumed
            if int(path.stem.split("-")[1]) >= first_part:
                path.unlink()

    def add(self, examples) -> None:
        self.rows.extend(examples)
        if len(self.rows) >= self.part_rows:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        self.rows.sort(key=lambda e: e.example_id)
        atomic.write_parquet(self.folder / f"examples-{self.n_parts:06d}.parquet", examples_table(self.rows))
        self.n_parts += 1
        self.rows = []

    def assemble(self, path: Path) -> int:
        """Write all parts as the run's examples table; returns its row count."""
        parts = sorted(self.folder.glob("examples-*.parquet"))
        stream = (batch for part in parts for batch in parquet_batches(part))
        return write_examples(path, [stream])


def _identity(loaded: LoadedModel, spec: CorpusSpec, options: IndexOptions) -> Identity:
    return Identity(model_id=loaded.model_id, weights_sha256=loaded.weights_hash(), dtype=loaded.dtype,
                    corpus=spec.to_dict(), corpus_fingerprint=fingerprint(spec), index=asdict(options))


def model_info(loaded: LoadedModel) -> ModelInfo:
    """The manifest's description of a loaded model."""
    view = loaded.view
    return ModelInfo(id=loaded.model_id, family=view.arch.family, n_layers=view.n_layers, d_m=view.d_m,
                     d_model=view.d_model, vocab_size=view.vocab_size, dtype=loaded.dtype, gated=view.gated,
                     parallel=view.parallel, encoder=view.encoder, resid_mid=view.resid_mid_definition)


def model_mask(loaded: LoadedModel, batch: Batch) -> torch.Tensor | None:
    """The attention mask the model needs for a batch: none for a causal model.

    Batches are right-padded, so under causal attention no real token sees padding,
    and positions count from 0 with or without a mask: a causal model computes the same
    function of every real prefix without one, and skips building a padded mask (which
    costs a device sync in Hugging Face models). An encoder attends both ways and needs it.
    """
    return batch.attention_mask if loaded.view.encoder else None


def run_forward(loaded: LoadedModel, batch: Batch) -> None:
    """A plain forward pass of the model's blocks, as the index runs it (the benchmark's baseline)."""
    loaded.view.forward(batch.input_ids, model_mask(loaded, batch))


def index_batch(loaded: LoadedModel, reducer: TriggerReducer, batch: Batch) -> None:
    """One batch of the index: the forward pass, reduced inside it by `reducer` (a capture
    sink that must be open on the model's coefficients), then merged into its state."""
    reducer.start(batch)
    run_forward(loaded, batch)
    reducer.commit()


def build_index(
    loaded: LoadedModel,
    spec: CorpusSpec,
    out: str | Path,
    options: IndexOptions = IndexOptions(),
    batching: BatchOptions = BatchOptions(),
    resume: bool = False,
    progress: bool = True,
    after_window: Callable[[int], None] | None = None,
    shard: tuple[int, int] = (0, 1),
) -> RunDir:
    """Index a corpus: write RUN/{manifest.json, examples.parquet, trigger_examples.parquet}.

    Args:
        loaded: the model (see `ffkv.models.loading.load_model`).
        spec: the corpus.
        out: the run directory (created; must be new, or an interrupted run with `resume`).
        options: top-k and mode (they define the result).
        batching: batch size, grouping and checkpoint interval (speed only).
        resume: continue an interrupted run from its last checkpoint.
        progress: show a progress bar.
        after_window: called with the number of windows done (tests use it to interrupt).
        shard: (i, n): index only the batches that shard i of n owns; `merge_runs`
            joins the n shard runs into the run one process would have written, byte for byte.

    Returns:
        The finished run directory.
    """
    options.validate()
    batching.validate()
    shard_index, n_shards = shard
    if not (isinstance(n_shards, int) and n_shards >= 1 and 0 <= shard_index < n_shards):
        raise FfkvError(f"--shard must be i/n with 0 <= i < n, got {shard_index}/{n_shards}")
    run = RunDir(out)
    identity = _identity(loaded, spec, options)
    if n_shards > 1:
        # Shards must cut the same batches to merge exactly.
        identity = replace(identity, shard=(shard_index, n_shards), batching=asdict(batching))
    previous = run.prepare(identity, resume)
    view = loaded.view
    device = view.device
    started = time.time()
    checkpoint_path = run.partial / "checkpoint.pt"

    state = TopKState.empty(view.n_layers, view.d_m, options.top_k, device)
    consumed = n_tokens = 0
    elapsed_before = 0.0
    if previous is not None and checkpoint_path.exists():
        saved = torch.load(checkpoint_path, map_location=device, weights_only=True)
        state = TopKState.from_state_dict(saved["state"])
        consumed, n_tokens = int(saved["consumed"]), int(saved["n_tokens"])
        elapsed_before = float(saved["elapsed"])
        first_part = int(saved["n_parts"])
        groups_done = int(saved["groups_done"])
        n_windows = int(saved["windows"])
    else:
        first_part = groups_done = n_windows = 0
    # Read the first example before writing anything, so a bad corpus leaves no run behind.
    reader = CorpusReader(spec, loaded.tokenizer)
    workers = batching.workers(device, spec)
    if workers:
        stream = prefetched_examples(spec, loaded.tokenizer, skip=consumed, workers=workers)
    else:
        stream = itertools.islice(iter(reader), consumed, None)
    first = next(stream, None)
    if first is None and consumed == 0:
        raise FfkvError(f"the corpus {spec.source} gave no examples (empty, blank, or every example "
                        "shorter than the minimum length); check --corpus, --format and --unit")
    stream = itertools.chain([first] if first is not None else [], stream)
    run.partial.mkdir(parents=True, exist_ok=True)
    parts = _ExampleParts(run.partial, batching.part_rows, first_part)

    manifest = previous or Manifest(identity=identity, model=model_info(loaded), corpus=spec.to_dict(),
                                    index={**asdict(options), "batching": asdict(batching)},
                                    versions=library_versions())
    manifest.status = "running"
    run.write_manifest(manifest)

    reducer = TriggerReducer(state, options.mode)
    pad_multiple = batching.pad_to(device)
    special = sorted(getattr(loaded.tokenizer, "special_ids", ()) or ())
    bar = IndexBar(spec, initial=consumed, show=progress)
    last_checkpoint = time.time()

    def checkpoint() -> None:
        parts.flush()
        with atomic.atomic_path(checkpoint_path) as tmp:
            torch.save({"state": state.state_dict(), "consumed": consumed, "n_tokens": n_tokens,
                        "n_parts": parts.n_parts, "groups_done": groups_done, "windows": n_windows,
                        "elapsed": elapsed_before + time.time() - started}, tmp)

    mine: list = []  # examples of this shard's batches in the current window
    with view.capture(("coefficients",), sink=reducer), deferred_interrupt() as interrupted:
        for chunk in windows(stream, batching.batch_size * batching.window_batches):
            groups = length_batches(chunk, batching.batch_size, batching.max_batch_tokens)
            for g, group in enumerate(groups):
                if (n_windows + g) % n_shards != shard_index:
                    continue
                if g < groups_done:  # done before the interrupt that this run resumes
                    mine.extend(group)
                    continue
                batch = collate(group, loaded.tokenizer.pad_id, special, pad_multiple).to(device)
                index_batch(loaded, reducer, batch)
                groups_done = g + 1
                mine.extend(group)
                n_tokens += batch.n_tokens
                bar.update(len(group),
                           tok_s=f"{n_tokens / max(time.time() - started + elapsed_before, 1e-9):,.0f}")
                if interrupted():
                    # The state holds whole batches: save it, with the batches done in this window.
                    bar.close(finished=False)
                    checkpoint()
                    run.update_manifest(status="interrupted")
                    raise KeyboardInterrupt
            consumed += len(chunk)
            bar.update(len(chunk) - len(mine) if n_shards > 1 else 0)
            parts.add(mine)
            mine, groups_done = [], 0
            n_windows += 1
            if time.time() - last_checkpoint >= batching.checkpoint_seconds:
                checkpoint()
                last_checkpoint = time.time()
            if after_window is not None:
                after_window(n_windows)
    bar.close()

    if consumed < options.top_k:
        warnings.warn(f"--top-k {options.top_k} is larger than the {consumed} examples in the corpus; "
                      f"keeping all {consumed} for every key", FfkvWarning, stacklevel=2)
    parts.flush()
    n_examples = parts.assemble(run.table("examples"))
    write_triggers(run.table("trigger_examples"), state)
    manifest.timings["index_seconds"] = round(elapsed_before + time.time() - started, 3)
    manifest.counts = {"examples": n_examples, "tokens": n_tokens}
    manifest.status = "complete"
    run.write_manifest(manifest)
    for path in run.partial.glob("*"):
        path.unlink()
    run.partial.rmdir()
    return run
