"""The merge's one selection on a GPU: ways to keep each row's best k of (k + batch) packed int64 keys, side by side.

The index merges every layer's and direction's candidates in one selection per batch (`ffkv.indexing.topk`,
`TopKState.merge_candidates`): each row's k best of its k kept entries and the batch's examples, by a packed int64
key (value, then the lower example id). On an H200 that `topk` is the index's largest added cost (22% of GPT-2
small's indexed pass, 9% at Llama-3.1-8B's shape). This times, on the merge's shapes, with CUDA events, the same
keys through: `topk` sorted (the index's), `topk` unsorted then a sort of the k, and a full row sort; each must
give the same indices. A float32 `topk` of the values alone (not exact: it ignores the id) is the floor.

    python benchmarks/merge_selection.py [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

#: name -> (rows = layers x directions x keys, k, batch examples): the shapes `index_overhead.py` runs.
SHAPES = {"gpt2-small": (12 * 2 * 3072, 50, 512), "llama-8b": (32 * 2 * 14336, 100, 256)}


def packed_keys(rows: int, width: int, generator: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16-valued coefficients packed with distinct ids, as the merge packs them, and the values."""
    from ffkv.indexing.topk import _value_then_id_key

    values = torch.randn(rows, width, generator=generator).to(torch.bfloat16).float().to(device)
    ids = torch.randperm(rows * width, generator=generator).reshape(rows, width).to(device)
    return _value_then_id_key(values, ids), values


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of `fn` over `repeats` (after a warm-up), and its last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    for name, (rows, k, batch) in SHAPES.items():
        keys, values = packed_keys(rows, k + batch, g, "cuda")
        ways = {
            "topk, sorted (the index's)": lambda: keys.topk(k, dim=-1, sorted=True).indices,
            "topk unsorted, then sort the k": lambda: _sorted_after(keys, k),
            "sort the row": lambda: keys.sort(dim=-1, descending=True).indices[:, :k],
            "float32 topk of the values (floor, not exact)": lambda: values.topk(k, dim=-1, sorted=True).indices,
        }
        base = None
        for way, fn in ways.items():
            ms, out = timed(fn, args.repeats)
            same = "" if "floor" in way else f", same indices: {base is None or torch.equal(out, base)}"
            base = out if base is None else base
            print(f"{name}: {rows:,} rows x {k + batch} keys, k = {k}: {way}: {ms:.2f} ms{same}", flush=True)


def _sorted_after(keys: torch.Tensor, k: int) -> torch.Tensor:
    top = keys.topk(k, dim=-1, sorted=False)
    return top.indices.gather(-1, top.values.argsort(dim=-1, descending=True))


if __name__ == "__main__":
    main()
