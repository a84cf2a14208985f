"""`ffkv train-dictionary`: train a TopK transcoder (or a skip transcoder) per chosen FF layer on a corpus, write
it in sparsify's layout, and measure how well it stands in for the layer.

Training streams the corpus's train split once (memory does not grow with it): each step runs the model on
`batch_size` consecutive examples, captures every chosen layer's FF input and output at the real, non-special
tokens (`MemoryView.capture`) and takes one Adam step per layer (`ffkv.dictionaries.train`, sparsify's recipe).

Resumable to the same bits: a checkpoint (weights, Adam's moments, the step, the examples and tokens read,
the latents' firing record, the FF outputs' running sums) is written atomically every `checkpoint_seconds`
and at Ctrl-C (at the end of a step); a run killed at any point (kill -9 included) and continued with
``resume=True`` re-reads the examples after the last checkpointed one and ends with the weights an
uninterrupted run ends with. On the CPU this holds bit for bit, and the transcoders' own arithmetic is the
same on any thread count (`ffkv.dictionaries.train`); the model's matrix products are the BLAS library's,
which rounds some shapes differently under another thread count, so a checkpoint records the device and the
threads, and a resume under others warns that the last bits may differ. On a GPU it holds where its kernels
are deterministic (the decoder is dense there for that reason: `TopKTranscoder.decode`).

A checkpoint is refused, in one line naming the file and the entry, unless every entry is what this training
writes (`_checkpoint_template`: each tensor's shape, dtype and device, finite values, counts that are counts),
before any of it reaches a module or an optimizer: the fused Adam kernel trusts its moments' sizes. Trained
weights that are not finite are refused before anything is written.

Fidelity, per layer, over held-out tokens (the corpus's held-out split), the model in its own dtype:

- ``fvu``: the fraction of variance of the FF output the transcoder leaves unexplained (0 is perfect);
- ``dead_latents``: latents that never fired over those tokens (and the training tokens' count, from the
  firing record kept while training);
- the next-token loss of the model as it is (``loss_original``), with the layer's FF output replaced by the
  transcoder's reconstruction (``loss_spliced``) and by the FF output's mean over the training tokens
  (``loss_mean_ablated``); ``loss_recovered`` = (L_mean − L_spliced) / (L_mean − L_original): 1 when the
  splice costs nothing, 0 when it is no better than the mean. Replacements apply at the tokens the
  transcoder is trained on (real, non-special), one layer at a time.

These are `ffkv.dictionaries.fidelity`'s measures, through `ffkv.memories.dictionary_fidelity`'s passes: the
latents_beside study measures a run's dictionary with the same code.

Outputs in `out`: one folder per layer named after its hookpoint (``layers.3.mlp``: ``cfg.json`` +
``sae.safetensors``, `ffkv.dictionaries.sparsify_layout.save_sparsify`, which sparsify's
``SparseCoder.load_many(out, local=True)`` reads), ``fidelity.parquet`` (one row per layer) and
``training.json`` (options, corpus, model, tokens, steps, times, the fidelity rows, the command). The
checkpoint is removed once these are written.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import torch

from ffkv.batching import Batch, collate, length_batches, windows
from ffkv.dictionaries.dictionary import Dictionary
from ffkv.dictionaries.hookpoints import ff_site
from ffkv.dictionaries.sparsify_layout import read_sparsify, save_sparsify
from ffkv.dictionaries.train import (TopKTranscoder, TranscoderShape, default_learning_rate, learning_rate,
                                     train_step)
from ffkv.errors import FfkvError, Interrupted, warn
from ffkv.experiments.common import progress_bar
from ffkv.indexing.interrupt import deferred_interrupt
from ffkv.memories import dictionary_fidelity
from ffkv.models.checkpoint_schema import Omittable, adam_state, check, count, either, mismatch, number, rows, text
from ffkv.models.loading import LoadedModel
from ffkv.models.safe_load import load_checkpoint
from ffkv.store import atomic

CHECKPOINT = "checkpoint.pt"
TRAINING = "training.json"
FIDELITY = "fidelity.parquet"
_FORMAT = "ffkv train-dictionary checkpoint 1"
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainDictionaryOptions:
    """Every option that changes the trained weights (checked on resume) and the evaluation.

    Attributes:
        layers: the FF layers, 0-based.
        expansion_factor, k, skip, latents: the transcoder (`TranscoderShape`); `latents`, when set, is the
            exact width instead of expansion_factor · d_model.
        tokens: training tokens (per layer) to read; the last step may pass it.
        batch_size: examples per step (sparsify's batch size, in sequences).
        lr: Adam's peak step size (None: sparsify's, 2e-4 / √(n_latents / 2¹⁴)).
        warmup: share of the tokens over which the step size warms up (then it decays linearly to zero).
        seed: seeds the encoders' initialisation (layer l draws from seed + l).
        eval_tokens: held-out tokens the fidelity is measured on (whole examples, up to this many).
        save_dtype: the dtype the transcoders are written in (float32, float16, bfloat16); the fidelity is
            measured on what is written.
    """

    layers: tuple[int, ...]
    expansion_factor: int = 32
    k: int = 32
    skip: bool = False
    tokens: int = 1_000_000
    batch_size: int = 32
    lr: float | None = None
    warmup: float = 0.05
    seed: int = 0
    eval_tokens: int = 50_000
    save_dtype: str = "float32"
    latents: int | None = None

    @property
    def shape(self) -> TranscoderShape:
        return TranscoderShape(self.expansion_factor, self.k, self.skip, self.latents)

    def validate(self, n_layers: int, d_model: int) -> None:
        if not self.layers:
            raise FfkvError("name at least one layer to train a transcoder for")
        for layer in self.layers:
            if not 0 <= layer < n_layers:
                raise FfkvError(f"layer {layer + 1} does not exist: this model has layers 1..{n_layers}")
        self.shape.validate(d_model)
        if self.tokens < 1 or self.batch_size < 1 or self.eval_tokens < 1:
            raise FfkvError("tokens, batch size and evaluation tokens must be at least 1")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise FfkvError(f"the learning rate must be a positive number, got {self.lr}")
        if self.save_dtype not in SAVE_DTYPES:
            raise FfkvError(f"unknown save dtype {self.save_dtype!r}; choose from {', '.join(SAVE_DTYPES)}")
        if not 0 <= self.warmup < 1:
            raise FfkvError(f"the warm-up share must be in [0, 1), got {self.warmup}")

    def peak_lr(self, d_model: int) -> float:
        return self.lr if self.lr is not None else default_learning_rate(self.shape.n_latents(d_model))


@dataclass
class _State:
    """What a checkpoint holds besides the options: the whole state of a run between two steps."""

    transcoders: dict[int, TopKTranscoder]
    optimizers: dict[int, torch.optim.Optimizer]
    fired: dict[int, torch.Tensor]           # latents that fired on the training tokens so far
    ff_out_sum: dict[int, torch.Tensor]      # float64 sums of the FF output over the training tokens
    step: int = 0
    examples_done: int = 0
    tokens_done: int = 0
    elapsed: float = 0.0
    last_fvu: dict[int, float] = field(default_factory=dict)
    curve: list[list[float]] = field(default_factory=list)  # per step: tokens done, then each layer's batch FVU


@dataclass
class TrainDictionaryResult:
    """What `train_dictionaries` wrote: the folder, one fidelity row per layer, and training.json's contents."""

    out: Path
    rows: list[dict[str, Any]]
    record: dict[str, Any]

    def to_text(self) -> str:
        r = self.record
        width = (f"{r['options']['latents']:,}-latent" if r['options'].get('latents') is not None
                 else f"{r['options']['expansion_factor']}x")
        lines = [f"{width} TopK{' skip' if r['options']['skip'] else ''} transcoders, "
                 f"k = {r['options']['k']}: {r['training']['tokens']:,} training tokens in {r['training']['steps']} "
                 f"steps; fidelity on {r['evaluation']['tokens']:,} held-out tokens "
                 f"({r['evaluation']['loss_tokens']:,} predicted)",
                 f"{'layer':>5}  {'FVU':>7}  {'dead (held-out)':>16}  {'dead (training)':>16}  {'loss orig':>9}  "
                 f"{'spliced':>8}  {'mean-abl':>8}  {'recovered':>9}"]
        for row in self.rows:
            lines.append(f"{row['layer'] + 1:>5}  {row['fvu']:>7.4f}  "
                         f"{row['dead_latents']:>7} ({row['dead_share']:>6.1%})  "
                         f"{row['dead_latents_training']:>7} ({row['dead_latents_training'] / row['n_latents']:>6.1%})  "
                         f"{row['loss_original']:>9.4f}  {row['loss_spliced']:>8.4f}  {row['loss_mean_ablated']:>8.4f}  "
                         f"{row['loss_recovered']:>9.3f}")
        return "\n".join(lines)


def hookpoint(loaded: LoadedModel, layer: int) -> str:
    """sparsify's name for a layer's FF module: its path under the model's base (``layers.3.mlp``,
    ``h.3.mlp``), where ffkv reads that name back as the same layer; ``layers.L.mlp`` otherwise."""
    view = loaded.view
    down = view.arch.down_proj(view.blocks[layer])
    base = view.arch.base(loaded.model)
    for name, module in base.named_modules():
        if any(child is down for child in module.children()):
            try:
                if ff_site(name).layer == layer:
                    return name
            except FfkvError:
                pass
            break
    return f"layers.{layer}.mlp"


def train_dictionaries(loaded: LoadedModel, train_examples: Callable[[], Iterable], eval_examples: Callable[[], Iterable],
                       options: TrainDictionaryOptions, out: str | Path, *, resume: bool = False,
                       checkpoint_seconds: float = 300.0, progress: bool = True, corpus: dict | None = None,
                       command: str | None = None) -> TrainDictionaryResult:
    """Train one transcoder per layer of `options.layers` on `train_examples()` (ffkv `Example`s), measure each on
    `eval_examples()` and write them to `out` (the module's docstring says what and how)."""
    view = loaded.view
    options.validate(view.n_layers, view.d_model)
    out = Path(out)
    settings = {key: value for key, value in asdict(options).items()
                if not (key == "latents" and value is None)}  # as before --latents: older checkpoints resume
    identity = {"format": _FORMAT, "options": _jsonable(settings), "corpus": corpus or {},
                "model": loaded.model_id, "dtype": loaded.dtype}
    if (out / TRAINING).is_file() and not (out / CHECKPOINT).is_file():
        raise FfkvError(f"{str(out)!r} already holds trained transcoders ({TRAINING}); choose another --out")
    if (out / CHECKPOINT).is_file() and not resume:
        raise FfkvError(f"{str(out)!r} holds an unfinished training; continue it with --resume, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic.clean_stale(out)
    state = _fresh_state(loaded, options) if not (resume and (out / CHECKPOINT).is_file()) \
        else _load_state(loaded, options, out / CHECKPOINT, identity)

    _train(loaded, train_examples, options, state, out, identity, checkpoint_seconds, progress)
    diverged = [layer + 1 for layer in options.layers
                if not all(bool(torch.isfinite(p).all()) for p in state.transcoders[layer].parameters())]
    if diverged:
        which = (f"transcoder of layer {diverged[0]} holds" if len(diverged) == 1
                 else f"transcoders of layers {', '.join(map(str, diverged))} hold")
        raise FfkvError(f"the training diverged: the {which} NaN or infinite weights after {state.step} steps, and "
                        f"nothing was written; delete {out / CHECKPOINT} and train again with a smaller --lr")

    dictionaries = {}
    for layer in options.layers:
        folder = out / hookpoint(loaded, layer)
        trained = state.transcoders[layer].to_dictionary(layer).to(dtype=SAVE_DTYPES[options.save_dtype])
        save_sparsify(trained, folder, hookpoint(loaded, layer))
        # Measured as written (values as stored, arithmetic in float32): read back as any user of the folder reads it.
        dictionaries[layer] = read_sparsify(folder).to(view.device, torch.float32)
    means = {layer: (state.ff_out_sum[layer] / max(1, state.tokens_done)).float().to(view.device)
             for layer in options.layers}
    evaluation, rows = measure_fidelity(loaded, eval_examples(), dictionaries, means, options.eval_tokens,
                                        options.batch_size, progress)
    for row in rows:
        row["dead_latents_training"] = int((~state.fired[row["layer"]]).sum())
        row["hookpoint"] = hookpoint(loaded, row["layer"])
    atomic.write_parquet(out / FIDELITY, pa.Table.from_pylist(rows))
    record = {**identity, "command": command,
              "training": {"tokens": state.tokens_done, "steps": state.step, "examples": state.examples_done,
                           "seconds": round(state.elapsed, 1), "peak_lr": options.peak_lr(view.d_model),
                           "device": str(view.device),
                           "recipe": "sparsify 1.3.3 transcoder (ffkv.dictionaries.train): Adam on the batch FVU, "
                                     "zero-initialised decoder, first-batch biases, no AuxK"},
              "evaluation": evaluation, "fidelity": rows,
              "curve": {"columns": ["tokens", *(f"fvu_layer_{layer}" for layer in sorted(options.layers))],
                        "rows": state.curve},
              "layers": {str(layer): hookpoint(loaded, layer) for layer in options.layers}}
    atomic.write_json(out / TRAINING, record)
    (out / CHECKPOINT).unlink(missing_ok=True)
    return TrainDictionaryResult(out, rows, record)


# ------------------------------------------------------------------------------------------------ training
def _fresh_state(loaded: LoadedModel, options: TrainDictionaryOptions) -> _State:
    view = loaded.view
    transcoders = {layer: TopKTranscoder(view.d_model, options.shape, seed=options.seed + layer, device=view.device)
                   for layer in options.layers}
    return _State(transcoders=transcoders,
                  optimizers={layer: _adam(t, options.peak_lr(view.d_model))
                              for layer, t in transcoders.items()},
                  fired={layer: torch.zeros(t.n_latents, dtype=torch.bool) for layer, t in transcoders.items()},
                  ff_out_sum={layer: torch.zeros(view.d_model, dtype=torch.float64) for layer in options.layers})


def _adam(transcoder: TopKTranscoder, lr: float) -> torch.optim.Adam:
    # The fused kernel: several times faster than the default loop on a CPU, and as deterministic.
    return torch.optim.Adam(transcoder.parameters(), lr=lr, fused=True)


def _save_state(state: _State, path: Path, identity: dict) -> None:
    payload = {**identity, "step": state.step, "examples_done": state.examples_done,
               "tokens_done": state.tokens_done, "elapsed": state.elapsed, "last_fvu": state.last_fvu, "curve": state.curve,
               "transcoders": {layer: t.state_dict() for layer, t in state.transcoders.items()},
               "optimizers": {layer: o.state_dict() for layer, o in state.optimizers.items()},
               "fired": state.fired, "ff_out_sum": state.ff_out_sum,
               "arithmetic": _arithmetic(next(iter(state.transcoders.values())).encoder.device)}
    atomic.write_with(path, lambda f: torch.save(payload, f))


def _arithmetic(device: torch.device) -> dict[str, Any]:
    """What a step's last bits depend on besides the state: the kind of device, and the CPU threads the model's
    matrix products are split among (the BLAS library rounds some shapes differently under another count)."""
    return {"device": device.type, "threads": torch.get_num_threads()}


def _load_state(loaded: LoadedModel, options: TrainDictionaryOptions, path: Path, identity: dict) -> _State:
    """The checkpoint at `path` as the state of this run, refused (one line naming the file and the entry) unless
    it is this training's and every entry is what a checkpoint of it holds (`_checkpoint_template`), before any
    of it reaches a module or an optimizer."""
    device = loaded.view.device
    saved = load_checkpoint(path, map_location=device, what="train-dictionary checkpoint")
    if not isinstance(saved, dict) or mismatch(saved.get("format"), _FORMAT) is not None:
        raise FfkvError(f"{str(path)!r} is not a checkpoint of `ffkv train-dictionary`; choose another --out")
    differs = [key for key in ("options", "corpus", "model", "dtype") if mismatch(saved.get(key), identity[key])]
    if differs:
        raise FfkvError(f"the checkpoint in {str(path.parent)!r} was made with another {', '.join(differs)}; resume "
                        "with the same ones, or choose another --out")
    state = _fresh_state(loaded, options)
    check(saved, _checkpoint_template(state, identity), path,
          "delete it to train from the start, or choose another --out")
    then, now = saved.get("arithmetic"), _arithmetic(device)
    if then is not None and (then["device"] != now["device"] or (now["device"] == "cpu" and then != now)):
        warn(f"the checkpoint in {path.parent} was trained on {_on(then)} and continues on {_on(now)}: the model's "
             "matrix products may round otherwise, and the transcoders then differ in their last bits from an "
             f"uninterrupted run's; resume on {_on(then)} for the same bytes")
    for layer in options.layers:
        state.transcoders[layer].load_state_dict(saved["transcoders"][layer])
        state.optimizers[layer].load_state_dict(saved["optimizers"][layer])
        state.fired[layer] = saved["fired"][layer].cpu()
        state.ff_out_sum[layer] = saved["ff_out_sum"][layer].cpu()
    state.step, state.examples_done = saved["step"], saved["examples_done"]
    state.tokens_done, state.elapsed, state.last_fvu = saved["tokens_done"], saved["elapsed"], saved["last_fvu"]
    state.curve = saved["curve"]
    return state


def _on(arithmetic: dict[str, Any]) -> str:
    if arithmetic["device"] != "cpu":
        return arithmetic["device"]
    threads = arithmetic["threads"]
    return f"the CPU with {threads} thread{'s' * (threads != 1)} (OMP_NUM_THREADS={threads})"


def _checkpoint_template(fresh: _State, identity: dict) -> dict[str, Any]:
    """What a checkpoint of this training holds (`ffkv.models.checkpoint_schema`), from its fresh state: the
    identity as it is; counts, a finite elapsed time and FVUs; the curve's rows (tokens, then each layer's FVU);
    per layer, the transcoder's tensors and the fired and FF-output records as the fresh ones are (shape, dtype,
    device, finite), and Adam's state (`adam_state`)."""
    layers = sorted(fresh.transcoders)
    any_device = next(iter(fresh.transcoders.values())).encoder.device
    on_device = lambda t: t.to(any_device)  # noqa: E731 - the checkpoint is loaded onto the model's device
    return {**identity,
            "step": count(), "examples_done": count(), "tokens_done": count(), "elapsed": number(minimum=0),
            "last_fvu": either({}, {layer: number(minimum=0) for layer in layers}),
            "curve": rows(1 + len(layers), number(minimum=0, finite=False), first=count()),
            "transcoders": {layer: t.state_dict() for layer, t in fresh.transcoders.items()},
            "optimizers": {layer: adam_state(optimizer) for layer, optimizer in fresh.optimizers.items()},
            "fired": {layer: on_device(t) for layer, t in fresh.fired.items()},
            "ff_out_sum": {layer: on_device(t) for layer, t in fresh.ff_out_sum.items()},
            "arithmetic": Omittable({"device": text(), "threads": count()})}


def _train(loaded: LoadedModel, train_examples: Callable[[], Iterable], options: TrainDictionaryOptions,
           state: _State, out: Path, identity: dict, checkpoint_seconds: float, progress: bool) -> None:
    view = loaded.view
    layers = sorted(options.layers)
    peak = options.peak_lr(view.d_model)
    stream = itertools.islice(iter(train_examples()), state.examples_done, None)
    bar = progress_bar(progress, options.tokens, "train transcoders", "tok")
    bar.update(min(state.tokens_done, options.tokens))
    saved_at = time.monotonic()
    try:
        with deferred_interrupt() as interrupted:
            while state.tokens_done < options.tokens:
                group = list(itertools.islice(stream, options.batch_size))
                if not group:
                    break  # the corpus ran out first: training.json says how many tokens were read
                started = time.perf_counter()
                n = _train_batch(loaded, layers, group, options, state, peak)
                state.step += 1
                state.examples_done += len(group)
                state.tokens_done += n
                state.curve.append([state.tokens_done, *(state.last_fvu.get(layer, math.nan) for layer in layers)])
                state.elapsed += time.perf_counter() - started
                bar.update(min(n, max(0, options.tokens - bar.n)))
                bar.set_postfix_str(" ".join(f"L{layer + 1} fvu {state.last_fvu.get(layer, float('nan')):.3f}"
                                             for layer in layers), refresh=False)
                if interrupted():
                    _save_state(state, out / CHECKPOINT, identity)
                    raise Interrupted(f"interrupted after step {state.step} ({state.tokens_done:,} of "
                                      f"{options.tokens:,} tokens); saved in {out / CHECKPOINT}: continue with --resume")
                if time.monotonic() - saved_at >= checkpoint_seconds:
                    _save_state(state, out / CHECKPOINT, identity)
                    saved_at = time.monotonic()
    finally:
        bar.close()
    if state.tokens_done == 0:
        raise FfkvError("the corpus's train split gave no token to train on")
    _save_state(state, out / CHECKPOINT, identity)  # evaluation, if cut off, starts again from here


def _positions(loaded: LoadedModel, group: Sequence) -> Batch:
    return collate(group, loaded.tokenizer.pad_id, loaded.special_ids).to(loaded.view.device)


def _at(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The rows of a captured (batch, pos, d) tensor, or one a family flattened to (batch·pos, d), at the kept
    positions, in float32."""
    return t.reshape(*keep.shape, t.shape[-1])[keep].float()


def _train_batch(loaded: LoadedModel, layers: list[int], group: Sequence, options: TrainDictionaryOptions,
                 state: _State, peak: float) -> int:
    """One step: the model's FF inputs and outputs of the group's real, non-special tokens, and one Adam step per
    layer. Returns the tokens it trained on (per layer)."""
    view = loaded.view
    batch = _positions(loaded, group)
    with view.capture(("ff_in", "ff_out"), layers=layers, stop_early=True) as cap:
        view.forward(batch.input_ids, batch.attention_mask)
    keep = batch.competes
    n = int(keep.sum())
    if n == 0:
        return 0
    lr = learning_rate(peak, state.tokens_done, options.tokens, options.warmup)
    for layer in layers:
        x = _at(cap["ff_in"][layer], keep)
        y = _at(cap["ff_out"][layer], keep)
        transcoder = state.transcoders[layer]
        if state.tokens_done == 0:
            transcoder.initialise_biases(x, y)
        with torch.enable_grad():
            fvu, fired = train_step(transcoder, state.optimizers[layer], x, y, lr)
        if not math.isnan(fvu):  # NaN: a batch without an FVU (`train_step`), no step taken
            state.last_fvu[layer] = fvu
        state.fired[layer] |= fired.cpu()
        state.ff_out_sum[layer] += y.double().sum(0).cpu()
    return n


# ------------------------------------------------------------------------------------------------ fidelity
def _eval_batches(loaded: LoadedModel, examples: Iterable, budget: int, batch_size: int) -> Iterator[Batch]:
    """Padded batches (grouped by length) of the held-out examples, whole examples until `budget` real tokens."""
    def taken() -> Iterator:
        seen = 0
        for e in examples:
            if seen >= budget:
                return
            if len(e.token_ids) >= 2:
                seen += len(e.token_ids)
                yield e
    for chunk in windows(taken(), 16 * batch_size):
        for group in length_batches(chunk, batch_size):
            yield _positions(loaded, group)


def measure_fidelity(loaded: LoadedModel, examples: Iterable, dictionaries: dict[int, Dictionary],
                     means: dict[int, torch.Tensor], eval_tokens: int, batch_size: int = 32, progress: bool = False
                     ) -> tuple[dict, list[dict]]:
    """Each transcoder's fidelity (module docstring; measured by `ffkv.memories.dictionary_fidelity`) over
    `examples` (whole examples of two or more tokens, up to `eval_tokens` real tokens): returns the evaluation's
    counts and one row per layer.

    Args:
        dictionaries: 0-based layer -> its transcoder, on the model's device.
        means: 0-based layer -> the FF output's mean (d_model,) that mean ablation writes instead.
    """
    batches = list(_eval_batches(loaded, examples, eval_tokens, batch_size))
    bar = progress_bar(progress, eval_tokens, "fidelity", "tok")
    try:
        fidelity = dictionary_fidelity.measure_fidelity(loaded.view, batches, dictionaries, means, bar.update)
    finally:
        bar.close()
    if fidelity.predicted == 0:
        raise FfkvError("the corpus's held-out split gave no example of two or more tokens to measure on")
    rows = [{"layer": row["layer"], "n_latents": row["n_latents"], "k": dictionaries[row["layer"]].k,
             "skip": dictionaries[row["layer"]].skip is not None, **row} for row in fidelity.rows()]
    return {"tokens": fidelity.tokens, "loss_tokens": fidelity.predicted, "split": "heldout"}, rows


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))
