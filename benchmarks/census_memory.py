"""The census (`ffkv analyze --only census`) at the paper's shape: peak memory and time, beside one plain forward pass.

A randomly initialised GPT-2 of the paper's shape (16 layers x 4,096 keys, d = 1,024; GPT-2's 50,257-token
vocabulary), real WikiText-103 sentences as the held-out sample, side by side in one process:

- forward: the model's blocks over the held-out examples once;
- census: its three streaming passes, every key's statistics, the value projections (16 x 4,096 x |V|, chunked)
  and the classes (`ffkv.experiments.census.compute`).

Memory is the process's resident set (RSS, sampled every 5 ms from /proc/self/statm): the baseline right before
the census (model loaded, examples read) and the peak during it; their difference is the census's working memory.

    python benchmarks/census_memory.py [--n-eval 64] [--device cpu] [--layers 16]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from common import corpus_file, gpt2_shaped, timed

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """The largest RSS seen while the block runs (a sampling thread)."""

    def __enter__(self) -> "PeakRss":
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-eval", type=int, default=64, help="held-out sentences (default 64)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the paper's 16 (quick runs)")
    args = parser.parse_args()

    from ffkv.corpus import CorpusSpec
    from ffkv.experiments import census
    from ffkv.experiments.common import RunContext

    loaded = gpt2_shaped(args.device, "float32", "paper", args.layers)
    view = loaded.view
    spec = CorpusSpec(source=str(corpus_file(4 * args.n_eval)), unit="sentence", max_examples=args.n_eval)
    ctx = RunContext(None, None, loaded, progress=False, eval_spec=spec)
    held = ctx.held_out()
    positions = sum(len(e.token_ids) for e in held.examples)
    batches = list(census._batches(ctx))

    def forward() -> None:
        with torch.no_grad():
            for _, batch in batches:
                view.forward(batch.input_ids, batch.attention_mask)

    forward_s = timed(forward)
    baseline = rss()
    with PeakRss() as peak:
        start = time.perf_counter()
        result = census.census_tables(ctx)
        census_s = time.perf_counter() - start
    per_layer = result["per_layer"]
    gib = 2 ** 30
    print(f"model: {view.n_layers} layers x {view.d_m:,} keys, d = {view.d_model:,}, |V| = {view.vocab_size:,}; "
          f"{len(held.examples)} held-out sentences, {positions:,} positions; device {args.device}")
    print(f"forward pass: {forward_s:.1f} s; census: {census_s:.1f} s (ratio {census_s / forward_s:.1f}x; the census "
          f"runs three passes and projects every value)")
    print(f"RSS before the census: {baseline / gib:.2f} GiB; peak during it: {peak.peak / gib:.2f} GiB; "
          f"census working memory: {(peak.peak - baseline) / gib:.2f} GiB")
    print(f"keys classed: {len(result['keys']):,}; mean share dead {per_layer['share_dead'].mean():.3f}, "
          f"detectors {per_layer['share_detector'].mean():.3f}")


if __name__ == "__main__":
    main()
