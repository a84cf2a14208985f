"""Pruning at the paper's shape: peak memory and time of the pruning curve's data collection and of `ffkv prune`.

    python benchmarks/pruning_memory.py                       # 16 layers x 4,096 keys, d=1,024, random weights
    python benchmarks/pruning_memory.py --layers 2 --examples 16 --n-eval 4   # a quick look

A GPT-2 of the paper's shape (`common.SHAPES["paper"]`, GPT-2's vocabulary) with random weights is saved to a
folder and indexed on the first WikiText-103 lines (the run's manifest names that folder, so `ffkv prune` loads
it as a user's run would). Each step then runs in its own process, which reports its peak resident memory
(ru_maxrss) and wall time:

- ``load``: loading the model alone (the baseline: the weights);
- ``curve``: `ffkv analyze --only pruning` on a small held-out sample: the key statistics (one corpus sample),
  every criterion's removal order (redundancy: a d_m x d_m cosine matrix per layer) and 1 + 5 x 9 masked
  perplexity passes;
- ``prune``: `ffkv prune --criterion contribution --share 0.5`: statistics, surgery, save, load back, check.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, corpus_file, gpt2_shaped


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def step(name: str, run: Path, model: Path, n_eval: int, out: Path) -> dict:
    """One measured step, inside this (child) process."""
    start = time.perf_counter()
    if name == "load":
        from ffkv.models import load_model

        load_model(str(model))
    elif name == "curve":
        from ffkv.experiments import analyze

        analyze(run, only="pruning", n_eval=n_eval, eval_corpus=str(run.parent / "corpus.txt"), progress=False)
    elif name == "prune":
        from ffkv.tools.prune import prune

        prune(run, "contribution", 0.5, out)
    return {"step": name, "seconds": round(time.perf_counter() - start, 1), "peak_rss_mib": round(peak_mib())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="override the paper's 16 layers")
    parser.add_argument("--examples", type=int, default=64, help="WikiText lines indexed (the statistics' sample)")
    parser.add_argument("--n-eval", type=int, default=8, help="held-out lines of the perplexity curve")
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        folder = Path(args.folder)
        print(json.dumps(step(args.step, folder / "run", folder / "model", args.n_eval, folder / "pruned")))
        return

    import torch

    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import IndexOptions, build_index
    from ffkv.models import load_model

    torch.set_num_threads(torch.get_num_threads())
    folder = Path(tempfile.mkdtemp(prefix="ffkv-prune-bench-"))
    loaded = gpt2_shaped(shape="paper", layers=args.layers)
    loaded.model.save_pretrained(folder / "model")
    loaded.tokenizer.hf.save_pretrained(folder / "model")
    del loaded
    corpus = corpus_file(args.examples)
    (folder / "corpus.txt").write_text(corpus.read_text())
    started = time.perf_counter()
    build_index(load_model(str(folder / "model")), CorpusSpec(source=str(folder / "corpus.txt"), unit="line"),
                folder / "run", IndexOptions(top_k=5), progress=False)
    view = load_model(str(folder / "model")).view
    print(f"paper shape: {view.n_layers} layers x {view.d_m:,} keys, d={view.d_model:,}, |V|={view.vocab_size:,}; "
          f"indexed {args.examples} lines in {time.perf_counter() - started:.0f} s; folder {folder}", flush=True)
    for name in ("load", "curve", "prune"):
        done = subprocess.run([sys.executable, __file__, "--step", name, "--folder", str(folder),
                               "--n-eval", str(args.n_eval)], capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            raise SystemExit(f"step {name} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:6s} {result['seconds']:8.1f} s   peak RSS {result['peak_rss_mib'] / 1024:6.2f} GiB", flush=True)
        if name == "curve":
            from ffkv.store.run import RunDir

            description = RunDir(folder / "run").metric_description("pruning")
            print(f"       curve over n = {description['n_tokens']:,} held-out tokens ({description['n_examples']} lines), "
                  f"statistics from {description['statistics']['positions']:,} positions", flush=True)
        if name == "prune":
            info = json.loads((folder / "pruned" / "ffkv_pruning.json").read_text())
            print(f"       d_m {info['d_m_before']:,} -> {info['d_m_after']:,} per layer", flush=True)


if __name__ == "__main__":
    main()
