"""`ffkv index` time over a plain forward pass of the same model on the same batches.

Both run in this process, alternating, on a GPT-2-small- or paper-shaped model and
real WikiText-103 sentences; the index time includes reading and tokenizing the
corpus, the reductions, the top-k merges and writing every table. Goal: ratio <= 1.10.

    python benchmarks/index_overhead.py [--device cuda] [--dtype bfloat16] [--shape paper]
        [--sentences 512] [--corpus-repeats 1] [--sign positive|both]

`--sign` chooses the trigger directions (GPT-2's GELU makes `both` the index's default); the
cost of the negative direction is the ratio of the two runs' index/forward ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

from common import SHAPES, corpus_file, gpt2_shaped, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="gpt2-small")
    parser.add_argument("--sentences", type=int, default=384)
    parser.add_argument("--corpus-repeats", type=int, default=1, help="the sentences this many times over")
    parser.add_argument("--tokenizer-workers", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--mode", default="example")
    parser.add_argument("--sign", choices=("positive", "both"), default="both",
                        help="trigger directions indexed (default both, as `ffkv index` for a GELU model)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--per-batch", action="store_true",
                        help="also time each batch's forward with and without the index's reduction, back to back")
    args = parser.parse_args()

    from ffkv.corpus import CorpusReader, CorpusSpec
    from ffkv.batching import collate, length_batches, windows
    from ffkv.index.indexer import BatchOptions, IndexOptions, build_index, index_batch, run_forward
    from ffkv.index.reducer import TriggerReducer
    from ffkv.index.topk import TopKState

    loaded = gpt2_shaped(args.device, args.dtype, args.shape)
    spec = CorpusSpec(source=str(corpus_file(args.sentences, args.corpus_repeats)), unit="sentence",
                      max_examples=args.sentences * args.corpus_repeats)
    batching = BatchOptions(batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
                            tokenizer_workers=args.tokenizer_workers)
    # The same batches the indexer forms: same windows, same length grouping. Tokenized without
    # the tokenizer's thread pool, which a forked tokenizing process of the index could not reuse.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    examples = list(CorpusReader(spec, loaded.tokenizer))
    del os.environ["TOKENIZERS_PARALLELISM"]
    pad = batching.pad_to(torch.device(args.device))
    batches = [collate(g, loaded.tokenizer.pad_id, loaded.tokenizer.special_ids, pad).to(args.device)
               for w in windows(examples, batching.batch_size * batching.window_batches)
               for g in length_batches(w, batching.batch_size, batching.max_batch_tokens)]
    n_tokens = sum(b.n_tokens for b in batches)

    def forward():
        for b in batches:
            run_forward(loaded, b)

    def per_batch() -> tuple[float, float]:
        """Each batch's plain forward and its forward with reduction and merge, timed back to back
        (alternating which goes first), with the state carried through the corpus as in a run."""
        view = loaded.view
        rows = view.d_m * (2 if args.sign == "both" else 1)
        reducer = TriggerReducer(TopKState.empty(view.n_layers, rows, 50, view.device), args.mode,
                                 signed=args.sign == "both")

        def plain_pass(b):
            run_forward(loaded, b)

        def reduced_pass(b):
            with view.capture(("coefficients",), sink=reducer):
                index_batch(loaded, reducer, b)

        plain = reduce = 0.0
        for n, b in enumerate(batches):
            order = (plain_pass, reduced_pass) if n % 2 == 0 else (reduced_pass, plain_pass)
            seconds = {fn: timed(lambda: fn(b)) for fn in order}
            plain += seconds[plain_pass]
            reduce += seconds[reduced_pass]
        return plain, reduce

    def index():
        out = Path(tempfile.mkdtemp()) / "run"
        build_index(loaded, spec, out, IndexOptions(top_k=50, mode=args.mode, sign=args.sign), batching, progress=False)
        shutil.rmtree(out.parent)

    forward()  # warm-up
    hash_seconds = timed(loaded._hash_weights)  # a fixed cost per run, paid once per loaded model
    t_forward, t_index = [], []
    for _ in range(args.repeats):
        t_forward.append(timed(forward))
        t_index.append(timed(index))
    f, i = min(t_forward), min(t_index)
    print(f"device={args.device} dtype={args.dtype} shape={args.shape} examples={len(examples)} tokens={n_tokens} "
          f"batches={len(batches)} mode={args.mode} sign={args.sign} tokenizer_workers={batching.workers(torch.device(args.device), spec)}")
    print(f"plain forward: {f:.2f} s ({n_tokens / f:,.0f} tok/s)   ffkv index: {i:.2f} s ({n_tokens / i:,.0f} tok/s)")
    print(f"ratio index/forward = {i / f:.3f}   (goal <= 1.10; the weights hash, {hash_seconds:.2f} s "
          "once per loaded model, is in the first repeat only)")
    if args.per_batch:
        plain, reduce = per_batch()
        print(f"per batch, back to back: forward {plain:.2f} s, forward with reduction and merge {reduce:.2f} s: "
              f"ratio {reduce / plain:.3f}   (the index's own work, without reading, tokenizing or tables)")
    if args.repeats > 1:  # a shared machine's speed drifts: each repeat's own ratio shows how much
        pairs = sorted(b / a for a, b in zip(t_forward, t_index))
        print("ratio per repeat (forward then index, back to back): " + ", ".join(f"{r:.3f}" for r in pairs)
              + f"; median {pairs[len(pairs) // 2]:.3f}")


if __name__ == "__main__":
    main()
