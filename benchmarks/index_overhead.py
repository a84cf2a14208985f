"""`ffkv index` time over a plain forward pass of the same model on the same batches.

Both run in this process, alternating, on a GPT-2-small- or paper-shaped model and
real WikiText-103 sentences; the index time includes reading and tokenizing the
corpus, the reductions, the top-k merges and writing every table. Goal: ratio <= 1.10.

    python benchmarks/index_overhead.py [--device cuda] [--dtype bfloat16] [--shape paper|llama-8b]
        [--layers N] [--top-k 50] [--sentences 512] [--corpus-repeats 1] [--sign positive|both]

`--shape llama-8b` is Llama-3.1-8B's shape (32 layers, d=4,096, d_m=14,336, gated SiLU, 128,256-token
vocabulary) with random weights built on the device; `--layers 2` shrinks it to smoke-run on a CPU.
The (L, directions x d_m, k) state's memory is printed before anything runs, peak GPU memory
(torch.cuda.max_memory_allocated) after, and the time of a 95M-token job (the largest published
exact run: all of Llama-3.1-8B's neurons over about 95M tokens in about 64 hours on 2 A100s) at the
measured throughput.

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
    parser.add_argument("--layers", type=int, default=None, help="override the shape's depth (e.g. 2 on a CPU)")
    parser.add_argument("--top-k", type=int, default=50, help="trigger examples per key and direction")
    parser.add_argument("--unit", default="sentence", choices=("sentence", "line"),
                        help="an example is a sentence, or a whole WikiText paragraph line (cut by --max-tokens)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per example at most")
    parser.add_argument("--job-tokens", type=float, default=95e6, help="tokens of the job to project (default 95M)")
    parser.add_argument("--sentences", type=int, default=384)
    parser.add_argument("--corpus-repeats", type=int, default=1, help="the sentences this many times over")
    parser.add_argument("--tokenizer-workers", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--mode", default="example")
    parser.add_argument("--sign", choices=("positive", "both"), default="both",
                        help="trigger directions indexed (default both, as `ffkv index` for a GELU model)")
    parser.add_argument("--control-keys", type=int, default=None,
                        help="random control memories per layer indexed beside the keys (default: ffkv index's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeline", type=Path, default=None,
                        help="also profile a few batches, plain and indexed, into this folder (Chrome traces) "
                             "and print the operations that take the most time")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also run one more index under cProfile and print its N costliest functions (own time "
                             "and cumulative): where the host's time in the pass goes")
    parser.add_argument("--per-batch", action="store_true",
                        help="also time each batch's forward with and without the index's reduction, back to back")
    args = parser.parse_args()

    from ffkv.corpus import CorpusReader, CorpusSpec
    from ffkv.batching import collate, length_batches, windows
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index, index_batch, index_capture, run_forward
    from ffkv.indexing.reducer import TriggerReducer
    from ffkv.indexing.sinks import KeySink, model_keys, random_keys
    from ffkv.indexing.topk import TopKState
    from ffkv.memories.controls import DEFAULT_CONTROL_KEYS, RandomKeys

    n_layers = args.layers or SHAPES[args.shape][0]
    d_m = SHAPES[args.shape][3]
    directions = 2 if args.sign == "both" else 1
    state_bytes = n_layers * directions * d_m * args.top_k * (4 + 8 + 4 + 4)  # value, example id, position, next token
    print(f"top-k state: {n_layers} layers x {directions} x {d_m:,} keys x top-{args.top_k} x 20 bytes = "
          f"{state_bytes / 2**30:.2f} GiB (the full {SHAPES[args.shape][0]}-layer shape: "
          f"{state_bytes / n_layers * SHAPES[args.shape][0] / 2**30:.2f} GiB)", flush=True)
    loaded = gpt2_shaped(args.device, args.dtype, args.shape, args.layers)
    spec = CorpusSpec(source=str(corpus_file(args.sentences, args.corpus_repeats)), unit=args.unit,
                      max_examples=args.sentences * args.corpus_repeats, max_tokens=args.max_tokens)
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

    def new_reducer(select_per_layer: bool | None = None):
        """The index's reducer of this shape, empty: the keys' and, by default, the random control keys'
        (`select_per_layer`: as `TriggerReducer` takes it; None: the index's default on this device)."""
        view = loaded.view
        rows = view.d_m * (2 if args.sign == "both" else 1)
        signed = args.sign == "both"
        reducer = TriggerReducer(TopKState.empty(view.n_layers, rows, args.top_k, view.device), args.mode, signed=signed,
                                 select_per_layer=select_per_layer)
        n_control = DEFAULT_CONTROL_KEYS if args.control_keys is None else args.control_keys
        if n_control:  # the random control keys ride in the same pass, as in `ffkv index`
            control_rows = n_control * (2 if signed else 1)
            control = TriggerReducer(TopKState.empty(view.n_layers, control_rows, args.top_k, view.device),
                                     args.mode, signed=signed, select_per_layer=select_per_layer)
            reducer = KeySink(model_keys(reducer, view.n_layers) + random_keys(control, RandomKeys(view, n_control)))
        return reducer

    def passes(select_per_layer: bool | None = None):
        """One batch's plain forward, and its forward with the reduction and merge of a new reducer."""
        reducer = new_reducer(select_per_layer)

        def plain_pass(b):
            run_forward(loaded, b)

        def reduced_pass(b):
            with index_capture(loaded, reducer):
                index_batch(loaded, reducer, b)

        return plain_pass, reduced_pass, reducer

    def per_batch(select_per_layer: bool | None = None):
        """Each batch's plain forward and its forward with reduction and merge, timed back to back
        (alternating which goes first), with the state carried through the corpus as in a run."""
        plain_pass, reduced_pass, reducer = passes(select_per_layer)
        plain = reduce = 0.0
        for n, b in enumerate(batches):
            order = (plain_pass, reduced_pass) if n % 2 == 0 else (reduced_pass, plain_pass)
            seconds = {fn: timed(lambda: fn(b)) for fn in order}
            plain += seconds[plain_pass]
            reduce += seconds[reduced_pass]
        reduce += timed(reducer.flush)  # candidates the CPU still buffers
        return plain, reduce, (reducer.reducers[0] if isinstance(reducer, KeySink) else reducer).state

    def timeline(folder: Path, n: int = 8) -> None:
        """A profiler's timeline of n batches, plain and with the index's reduction and merge (a warm-up
        batch first): the operations that take the most device (or CPU) time, and a Chrome trace of each."""
        from torch.profiler import ProfilerActivity, profile

        folder.mkdir(parents=True, exist_ok=True)
        plain_pass, reduced_pass, reducer = passes()
        some = batches[:n + 1]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        for name, step in (("forward", plain_pass), ("index", reduced_pass)):
            step(some[0])
            with profile(activities=activities) as prof:
                for b in some[1:]:
                    step(b)
                if name == "index":
                    reducer.flush()
                if cuda:
                    torch.cuda.synchronize()
            prof.export_chrome_trace(str(folder / f"timeline-{name}.json"))
            print(f"timeline, {name}, {len(some) - 1} batches (trace: {folder / f'timeline-{name}.json'}):")
            print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48))

    streaming: list[float] = []  # each index run's pass over the corpus, before its tables are written

    def index():
        out = Path(tempfile.mkdtemp()) / "run"
        controls = {} if args.control_keys is None else {"control_keys": args.control_keys}
        run = build_index(loaded, spec, out, IndexOptions(top_k=args.top_k, mode=args.mode, sign=args.sign, **controls),
                          batching, progress=False)
        streaming.append(run.manifest().timings["index_seconds"])
        shutil.rmtree(out.parent)

    cuda = torch.device(args.device).type == "cuda"
    forward()  # warm-up
    hash_seconds = timed(loaded._hash_weights)  # a fixed cost per run, paid once per loaded model
    t_forward, t_index, peak = [], [], {"forward": 0, "index": 0}
    for _ in range(args.repeats):
        for name, fn, times in (("forward", forward, t_forward), ("index", index, t_index)):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times.append(timed(fn))
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
    f, i = min(t_forward), min(t_index)
    print(f"device={args.device} dtype={args.dtype} shape={args.shape} examples={len(examples)} tokens={n_tokens} "
          f"batches={len(batches)} mode={args.mode} sign={args.sign} tokenizer_workers={batching.workers(torch.device(args.device), spec)}")
    print(f"plain forward: {f:.2f} s ({n_tokens / f:,.0f} tok/s)   ffkv index: {i:.2f} s ({n_tokens / i:,.0f} tok/s)")
    print(f"ratio index/forward = {i / f:.3f}   (goal <= 1.10; the weights hash, {hash_seconds:.2f} s "
          "once per loaded model, is in the first repeat only)")
    if cuda:
        print(f"peak GPU memory (torch.cuda.max_memory_allocated): forward {peak['forward'] / 2**30:.2f} GiB, "
              f"index {peak['index'] / 2**30:.2f} GiB")
    # The index's time = its pass over the corpus (grows with the tokens) + a fixed part (the weights hash,
    # the corpus fingerprint, writing the trigger table of L x directions x d_m x k rows), which a long job
    # pays once: the projection scales only the pass.
    s = min(streaming)
    fixed = i - s
    print(f"ffkv index = pass over the corpus {s:.2f} s ({n_tokens / s:,.0f} tok/s; ratio to forward "
          f"{s / f:.3f}) + fixed {fixed:.2f} s (identity, tables)")
    hours = lambda seconds: seconds * args.job_tokens / n_tokens / 3600  # noqa: E731
    print(f"{args.job_tokens / 1e6:,.0f}M-token job at these rates: forward {hours(f):.2f} h, ffkv index "
          f"{hours(s) + (fixed + hash_seconds) / 3600:.2f} h (the pass scaled, the fixed part and the weights hash "
          "once; goal <= 2 h on one H100; reference: about 64 h on 2 A100s)")
    if n_layers != SHAPES[args.shape][0]:
        scale = SHAPES[args.shape][0] / n_layers
        print(f"  the full {SHAPES[args.shape][0]} layers, extrapolated linearly in depth (blocks only): "
              f"forward {hours(f) * scale:.2f} h, index pass {hours(s) * scale:.2f} h")
    if args.timeline is not None:
        timeline(args.timeline)
    if args.host_profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(index)
        print(f"host profile of one more index (its pass {streaming[-1]:.2f} s, under cProfile):")
        for order in ("tottime", "cumulative"):
            pstats.Stats(profiler).sort_stats(order).print_stats(args.host_profile)
    if args.per_batch:
        # The index's default on this device, and each way of selecting the candidates (per layer and direction
        # as each layer is reduced, or once in the merge), taking turns; their states must be equal.
        # On a GPU, selecting in the merge reduces each layer through `ffkv.indexing.extremes`' kernel where it runs;
        # "torch's reductions" is the same without it (the masked max and min of the torch path).
        from ffkv.indexing import extremes

        variants = {"default": None, "select per layer": True, "select in the merge": False,
                    "select in the merge, torch's reductions": False}
        ratios: dict[str, list[float]] = {name: [] for name in variants}
        states = {}
        kernel = extremes.available
        for _ in range(args.repeats):
            for name, select in variants.items():
                extremes.available = (lambda c: False) if "torch's" in name else kernel
                plain, reduce, state = per_batch(select)
                extremes.available = kernel
                ratios[name].append(reduce / plain)
                states[name] = state
                print(f"per batch, back to back ({name}): forward {plain:.2f} s, forward with reduction and merge "
                      f"{reduce:.2f} s: ratio {reduce / plain:.3f}   (the index's own work, without reading, "
                      "tokenizing or tables)", flush=True)
        for name, values in ratios.items():
            print(f"per batch ratio, {name}: " + ", ".join(f"{r:.3f}" for r in sorted(values)))
        first = next(iter(states.values()))
        same = all(torch.equal(a, b) for state in states.values()
                   for a, b in zip(first.state_dict().values(), state.state_dict().values()))
        print(f"the variants' states equal: {same}")
    if args.repeats > 1:  # a shared machine's speed drifts: each repeat's own ratio shows how much
        pairs = sorted(b / a for a, b in zip(t_forward, t_index))
        print("ratio per repeat (forward then index, back to back): " + ", ".join(f"{r:.3f}" for r in pairs)
              + f"; median {pairs[len(pairs) // 2]:.3f}")
        passes = sorted(b / a for a, b in zip(t_forward, streaming))
        print("pass over the corpus / forward, per repeat: " + ", ".join(f"{r:.3f}" for r in passes))


if __name__ == "__main__":
    main()
