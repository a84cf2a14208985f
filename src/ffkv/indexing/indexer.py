"""`ffkv index`: the top-t trigger examples of every key in every layer, in one streaming pass.

docs/definitions.md. The corpus is read once, in windows of consecutive examples; each
window is cut into batches of similar length, run through the model with a
coefficient capture that reduces every layer at once (`TriggerReducer`), and
merged into an exact running top-k kept on the model's device. Every
`checkpoint_seconds` (checked after each batch) the run saves a checkpoint;
`resume=True` continues from the last one and ends with the identical result, or
refuses (`ffkv.indexing.checkpoint`). Before anything is written, `ffkv.indexing.preflight`
checks what would make the run fail later. While it works the process holds the run's
lock and the manifest says `running` with its pid, host and heartbeat; it ends
`complete`, `interrupted` (Ctrl-C, at a checkpoint) or `failed` (with the error).
Peak memory: one layer's activations for one batch, the (L, d_m, k) state, the
candidates not yet merged (on a CPU, 2·k plus one batch's, at most 3·k per key, so at
most three times the state: `TriggerReducer`), and at most `part_rows` buffered examples.
With a dictionary (`dictionary=`, `ffkv.memories.latent_keys`), the same for its latents in the same pass: one
layer's pre-activations (B, T, n_latents) for one batch (a TopK dictionary's activations are then reduced from
its (B, T, k) active entries, `ffkv.indexing.sparse`), and a (1, n_latents, k) state per layer it covers.
"""

from __future__ import annotations

import itertools
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, ContextManager, Mapping

import torch
from ffkv.corpus import CorpusSpec, CorpusReader, fingerprint
from ffkv.dictionaries import Dictionary, check_against, open_dictionary
from ffkv.errors import FfkvError, Interrupted, said, warn
from ffkv import threads
from ffkv.batching import Batch, collate, length_batches, windows
from ffkv.indexing import excluded
from ffkv.indexing.checkpoint import CUTTING, Checkpoint
from ffkv.indexing.preflight import check_free_space, check_output, estimate_bytes, fit_positions
from ffkv.indexing.reducer import MODES, TriggerReducer
from ffkv.indexing.interrupt import deferred_interrupt
from ffkv.indexing.prefetch import default_workers, prefetched_examples
from ffkv.indexing.progress import IndexBar
from ffkv.memories.latent_keys import DIRECTIONS as LATENT_DIRECTIONS, LatentKeys
from ffkv.indexing.sinks import Feed, KeySink, model_keys, random_keys
from ffkv.indexing.topk import SIGNS, TopKState
from ffkv.memories.controls import DEFAULT_CONTROL_KEYS, RandomKeys
from ffkv.models.loading import LoadedModel
from ffkv.indexing.tables import (CONTROL_KEYS, CONTROL_TRIGGERS, examples_table, parquet_batches, write_control,
                               write_examples, write_latents, write_triggers)
from ffkv.store import atomic
from ffkv.store.manifest import Identity, Manifest, ModelInfo, library_versions
from ffkv.store.run import RunDir

#: Seconds between two heartbeats of a running index in its manifest.
HEARTBEAT_SECONDS = 30.0


@dataclass(frozen=True)
class IndexOptions:
    """Options of `build_index` that shape the result (batching never does).

    Attributes:
        top_k: trigger examples kept per key (per direction).
        control_keys: random control memories indexed per layer beside the model's keys, through the same
            reduction (`ffkv.memories.controls`; 0: none, and key-side findings then have no control).
        control_seed: the seed of their random directions.
        mode: ``example`` (an example counts once per key, at its best prefix) or ``prefix``.
        sign: ``positive`` (the largest coefficients of each key) or ``both`` (also the most negative
            ones); None: ``both`` when the model's coefficients can be negative (gated, GELU, SiLU:
            `MemoryView.signed`), ``positive`` for ReLU (`for_model` decides).
    """

    top_k: int = 50
    mode: str = "example"
    sign: str | None = None
    control_keys: int = DEFAULT_CONTROL_KEYS
    control_seed: int = 0

    def validate(self) -> None:
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= 32767:
            raise FfkvError(f"--top-k must be an integer from 1 to 32767, got {self.top_k!r}")
        if isinstance(self.control_keys, bool) or not isinstance(self.control_keys, int) \
                or not 0 <= self.control_keys <= 65536:
            raise FfkvError(f"--control-keys must be an integer from 0 to 65536, got {self.control_keys!r}")
        if isinstance(self.control_seed, bool) or not isinstance(self.control_seed, int):
            raise FfkvError(f"--control-seed must be an integer, got {self.control_seed!r}")
        if self.mode not in MODES:
            raise FfkvError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.sign is not None and self.sign not in SIGNS:
            raise FfkvError(f"--sign must be one of {', '.join(SIGNS)}, got {self.sign!r}")

    def for_model(self, loaded: LoadedModel) -> "IndexOptions":
        """The options with `sign` decided for this model; ``both`` is refused where no coefficient can
        be negative (its negative direction would rank zeros)."""
        self.validate()
        signed = loaded.view.signed
        if self.sign is None:
            return replace(self, sign="both" if signed else "positive")
        if self.sign == "both" and not signed:
            raise FfkvError("--sign both: this model's coefficients are never negative (a ReLU-style activation "
                            "and no gate), so there is no negative direction to mine; use --sign positive")
        return self

    @property
    def directions(self) -> tuple[int, ...]:
        """The trigger directions kept (+1, and -1 for ``both``); call on options decided by `for_model`."""
        if self.sign is None:
            raise ValueError("the sign is decided per model: call for_model first")
        return SIGNS[self.sign]


@dataclass(frozen=True)
class BatchOptions:
    """How examples are grouped for the forward pass (speed only, never the result).

    A checkpoint records the fields that cut the corpus into batches (`cutting`): a resume
    must keep them; `checkpoint_seconds`, `part_rows` and `tokenizer_workers` may change.
    """

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
        if self.max_batch_tokens is not None and (not isinstance(self.max_batch_tokens, int)
                                                  or self.max_batch_tokens < 1):
            raise FfkvError(f"--max-batch-tokens must be a positive integer, got {self.max_batch_tokens!r}")
        if self.pad_multiple is not None and (not isinstance(self.pad_multiple, int) or self.pad_multiple < 1):
            raise FfkvError(f"pad_multiple must be a positive integer or None, got {self.pad_multiple!r}")
        seconds = self.checkpoint_seconds
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds)
                or seconds < 0):
            raise FfkvError(f"--checkpoint-seconds must be a finite number of seconds >= 0, got {seconds!r}")

    def cutting(self, device: torch.device) -> dict:
        """What cuts the corpus into windows and batches on `device` (a checkpoint's meaning)."""
        cut = {name: getattr(self, name) for name in CUTTING if name not in ("pad_multiple", "device")}
        return {**cut, "pad_multiple": self.pad_to(device), "device": device.type}


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


def cut_notice(n_cut: int, max_tokens: int) -> str:
    """The one line `ffkv index` prints when examples were longer than the length it keeps."""
    return (f"{n_cut:,} example{'s' if n_cut != 1 else ''} held more than {max_tokens} tokens and "
            f"{'were' if n_cut != 1 else 'was'} cut to the first {max_tokens} (the maximum length: "
            f"{said('--max-tokens', 'max_tokens')}, or the model's positions); the manifest's counts.examples_cut "
            f"records how many; a shorter {said('--unit', 'unit')} keeps all of the text")


def _identity(loaded: LoadedModel, spec: CorpusSpec, options: IndexOptions, batching: BatchOptions,
              shard: tuple[int, int], progress: bool, latents: LatentKeys | None = None) -> Identity:
    index = asdict(options)
    if latents is not None:  # the dictionary's content defines the latent tables: another one is another run
        index["dictionary"] = latents.identity()
    identity = Identity(model_id=loaded.model_id, weights_sha256=loaded.weights_hash(), dtype=loaded.dtype,
                        corpus=spec.to_dict(), corpus_fingerprint=fingerprint(spec, progress), index=index)
    if shard[1] > 1:  # shards must cut the same batches to merge exactly
        cut = {name: getattr(batching, name) for name in CUTTING if name != "device"}
        identity = replace(identity, shard=shard, batching=cut)
    return identity


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


def index_capture(loaded: LoadedModel, reducer: TriggerReducer | KeySink) -> ContextManager:
    """The capture that the index's forward passes run in: every layer's coefficients (and what the sink's other
    key families read: the FF input, the FF output) go to `reducer`, and each pass ends there (the last layer's
    down-projection runs only when its output is read)."""
    return loaded.view.capture(reducer.quantities, sink=reducer, stop_early=True)


def index_batch(loaded: LoadedModel, reducer: TriggerReducer | KeySink, batch: Batch) -> None:
    """One batch of the index: the forward pass, reduced inside it by `reducer` (a capture
    sink that must be open on the model's coefficients), then committed (`reducer.flush`
    merges what the reducer still buffers into its state)."""
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
    dictionary: str | Path | Mapping[int, Dictionary] | None = None,
) -> RunDir:
    """Index a corpus: write RUN/{manifest.json, examples.parquet, trigger_examples.parquet}, the control's tables,
    and with a dictionary its latents' (`ffkv.memories.latent_keys`).

    Args:
        loaded: the model (see `ffkv.models.loading.load_model`).
        spec: the corpus. The default `max_tokens` is cut to the model's positions; a larger other value
            is an error (`ffkv.indexing.preflight.fit_positions`).
        out: the run directory (created; must be new, or an unfinished run with `resume`).
        options: top-k, mode and sign (they define the result; the sign's default is decided here,
            `IndexOptions.for_model`, and recorded in the manifest).
        batching: batch size, grouping and checkpoint interval (speed only).
        resume: continue an unfinished run (interrupted, failed, or killed) from its last
            checkpoint; refused when the batching that cut the checkpoint changed.
        progress: show a progress bar.
        after_window: called with the number of windows done (tests use it to interrupt).
        shard: (i, n): index only the batches that shard i of n owns; `merge_runs`
            joins the n shard runs into the run one process would have written, byte for byte.
        dictionary: a sparse dictionary (a path `ffkv.dictionaries.open_dictionary` reads, or its result) whose
            latents are indexed in the same pass, layer by layer where it has one: latent_trigger_examples.parquet,
            and with a control (`options.control_keys`, also the number of control latents per layer)
            latent_control_trigger_examples.parquet and latent_control_keys.parquet.

    Returns:
        The finished run directory.

    Raises:
        FfkvError: bad options or corpus, a folder that holds something else, a run that
            another process writes (`ffkv.store.lock.RunLocked`), a filesystem error
            (the run is then marked failed).
        Interrupted: Ctrl-C; the run is marked interrupted at its last checkpoint.
    """
    options = options.for_model(loaded)
    batching.validate()
    shard_index, n_shards = shard
    if not (isinstance(n_shards, int) and n_shards >= 1 and 0 <= shard_index < n_shards):
        raise FfkvError(f"--shard must be i/n with 0 <= i < n, got {shard_index}/{n_shards}")
    spec = fit_positions(loaded, spec).located()
    latents = _latents(loaded, dictionary, options) if dictionary is not None else None
    run = RunDir(out)
    check_output(run.path)
    if resume and not run.exists():
        raise FfkvError(f"nothing to resume in {run.path}: no run was started there")
    reader = CorpusReader(spec, loaded.tokenizer)
    if next(iter(reader), None) is None:  # before anything is written, so a bad corpus leaves no run behind
        raise FfkvError(f"the corpus {spec.source} gave no examples (empty, blank, or every example "
                        "shorter than the minimum length); check --corpus, --format and --unit")
    identity = _identity(loaded, spec, options, batching, (shard_index, n_shards), progress, latents)
    latent_entries = 0 if latents is None else options.top_k * len(LATENT_DIRECTIONS) * sum(
        d.n_latents + options.control_keys for d in latents.dictionaries.values())
    check_free_space(run.path, estimate_bytes(loaded, spec, options.top_k * len(options.directions),
                                                 options.control_keys, latent_entries))
    with run.lock("index", create=True) as holder:
        previous = run.prepare(identity, resume)
        manifest = previous or Manifest(identity=identity, model=model_info(loaded), corpus=spec.to_dict(),
                                        index={}, versions=library_versions())
        started_with = previous.index.get("threads") if previous is not None else None
        with threads.running_with(started_with if isinstance(started_with, int) and started_with > 0 else None) \
                as count:
            manifest.index = {**asdict(options), "batching": asdict(batching), "threads": count}
            if latents is not None:
                manifest.index["dictionary"] = latents.described()
            job = _IndexJob(loaded, spec, run, options, batching, (shard_index, n_shards), progress, after_window,
                            latents)
            job.start(resume=previous is not None)
            try:
                with run.writing(manifest, holder, "rerun the same command with --resume"):
                    job.index(manifest)
                    job.finish(manifest)
            except KeyboardInterrupt:
                raise Interrupted(job.interrupted_message()) from None
    return run


def _latents(loaded: LoadedModel, dictionary: str | Path | Mapping[int, Dictionary],
             options: IndexOptions) -> LatentKeys:
    """The dictionary's latents on the model's device, checked against the model (one line naming the file)."""
    dictionaries = open_dictionary(dictionary) if isinstance(dictionary, (str, Path)) else dict(dictionary)
    if not dictionaries:
        raise FfkvError("dictionary: no layer's dictionary given (expected FF layer -> Dictionary)")
    view = loaded.view
    check_against(dictionaries, view.n_layers, view.d_model)
    return LatentKeys(dictionaries, options.control_keys, options.control_seed, view.device)


class _IndexJob:
    """One pass of `build_index` over the corpus, from a checkpoint or the start."""

    def __init__(self, loaded: LoadedModel, spec: CorpusSpec, run: RunDir, options: IndexOptions,
                 batching: BatchOptions, shard: tuple[int, int], progress: bool,
                 after_window: Callable[[int], None] | None, latents: LatentKeys | None = None) -> None:
        self.loaded, self.spec, self.run, self.options, self.batching = loaded, spec, run, options, batching
        self.latents = latents
        self.shard, self.progress, self.after_window = shard, progress, after_window
        self.device = loaded.view.device
        self.checkpoint_path = run.partial / "checkpoint.pt"
        self.started = time.time()

    def start(self, resume: bool) -> None:
        """Load the checkpoint to continue from (refused unless it is one this run writes: `Checkpoint.load`), or
        start empty."""
        view, cutting = self.loaded.view, self.batching.cutting(self.device)
        n_control, latents = self.options.control_keys, self.latents
        if resume and self.checkpoint_path.exists():  # refused unless it is one this run writes, from its shapes
            self.at = Checkpoint.load(self.checkpoint_path, self.device, like=self._empty(cutting, "meta"))
        else:
            self.at = self._empty(cutting, self.device)
        self.elapsed_before = self.at.elapsed
        signed = self.options.sign == "both"
        mode = self.options.mode
        feeds = model_keys(TriggerReducer(self.at.state, mode, signed=signed), view.n_layers)
        self.control_keys = RandomKeys(view, n_control, self.options.control_seed) if n_control else None
        if self.control_keys is not None:
            feeds += random_keys(TriggerReducer(self.at.control, mode, signed=signed), self.control_keys)
        if latents is not None:
            feeds += self._latent_feeds(latents)
        self.reducer = KeySink(feeds)
        self.run.partial.mkdir(parents=True, exist_ok=True)
        self.parts = _ExampleParts(self.run.partial, self.batching.part_rows, self.at.n_parts)

    def _empty(self, cutting: dict, device: torch.device | str) -> Checkpoint:
        """The checkpoint this run starts from when it resumes none: every top-k state empty, on `device` (the
        meta device: only the shapes and dtypes, what a checkpoint to resume is checked against)."""
        view, k = self.loaded.view, self.options.top_k
        n_control, directions = self.options.control_keys, len(self.options.directions)
        empty = lambda rows: TopKState.empty(view.n_layers, rows, k, device)  # noqa: E731
        at = Checkpoint(empty(view.d_m * directions), cutting,
                        control=empty(n_control * directions) if n_control else None)
        if self.latents is not None:  # one state per layer the dictionary covers: widths may differ between layers
            one = lambda rows: TopKState.empty(1, rows * len(LATENT_DIRECTIONS), k, device)  # noqa: E731
            at.latents = {layer: one(d.n_latents) for layer, d in self.latents.dictionaries.items()}
            at.latent_control = {layer: one(n_control) for layer in self.latents.layers} if n_control else None
        return at

    def _latent_feeds(self, latents: LatentKeys) -> list[Feed]:
        """Each dictionary layer's latents (and control latents) from the site its keys read, into one-layer states."""
        feeds = []
        for layer in latents.layers:
            targets = [self.at.latents[layer]] + ([self.at.latent_control[layer]] if self.at.latent_control else [])
            reducers = tuple((TriggerReducer(state, self.options.mode), 0) for state in targets)
            feeds.append(Feed(latents.reads(layer), layer, reducers,
                              lambda x, layer=layer: latents.coefficients(layer, x)))
        return feeds

    def interrupted_message(self) -> str:
        if self.at.saved:
            return "interrupted; the run is saved at its last checkpoint: rerun the same command with --resume"
        return "interrupted before the first checkpoint; rerun the same command with --resume to start it again"

    def checkpoint(self, manifest: Manifest) -> None:
        self.reducer.flush()  # the state then holds every batch indexed so far
        self.parts.flush()
        self.at.n_parts = self.parts.n_parts
        self.at.elapsed = self.elapsed_before + time.time() - self.started
        self.at.save(self.checkpoint_path)
        self.run.heartbeat(manifest)

    def index(self, manifest: Manifest) -> None:
        """Read the corpus after the checkpoint, window by window, into the state."""
        loaded, batching, at = self.loaded, self.batching, self.at
        shard_index, n_shards = self.shard
        reader = CorpusReader(self.spec, loaded.tokenizer)
        workers = batching.workers(self.device, self.spec)
        if workers:
            stream = prefetched_examples(self.spec, loaded.tokenizer, skip=at.consumed, workers=workers)
        else:
            stream = itertools.islice(iter(reader), at.consumed, None)
        reducer = self.reducer
        pad_multiple = batching.pad_to(self.device)
        special = loaded.special_ids
        bar = IndexBar(self.spec, initial=at.consumed, show=self.progress)
        last_checkpoint = last_beat = time.time()

        def due(last: float, every: float) -> bool:
            return time.time() - last >= every

        mine: list = []  # examples of this shard's batches in the current window
        with index_capture(loaded, reducer), deferred_interrupt() as interrupted:
            for chunk in windows(stream, batching.batch_size * batching.window_batches):
                groups = length_batches(chunk, batching.batch_size, batching.max_batch_tokens)
                for g, group in enumerate(groups):
                    if (at.windows + g) % n_shards != shard_index:
                        continue
                    if g < at.groups_done:  # done before the checkpoint that this run resumes
                        mine.extend(group)
                        continue
                    batch = collate(group, loaded.tokenizer.pad_id, special, pad_multiple).to(self.device)
                    index_batch(loaded, reducer, batch)
                    at.groups_done = g + 1
                    mine.extend(group)
                    at.n_tokens += batch.n_tokens
                    at.n_cut += sum(bool(getattr(e, "cut", False)) for e in group)
                    rate = at.n_tokens / max(time.time() - self.started + self.elapsed_before, 1e-9)
                    bar.update(len(group), tok_s=f"{rate:,.0f}")
                    if interrupted():  # the state holds whole batches: save them, with the window's place
                        bar.close(finished=False)
                        self.checkpoint(manifest)
                        raise KeyboardInterrupt
                    if due(last_checkpoint, batching.checkpoint_seconds):
                        self.checkpoint(manifest)
                        last_checkpoint = last_beat = time.time()
                    elif due(last_beat, HEARTBEAT_SECONDS):
                        self.run.heartbeat(manifest)
                        last_beat = time.time()
                at.consumed += len(chunk)
                bar.update(len(chunk) - len(mine) if n_shards > 1 else 0)
                self.parts.add(mine)
                mine, at.groups_done = [], 0
                at.windows += 1
                if due(last_checkpoint, batching.checkpoint_seconds):
                    self.checkpoint(manifest)
                    last_checkpoint = last_beat = time.time()
                if self.after_window is not None:
                    self.after_window(at.windows)
        bar.close()

    def finish(self, manifest: Manifest) -> None:
        """Write the tables, then mark the run complete and remove its checkpoints."""
        at, run = self.at, self.run
        if at.consumed < self.options.top_k:
            warn(f"{said('--top-k', 'top_k')} {self.options.top_k} is larger than the {at.consumed} examples in the "
                 f"corpus; keeping all {at.consumed} for every key")
        self.checkpoint(manifest)  # an error in the writes below then resumes with nothing left to index
        n_examples = self.parts.assemble(run.table("examples"))
        write_triggers(run.table("trigger_examples"), at.state, self.options.directions)
        if at.control is not None:
            write_control(run, at.control, self.control_keys, self.options.directions)
        control = (CONTROL_TRIGGERS, CONTROL_KEYS) if at.control is not None else ()
        latent_tables = () if at.latents is None else write_latents(run, at.latents, at.latent_control, self.latents,
                                                                       LATENT_DIRECTIONS)
        for table in ("examples", "trigger_examples", *control, *latent_tables):
            run.record_table(manifest, run.table(table).name, "index")
        manifest.timings["index_seconds"] = round(at.elapsed, 3)
        left_out = excluded.count(run.table("examples"), self.loaded.special_ids)
        manifest.counts = {"examples": n_examples, "tokens": at.n_tokens, "examples_cut": at.n_cut,
                           "excluded_positions": int(sum(left_out.values()))}
        manifest.index["excluded_tokens"] = excluded.named(left_out, self.loaded.tokenizer)
        if at.n_cut:
            warn(cut_notice(at.n_cut, self.spec.max_tokens))
        manifest.status, manifest.process, manifest.error = "complete", None, None
        run.write_manifest(manifest)
        shutil.rmtree(run.partial, ignore_errors=True)
        run.clean_temporary()
