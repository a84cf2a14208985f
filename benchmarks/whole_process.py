"""`ffkv index` as a user runs it, against a plain Hugging Face forward script, both as whole processes.

Each side is a fresh Python process over the same short lines (one example per line) of
WikiText-103, with the same batching (windows of batch_size x 16 examples, each cut into
length-sorted batches of at most `--batch-size` examples and `--max-batch-tokens` tokens)
and the same model: a GPT-2-small-shaped model with random weights saved once to a local
folder (`--work`), loaded from there by both. The wall time of each process includes start-up
and imports, loading the model, reading and tokenizing the lines; for ffkv also hashing the
weights, fingerprinting the corpus, the reductions and merges, and writing every table.

The plain script runs the model's blocks (`model.transformer`, no LM head, which the index does
not run either) on right-padded batches without an attention mask, as the index does for a
causal model: both compute the same thing, so the ratio is ffkv's whole overhead.

The `ffkv` command sets glibc to keep freed memory for reuse (`ffkv.allocator`), which makes
its forward pass itself faster than the plain script's. A third process therefore runs the plain
script with the same allocator setting (through glibc's environment variables): the index's ratio
to the plain script as a user writes it is what a user waits for (the goal), its ratio to that
third process is the index's own overhead, like for like.

The processes take turns (the order rotates), `--repeats` times; the ratio of each set's
index to each plain process, their medians and spread, the ratios of their CPU times (user +
system), and the load average before each run are printed. Goal: ratio <= 1.10.

    python benchmarks/whole_process.py [--lines 1500] [--repeats 3] [--work /tmp/ffkv-whole-process]
        [--profile PATH]   # also write a cProfile of one ffkv process to PATH
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import SHAPES, shared_data

from ffkv.corpus.spec import DEFAULT_MAX_TOKENS  # both sides cut examples there (`ffkv index`'s default)

#: The efficient plain forward script a user would write: tokenize every line, sort all of them by
#: length, batches of the same size and token budget, `torch.inference_mode()`, blocks only, no mask.
PLAIN = r"""
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, corpus, batch_size, max_batch_tokens, max_tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
lines = [l.strip() for l in open(corpus, encoding="utf-8") if l.strip()]
ids = sorted((x[:max_tokens] for x in tokenizer(lines)["input_ids"]), key=len)
batches, batch = [], []
for x in ids:
    if len(batch) == batch_size or (batch and len(x) * (len(batch) + 1) > max_batch_tokens):
        batches.append(batch)
        batch = []
    batch.append(x)
batches.append(batch)
with torch.inference_mode():
    for batch in batches:
        t = len(batch[-1])
        model.transformer(input_ids=torch.tensor([b + [0] * (t - len(b)) for b in batch]))
print(f"plain: {len(ids)} examples, {sum(map(len, ids))} tokens, {len(batches)} batches")
"""

#: The plain script this benchmark used earlier: length-sorted only within ffkv's windows
#: (batch_size x 16 lines), `torch.no_grad()`. Kept to show both plain scripts' times side by side.
OLD_PLAIN = r"""
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, corpus, batch_size, max_batch_tokens, max_tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
lines = [l.strip() for l in open(corpus, encoding="utf-8") if l.strip()]
ids = [x[:max_tokens] for x in tokenizer(lines)["input_ids"]]
window = batch_size * 16
n_tokens = 0
with torch.no_grad():
    for start in range(0, len(ids), window):
        batch = []
        for x in sorted(ids[start:start + window], key=len):
            if len(batch) == batch_size or (batch and len(x) * (len(batch) + 1) > max_batch_tokens):
                t = max(map(len, batch))
                model.transformer(input_ids=torch.tensor([b + [0] * (t - len(b)) for b in batch]))
                n_tokens += sum(map(len, batch))
                batch = []
            batch.append(x)
        t = max(map(len, batch))
        model.transformer(input_ids=torch.tensor([b + [0] * (t - len(b)) for b in batch]))
        n_tokens += sum(map(len, batch))
print(f"old plain: {len(ids)} examples, {n_tokens} tokens")
"""

#: The corpora: short lines (WikiText-103 validation sentences of 3 to 30 words, one a line) and
#: WikiText-103 lines (its paragraphs, detokenized, one a line; cut at `--max-tokens` by both sides).
CORPORA = ("short", "wikitext")
DEFAULT_LINES = {"short": 1500, "wikitext": 400}


def prepare(work: Path, corpus_kind: str, n_lines: int) -> tuple[Path, Path]:
    """The saved random model folder and the corpus file (built once, reused)."""
    import torch
    import transformers as tf

    model_dir, corpus = work / "gpt2-small-random", work / f"{corpus_kind}-{n_lines}.txt"
    if not (model_dir / "config.json").exists():
        data = shared_data()
        if data is None or not (data / "tokenizers" / "gpt2").is_dir():
            raise SystemExit("benchmark needs ../shared/data/tokenizers/gpt2 (or FFKV_SHARED_DATA)")
        n_layer, d, heads, d_m = SHAPES["gpt2-small"]
        torch.manual_seed(0)
        config = tf.GPT2Config(n_layer=n_layer, n_embd=d, n_head=heads, n_inner=d_m, vocab_size=50257)
        tmp = work / "model.tmp"
        tf.GPT2LMHeadModel(config).eval().save_pretrained(tmp)
        tf.AutoTokenizer.from_pretrained(str(data / "tokenizers" / "gpt2")).save_pretrained(tmp)
        tmp.rename(model_dir)
    if not corpus.exists():
        from ffkv.corpus.sentences import split_sentences
        from ffkv.corpus.wikitext import detokenize

        lines: list[str] = []
        src = shared_data() / "wikitext-103" / "wiki.valid.raw"
        for raw in src.read_text(encoding="utf-8").splitlines():
            raw = raw.strip()
            if raw and not raw.startswith("="):
                if corpus_kind == "short":
                    lines += [s for s in split_sentences(detokenize(raw)) if 3 <= len(s.split()) <= 30]
                else:
                    lines.append(detokenize(raw))
            if len(lines) >= n_lines:
                break
        corpus.write_text("\n".join(lines[:n_lines]) + "\n", encoding="utf-8")
    return model_dir, corpus


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Wall seconds of a process, its CPU seconds (user + system), and its standard output (it must succeed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{done.stdout}\n{done.stderr}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, cpu, (done.stdout.strip() or done.stderr.strip())


#: The processes a set can run: the old plain script, the efficient plain script with glibc's default
#: allocator and with ffkv's setting (`ffkv.allocator`), and `ffkv index` (which sets it itself).
SIDES = ("old", "plain", "kept", "index")
LABELS = {"old": "old plain script (windows, no_grad)", "plain": "efficient plain script",
          "kept": "efficient plain script, ffkv's allocator setting", "index": "ffkv index"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", choices=CORPORA, default="short")
    parser.add_argument("--lines", type=int, default=None, help="lines of the corpus (default: 1500 short, 400 wikitext)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sides", default=",".join(SIDES), help=f"which processes take turns, of {','.join(SIDES)}")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ffkv-whole-process")
    parser.add_argument("--ffkv", default=str(Path(sys.executable).with_name("ffkv")), help="the ffkv command")
    parser.add_argument("--profile", type=Path, default=None,
                        help="only profile one ffkv process with cProfile into this file (no timing)")
    args = parser.parse_args()
    sides = args.sides.split(",")
    if not sides or any(side not in SIDES for side in sides):
        raise SystemExit(f"--sides: choose from {','.join(SIDES)}")
    args.work.mkdir(parents=True, exist_ok=True)
    n_lines = args.lines or DEFAULT_LINES[args.corpus]
    model_dir, corpus = prepare(args.work, args.corpus, n_lines)
    scripts = {}
    for name, text in (("plain", PLAIN), ("old", OLD_PLAIN)):
        scripts[name] = args.work / f"{name}_forward.py"
        scripts[name].write_text(text)
    script_args = [str(model_dir), str(corpus), str(args.batch_size), str(args.max_batch_tokens),
                   str(DEFAULT_MAX_TOKENS)]
    out = args.work / "run"

    def index_cmd(prefix: list[str]) -> list[str]:
        shutil.rmtree(out, ignore_errors=True)
        return prefix + ["index", "--model", str(model_dir), "--corpus", str(corpus), "--unit", "line",
                         "--out", str(out), "--batch-size", str(args.batch_size),
                         "--max-batch-tokens", str(args.max_batch_tokens), "--no-progress"]

    if args.profile is not None:
        seconds, _, text = run(index_cmd([sys.executable, "-m", "cProfile", "-o", str(args.profile),
                                          "-m", "ffkv.cli"]))
        print(f"profiled ffkv index: {seconds:.2f} s -> {args.profile}\n{text}")
        return
    from ffkv.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD

    kept_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
                "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
    commands = {"old": ([sys.executable, str(scripts["old"]), *script_args], None),
                "plain": ([sys.executable, str(scripts["plain"]), *script_args], None),
                "kept": ([sys.executable, str(scripts["plain"]), *script_args], kept_env),
                "index": (None, None)}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    loads: list[float] = []
    for r in range(args.repeats):
        for side in sides[r % len(sides):] + sides[: r % len(sides)]:
            load = os.getloadavg()[0]
            loads.append(load)
            cmd, env = commands[side]
            wall, used, text = run(cmd or index_cmd([args.ffkv]), env)
            seconds[side].append(wall)
            cpu[side].append(used)
            print(f"repeat {r + 1} {side:5s}: {wall:6.2f} s, CPU {used:6.1f} s  (load average "
                  f"{load:.2f})  {text.splitlines()[-1]}", flush=True)
    print(f"corpus={args.corpus} lines={n_lines} repeats={args.repeats} batch_size={args.batch_size} "
          f"cpus={os.cpu_count()} torch threads default; load average {min(loads):.2f}-{max(loads):.2f}")
    print("\n".join(f"{LABELS[side]}: median {statistics.median(t):.2f} s (min {min(t):.2f}, max {max(t):.2f})"
                    for side, t in seconds.items()))
    if "index" not in sides:
        return
    for base, what in (("kept", "over the efficient plain script, same allocator setting (goal <= 1.10)"),
                       ("plain", "over the efficient plain script, glibc's default allocator"),
                       ("old", "over the old plain script")):
        if base not in sides:
            continue
        pairs = [i / p for i, p in zip(seconds["index"], seconds[base])]
        cpu_pairs = [i / p for i, p in zip(cpu["index"], cpu[base])]
        print(f"ratio {what}, per set: {', '.join(f'{p:.3f}' for p in pairs)};  median "
              f"{statistics.median(pairs):.3f} (spread {min(pairs):.3f}-{max(pairs):.3f});  CPU time ratio "
              f"median {statistics.median(cpu_pairs):.3f}")


if __name__ == "__main__":
    main()
