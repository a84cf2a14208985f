"""The index's own work (reductions and merges) replayed on captured coefficients, without the forward pass.

`whole_process.py` measures what a user waits for, but on a machine whose speed drifts by 10-20%
between runs, a process pair cannot resolve the index's few seconds of overhead. This script takes
the forward pass out: it runs the model once over the same lines and batches as `whole_process.py`
(its saved GPT-2-small-shaped model and corpus), keeps every layer's coefficients, then feeds them
to `TriggerReducer` again and again, alternating the merge buffer sizes given, and prints the time
spent reducing (inside the forward pass in a real run) and merging, next to that forward pass. Every
buffer size must end with the same state (checked).

Memory: every batch's coefficients of every layer are kept (about 6 GiB for 1,500 lines).

    python benchmarks/reduction_replay.py [--lines 1500] [--buffers 0,100] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from whole_process import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1500)
    parser.add_argument("--buffers", default="0,100",
                        help="merge buffer sizes (candidates per key) to compare; 0 merges every batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ffkv-whole-process")
    args = parser.parse_args()
    from ffkv.batching import collate, length_batches, windows
    from ffkv.corpus import CorpusReader, CorpusSpec
    from ffkv.index.reducer import TriggerReducer
    from ffkv.index.topk import TopKState
    from ffkv.models.loading import load_model

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, corpus = prepare(args.work, args.lines)
    loaded = load_model(str(model_dir))
    view = loaded.view
    examples = list(CorpusReader(CorpusSpec(source=str(corpus), unit="line"), loaded.tokenizer))
    special = sorted(loaded.tokenizer.special_ids or ())
    batches = [collate(group, loaded.tokenizer.pad_id, special, 1)  # ffkv index's batching on a CPU
               for window in windows(iter(examples), 32 * 16) for group in length_batches(window, 32, 16384)]
    captured, start = [], time.perf_counter()
    for batch in batches:
        with view.capture(("coefficients",)) as cap:
            view.forward(batch.input_ids)
        captured.append([cap["coefficients"][layer] for layer in range(view.n_layers)])
    forward = time.perf_counter() - start
    print(f"{len(examples)} lines, {sum(b.n_tokens for b in batches):,} tokens, {len(batches)} batches; "
          f"forward pass with capture {forward:.1f} s; signed top-{args.top_k}", flush=True)
    reference = None
    for repeat in range(args.repeats):
        for columns in (int(c) for c in args.buffers.split(",")):
            state = TopKState.empty(view.n_layers, 2 * view.d_m, args.top_k)
            reducer = TriggerReducer(state, "example", signed=True, buffer_columns=columns)
            reduce = merge = 0.0
            for batch, layers in zip(batches, captured):
                t0 = time.perf_counter()
                reducer.start(batch)
                for layer, coefficients in enumerate(layers):
                    reducer("coefficients", layer, coefficients)  # in place, idempotent: blocked positions only
                t1 = time.perf_counter()
                reducer.commit()
                reduce, merge = reduce + t1 - t0, merge + time.perf_counter() - t1
            t1 = time.perf_counter()
            reducer.flush()
            merge += time.perf_counter() - t1
            result = state.state_dict()
            reference = reference or result
            same = all(torch.equal(reference[name], result[name]) for name in result)
            print(f"repeat {repeat + 1} buffer {columns:4d}: reduce {reduce:5.2f} s, merge {merge:5.2f} s, "
                  f"together {(reduce + merge) / forward:.1%} of the forward pass; same state: {same}", flush=True)
            if not same:
                raise SystemExit("buffer sizes gave different states")


if __name__ == "__main__":
    main()
