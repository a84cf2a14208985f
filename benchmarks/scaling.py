"""Scaling of `ffkv index` with 1 and 2 processes (torchrun; Gloo on CPU, NCCL on GPU).

Each process gets one thread on a CPU (or one GPU each with --device cuda); the same
corpus and model in both runs; the merged results must be byte-identical. Prints the
throughput of each and the scaling efficiency t1 / (n * t_n).

    python benchmarks/scaling.py [--model ffkv-tiny] [--examples 6000] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
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


def run(n: int, args, corpus: Path, out: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = ["-m", "ffkv.cli", "index", "--model", args.model, "--corpus", str(corpus), "--unit", "line",
               "--max-examples", str(args.examples), "--device", args.device, "--out", str(out), "--no-progress"]
    if n > 1:
        command = ["-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), *command]
    start = time.perf_counter()
    subprocess.run([sys.executable, *command], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ffkv-tiny")
    parser.add_argument("--examples", type=int, default=6000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from ffkv.models.default_corpus import default_corpus_path

    corpus = default_corpus_path("train")
    work = Path(tempfile.mkdtemp())
    t1 = run(1, args, corpus, work / "one")
    t2 = run(2, args, corpus, work / "two")
    same = all((work / "one" / t).read_bytes() == (work / "two" / t).read_bytes()
               for t in ("examples.parquet", "trigger_examples.parquet"))
    print(f"model={args.model} device={args.device} examples={args.examples} (wall time, process start included)")
    print(f"1 process: {t1:.1f} s   2 processes: {t2:.1f} s   speed-up {t1 / t2:.2f}x   "
          f"efficiency {t1 / (2 * t2):.0%}   results byte-identical: {same}")


if __name__ == "__main__":
    main()
