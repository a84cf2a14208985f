"""Scaling of `ffkv index` (and with --analyze, `ffkv analyze`) with 1 and 2 processes (torchrun).

Gloo on CPU, NCCL on GPU. Each process gets one thread on a CPU (or one GPU each with
--device cuda); the same corpus and model in both runs; the merged index must be
byte-identical, and with --analyze every metrics table (and the manifest's analyses,
timings aside) of the two analyses of that run must be equal. Prints the wall time
of each, the speed-up t1 / t2 and the scaling efficiency t1 / (2 * t2).

    python benchmarks/scaling.py [--model ffkv-tiny] [--examples 6000] [--device cpu] [--analyze [--n-eval 4000]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, argv: list[str]) -> float:
    """Wall seconds of `ffkv ARGV` in n processes (torchrun for n > 1), one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = ["-m", "ffkv.cli", *argv, "--no-progress"]
    if n > 1:
        command = ["-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), *command]
    start = time.perf_counter()
    subprocess.run([sys.executable, *command], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def same_analyses(a: Path, b: Path) -> bool:
    """Whether two analysed runs hold equal metrics tables and manifest analyses (timings aside)."""
    import pandas as pd

    tables = sorted(p.name for p in (a / "metrics").glob("*.parquet"))
    if tables != sorted(p.name for p in (b / "metrics").glob("*.parquet")):
        return False
    if not all(pd.read_parquet(a / "metrics" / t).equals(pd.read_parquet(b / "metrics" / t)) for t in tables):
        return False
    analyses = [{name: {k: v for k, v in info.items() if k not in ("seconds", "time")}
                 for name, info in json.loads((run / "manifest.json").read_text())["analyses"].items()}
                for run in (a, b)]
    return analyses[0] == analyses[1]


def show(what: str, t1: float, t2: float, check: str, same: bool) -> None:
    print(f"{what}: 1 process {t1:.1f} s   2 processes {t2:.1f} s   speed-up {t1 / t2:.2f}x   "
          f"efficiency {t1 / (2 * t2):.0%}   {check}: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ffkv-tiny")
    parser.add_argument("--examples", type=int, default=6000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--analyze", action="store_true", help="also time `ffkv analyze` of the indexed run")
    parser.add_argument("--n-eval", type=int, default=4000, help="held-out examples of the analyses")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from ffkv.models.default_corpus import default_corpus_path

    corpus = default_corpus_path("train")
    work = Path(tempfile.mkdtemp())
    index = ["index", "--model", args.model, "--corpus", str(corpus), "--unit", "line",
             "--max-examples", str(args.examples), "--device", args.device]
    t1 = launch(1, [*index, "--out", str(work / "one")])
    t2 = launch(2, [*index, "--out", str(work / "two")])
    same = all((work / "one" / t).read_bytes() == (work / "two" / t).read_bytes()
               for t in ("examples.parquet", "trigger_examples.parquet"))
    print(f"model={args.model} device={args.device} examples={args.examples} (wall time, process start included)")
    show("index", t1, t2, "results byte-identical", same)
    if args.analyze:
        runs = [shutil.copytree(work / "one", work / f"analyzed-{n}") for n in (1, 2)]
        analyze = ["analyze", "--n-eval", str(args.n_eval), "--device", args.device]
        t1, t2 = (launch(n, [*analyze, str(run)]) for n, run in zip((1, 2), runs))
        show(f"analyze (n-eval {args.n_eval})", t1, t2, "tables equal", same_analyses(*runs))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
