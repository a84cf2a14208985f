"""`ffkv analyze` at a large model's shape, one experiment per process: wall time and peak memory.

A randomly initialised model of one of `SHAPES` (Llama-3.1-8B's by default: 4,096 wide, 14,336 keys
per layer, gated SiLU, a 128,256-token vocabulary), cut to `--layers` layers, is saved once under
`--work` in the Hugging Face format (GPT-2's tokenizer stands in for Llama's, which is not on disk
here), indexed by `ffkv index` over `--sentences` WikiText-103 sentences, and then each experiment of
`--only` runs as `ffkv analyze RUN --only NAME --n-eval N` in a process of its own. Each process's
wall time and peak resident memory (its ru_maxrss) are printed beside a process that only loads
the model (plus the weights file's size, if that load left the file mapped and unread), so the
difference is the experiment's own working memory. Membership, which needs a
model's training text, is given the indexed lines as members and the next lines as non-members
(a random model has no members: its AUC means nothing here, only its time and memory).

Per layer, the held-out passes keep results of (examples x layers) and the value scans work on one
chunk of keys at a time, so a cut model's memory above its weights is what the full depth needs
per layer; the time grows with the depth.

    python benchmarks/analyze_at_shape.py [--shape llama-8b] [--layers 1] [--sentences 256] [--n-eval 64]
        [--only patterns,ablations,values,composition,refinement,census,suppressed,membership,pruning,lookups]
        [--work DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import SHAPES, corpus_file, gpt2_shaped

#: Runs `ffkv` in this process and reports its peak resident memory and wall time on stderr.
MEASURED = r'''
import resource, sys, time
start = time.perf_counter()
code = 0
try:
    if sys.argv[1] == "--load-only":
        from ffkv.models.loading import load_model
        load_model(sys.argv[2])
    else:
        from ffkv.cli import main
        code = main(sys.argv[1:])
finally:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"MEASURED {peak} {time.perf_counter() - start:.2f}", file=sys.stderr)
sys.exit(code)
'''


def measured(args: list[str]) -> tuple[int, float, str]:
    """Peak RSS in bytes and wall seconds of `ffkv ARGS` in a fresh process, and its last output line."""
    done = subprocess.run([sys.executable, "-c", MEASURED, *args], capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("MEASURED ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"ffkv {' '.join(args[:3])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    _, peak, seconds = lines[-1].split()
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    return int(peak), float(seconds), tail


def saved_model(work: Path, shape: str, layers: int) -> Path:
    """The shaped random model's folder (built and saved once)."""
    folder = work / f"{shape}-{layers}-layers"
    if not (folder / "config.json").exists():
        loaded = gpt2_shaped("cpu", "float32", shape, layers)
        tmp = work / f"{folder.name}.tmp"
        loaded.model.save_pretrained(tmp)
        loaded.tokenizer.hf.save_pretrained(tmp)
        tmp.rename(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-8b")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--sentences", type=int, default=256, help="sentences indexed (the run's corpus)")
    parser.add_argument("--n-eval", type=int, default=64, help="held-out examples per experiment")
    parser.add_argument("--only", default="patterns,ablations,values,composition,refinement,census,suppressed,"
                                          "membership,pruning,lookups")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ffkv-analyze-at-shape")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = saved_model(args.work, args.shape, args.layers)
    corpus = corpus_file(args.sentences)
    run = args.work / f"run-{model.name}-{args.sentences}"
    if not (run / "manifest.json").exists():
        start = time.perf_counter()
        peak, seconds, tail = measured(["index", "--model", str(model), "--corpus", str(corpus), "--out", str(run),
                                        "--no-progress"])
        print(f"index: {seconds:.1f} s, peak RSS {peak / 2**30:.2f} GiB  ({tail}; {time.perf_counter() - start:.0f} s)",
              flush=True)
    peak, seconds, _ = measured(["--load-only", str(model)])
    # A load that does nothing else may leave the weights file mapped and unread: then add its size.
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    base = peak if peak >= weights else peak + weights
    print(f"{args.shape} cut to {args.layers} layer(s), float32, CPU; held-out examples {args.n_eval}", flush=True)
    print(f"load only: {seconds:.1f} s, peak RSS {peak / 2**30:.2f} GiB; weights file {weights / 2**30:.2f} GiB",
          flush=True)
    for name in args.only.split(","):
        extra = []
        if name == "membership":  # the indexed lines stand in for training text, the next ones for unseen text
            extra = ["--member-corpus", str(corpus), "--nonmember-corpus",
                     str(corpus_file(args.sentences, skip=args.sentences)), "--n-membership", str(args.n_eval)]
        peak, seconds, tail = measured(["analyze", str(run), "--only", name, "--n-eval", str(args.n_eval),
                                        "--no-progress", *extra])
        print(f"{name}: {seconds:.1f} s, peak RSS {peak / 2**30:.2f} GiB (+{(peak - base) / 2**30:.2f} GiB over "
              f"the loaded weights)  {tail}", flush=True)


if __name__ == "__main__":
    main()
