"""The index's own work (reductions and merges) replayed on captured coefficients, without the forward pass.

`whole_process.py` measures what a user waits for, but on a machine whose speed drifts by 10-20%
between runs, a process pair cannot resolve the index's few seconds of overhead. This script takes
the forward pass out: it runs the model once over the same lines and batches as `whole_process.py`
(its saved GPT-2-small-shaped model and corpus), keeps every layer's coefficients, then feeds them
to `TriggerReducer` again and again, alternating the merge buffer sizes given, and prints the time
spent reducing (inside the forward pass in a real run) and merging, next to that forward pass. Every
buffer size must end with the same state (checked).

Memory: every batch's coefficients of every layer are kept (about 6 GiB for 1,500 lines).

    python benchmarks/reduction_replay.py [--corpus short|wikitext] [--lines N] [--buffers 0,100] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from whole_process import CORPORA, DEFAULT_LINES, prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", choices=CORPORA, default="short")
    parser.add_argument("--lines", type=int, default=None, help="lines of the corpus (whole_process.py's default)")
    parser.add_argument("--buffers", default="0,100",
                        help="merge buffer sizes (candidates per key) to compare; 0 merges every batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ffkv-whole-process")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; with 1, times are this thread's CPU time, which other jobs on a shared "
                             "machine disturb far less than wall time")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    from ffkv.batching import collate, length_batches, windows
    from ffkv.corpus import CorpusReader, CorpusSpec
    from ffkv.indexing.indexer import BatchOptions
    from ffkv.indexing.reducer import TriggerReducer
    from ffkv.indexing.topk import TopKState
    from ffkv.models.loading import load_model

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, corpus = prepare(args.work, args.corpus, args.lines or DEFAULT_LINES[args.corpus])
    loaded = load_model(str(model_dir))
    view = loaded.view
    examples = list(CorpusReader(CorpusSpec(source=str(corpus), unit="line"), loaded.tokenizer))
    special = sorted(loaded.tokenizer.special_ids or ())
    cut = BatchOptions()  # ffkv index's batching on a CPU
    batches = [collate(group, loaded.tokenizer.pad_id, special, 1)
               for window in windows(iter(examples), cut.batch_size * cut.window_batches)
               for group in length_batches(window, cut.batch_size, cut.max_batch_tokens)]
    captured, start = [], clock()
    for batch in batches:
        with view.capture(("coefficients",)) as cap:
            view.forward(batch.input_ids)
        captured.append([cap["coefficients"][layer] for layer in range(view.n_layers)])
    forward = clock() - start
    print(f"{len(examples)} lines, {sum(b.n_tokens for b in batches):,} tokens, {len(batches)} batches; "
          f"forward pass with capture {forward:.1f} s; signed top-{args.top_k}", flush=True)
    reference = None
    for repeat in range(args.repeats):
        for columns in (int(c) for c in args.buffers.split(",")):
            state = TopKState.empty(view.n_layers, 2 * view.d_m, args.top_k)
            reducer = TriggerReducer(state, "example", signed=True, buffer_columns=columns)
            reduce = merge = 0.0
            for batch, layers in zip(batches, captured):
                t0 = clock()
                reducer.start(batch)
                for layer, coefficients in enumerate(layers):
                    reducer("coefficients", layer, coefficients)  # in place, idempotent: blocked positions only
                t1 = clock()
                reducer.commit()
                reduce, merge = reduce + t1 - t0, merge + clock() - t1
            t1 = clock()
            reducer.flush()
            merge += clock() - t1
            result = state.state_dict()
            reference = reference or result
            same = all(torch.equal(reference[name], result[name]) for name in result)
            print(f"repeat {repeat + 1} buffer {columns:4d}: reduce {reduce:5.2f} s, merge {merge:5.2f} s, "
                  f"together {(reduce + merge) / forward:.1%} of the forward pass; same state: {same}", flush=True)
            if not same:
                raise SystemExit("buffer sizes gave different states")


if __name__ == "__main__":
    main()
