"""Can a compiled forward pass keep ffkv's capture? Triggers of a compiled model against the eager run's.

Three ways, each indexed over the same corpus and compared with the eager index, table for table:
  whole   `torch.compile` of the model's blocks (the base module), hooks registered after compiling;
  attn    each block's attention compiled, the feed-forward layer (whose down projection the capture
          hooks) left eager;
  block   each block compiled (`nn.Module.compile`), the hooks inside the compiled region.

    python benchmarks/compile_capture.py [--device cuda] [--dtype bfloat16] [--shape gpt2-small|paper] [--layers 2] [--sentences 64] [--backend inductor]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from common import corpus_file, gpt2_shaped



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", default="gpt2-small")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--ways", default="whole,attn,block")
    args = parser.parse_args()

    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index

    spec = CorpusSpec(source=str(corpus_file(args.sentences)), unit="sentence", max_examples=args.sentences)
    options, batching = IndexOptions(top_k=10), BatchOptions(batch_size=16)

    def index(loaded, name: str) -> tuple[float, pd.DataFrame]:
        out = Path(tempfile.mkdtemp()) / name
        start = time.perf_counter()
        run = build_index(loaded, spec, out, options, batching, progress=False)
        return time.perf_counter() - start, pd.read_parquet(run.table("trigger_examples"))

    eager_s, eager = index(gpt2_shaped(args.device, args.dtype, args.shape, args.layers), "eager")
    eager_again_s, _ = index(gpt2_shaped(args.device, args.dtype, args.shape, args.layers), "eager2")
    print(f"eager: {len(eager):,} trigger rows, {eager_s:.2f} s (again {eager_again_s:.2f} s)", flush=True)
    for way in args.ways.split(","):
        loaded = gpt2_shaped(args.device, args.dtype, args.shape, args.layers)
        base = loaded.view.arch.base(loaded.model)
        if way == "whole":
            base.compile(backend=args.backend)
        elif way == "attn":
            for block in loaded.view.blocks:
                block.attn.compile(backend=args.backend)
        else:
            for block in loaded.view.blocks:
                block.compile(backend=args.backend)
        torch._dynamo.reset()
        first, table = index(loaded, way)  # compiles on its first batches
        again, table2 = index(loaded, way + "2")
        same = len(table) == len(eager) and table.equals(eager)
        ids_same = len(table) == len(eager) and (table[["layer", "key", "direction", "rank", "example_id", "position"]]
                                                .equals(eager[["layer", "key", "direction", "rank", "example_id", "position"]]))
        diff = (table["coefficient"] - eager["coefficient"]).abs().max() if len(table) == len(eager) else float("nan")
        print(f"{way}: {len(table):,} trigger rows; identical table {same}; same ids and order {ids_same}; "
              f"max |coefficient difference| {diff:.3g}; first run (compiling) {first:.2f} s, second {again:.2f} s",
              flush=True)


if __name__ == "__main__":
    main()
