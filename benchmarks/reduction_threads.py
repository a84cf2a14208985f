"""The index's per-layer work on one thread and on torch's default threads, at SmolLM2-135M's shape.

On a CPU shared with other jobs, every parallel operation waits for all of its threads to be
scheduled, so many small operations cost far more than their work. This times, on random
coefficients of one batch (B x T x d_m) and a filling state of all layers:

- `positions`: each example's extreme and its first position, both directions, as the index did
  before (amax, then a chunked first-position pass) and as it does now while most
  candidates reach the state (amax, then one max / min with indices);
- `select`: one layer's selection of the batch's best k per key, its gathers and a buffer write,
  both directions (the index now runs these on one thread);
- `merge`: one merge of 2k buffered candidates into the whole model's state, by blocks of 2,048
  keys (before) and 32,768 keys (now), each on the default threads and on one.

Wall and CPU time (this process) per call, median of `--repeats`; run it beside the load you mean.

    python benchmarks/reduction_threads.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import common  # noqa: F401  (puts ../src on the path)

from ffkv.indexing import topk
from ffkv.indexing.reducer import one_thread
from ffkv.indexing.topk import TopKState, select_top

B, T, D_M, LAYERS, K = 32, 105, 1536, 30, 20  # SmolLM2-135M: 30 layers of 1,536 keys; 300 WikiText lines


def first_position_of(c: torch.Tensor, best: torch.Tensor, chunk: int = 2**20) -> torch.Tensor:
    """The index's first-position pass as it was (chunks of 2^20 elements, marks weighted by T - t)."""
    b, t, d_m = c.shape
    reverse = torch.arange(t, 0, -1, dtype=torch.uint8)[None, :, None]
    rows = max(1, chunk // (t * d_m))
    last = torch.cat([((c[i:i + rows] == best[i:i + rows, None, :]).view(torch.uint8) * reverse).amax(dim=1)
                      for i in range(0, b, rows)])
    return (t - last.long()).clamp_(max=t - 1)


def timed(fn, repeats: int) -> str:
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return f"{statistics.median(walls) * 1e3:8.1f} ms wall {statistics.median(cpus) * 1e3:8.1f} ms CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    c = torch.randn(B, T, D_M)
    values, ids = torch.randn(D_M, B), torch.randint(0, 10**4, (D_M, B))
    buffer = torch.empty(D_M, K, dtype=torch.int64)

    def positions_before():
        for extreme in (c.amax(dim=1), c.amin(dim=1)):
            first_position_of(c, extreme)

    def positions_now():
        c.amax(dim=1), c.max(dim=1).indices, c.amin(dim=1), c.min(dim=1).indices

    def select():
        for _ in range(2):
            top = select_top(values, K)
            values.gather(1, top), buffer.copy_(ids.gather(1, top))

    def select_one_thread():
        with one_thread(cpu, always=True):
            select()

    def merge(block: int, single: bool):
        def run():
            topk._CPU_BLOCK_ROWS = block
            state = TopKState.empty(LAYERS, 2 * D_M, K)
            state.values.copy_(torch.randn(LAYERS, 2 * D_M, K).sort(dim=-1, descending=True).values - 1)
            state.example_id.random_(0, 10**4)
            new = torch.randn(LAYERS, 2 * D_M, 2 * K)
            new_ids = torch.randint(10**4, 2 * 10**4, new.shape)
            zeros = torch.zeros(new.shape, dtype=torch.int32)
            c0, t0 = time.process_time(), time.perf_counter()
            if single:
                with one_thread(cpu, always=True):
                    state.merge_candidates(new, new_ids, zeros, zeros, one_per_example=True)
            else:
                state.merge_candidates(new, new_ids, zeros, zeros, one_per_example=True)
            return time.perf_counter() - t0, time.process_time() - c0
        return run

    print(f"threads={args.threads} load average {os.getloadavg()[0]:.2f}; "
          f"B={B} T={T} d_m={D_M}, {LAYERS} layers, k={K}")
    print(f"positions, before (amax + first-position pass) {timed(positions_before, args.repeats)}")
    print(f"positions, now (amax + max with indices)       {timed(positions_now, args.repeats)}")
    print(f"select + gathers + write, default threads      {timed(select, args.repeats)}")
    print(f"select + gathers + write, one thread           {timed(select_one_thread, args.repeats)}")
    for block in (2048, 32768):
        for single in (False, True):
            runs = [merge(block, single)() for _ in range(max(1, args.repeats // 2))]
            wall, cpu_s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            print(f"merge, blocks of {block:6,}, {'one thread' if single else 'default threads'}: "
                  f"{wall * 1e3:8.1f} ms wall {cpu_s * 1e3:8.1f} ms CPU")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
