"""`ffkv index` with a sparse dictionary's latents (and their control latents) against the neuron-only index.

Both run through `build_index` in this process on one loaded model, taking turns (the order alternates between
repeats), on the same corpus, batching and options, so the batches are the same; the dictionary run adds
latent_trigger_examples and, with control keys, the control latents' tables. Printed per repeat: each run's wall
time and its pass over the corpus (the manifest's index_seconds, before the tables are written), their ratio,
the median and the spread, and the load average before each run. Peak memory: each variant once more in a
process of its own (`--rss`, the default on a CPU): the process's peak resident set (ru_maxrss) and its
resident set once the model and the dictionary are loaded; on a GPU, torch.cuda.max_memory_allocated of each
run in this process. Goal at Llama-3.1-8B's shape on a GPU: latents within 1.5x the neuron-only pass.

    # a real model and dictionary (SmolLM2-135M and its 8x TopK transcoders on three layers)
    python benchmarks/latents_index.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --dictionary smollm2-135m-8x-k32 --corpus wiki.valid.raw --unit line --max-examples 300
    # a random model of a shape and random TopK transcoders (d_model x --expansion latents, k = --k)
    python benchmarks/latents_index.py --shape llama-8b --device cuda --dtype bfloat16 \
        --dictionary-layers 0,15,31 --expansion 8 --k 64 --max-examples 2048

With `--shape`, the corpus defaults to WikiText-103 lines (`common.corpus_file`); `--layers` cuts the shape.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from common import SHAPES, corpus_file, gpt2_shaped, timed

VARIANTS = ("neurons", "latents")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model ffkv loads (a GGUF file, a folder, a hub id)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None, help="a random model of this shape instead")
    parser.add_argument("--layers", type=int, default=None, help="cut --shape to this many layers")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dictionary", default=None, help="a dictionary `ffkv index --dictionary` reads")
    parser.add_argument("--dictionary-layers", default="0", help="without --dictionary: random TopK transcoders "
                        "on these 0-based layers (comma-separated)")
    parser.add_argument("--expansion", type=int, default=8, help="random transcoders' latents per d_model")
    parser.add_argument("--k", type=int, default=32, help="random transcoders' active latents per position")
    parser.add_argument("--corpus", default=None, help="a text file (default: WikiText-103 lines, common.py)")
    parser.add_argument("--unit", default="line")
    parser.add_argument("--max-examples", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--sign", choices=("positive", "both"), default="both")
    parser.add_argument("--mode", choices=("example", "prefix"), default="example")
    parser.add_argument("--control-keys", type=int, default=256, help="control keys and control latents per layer")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure each variant's peak RSS in a process of its own (default: on a CPU)")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if (args.model is None) == (args.shape is None):
        parser.error("give one of --model and --shape")
    return args


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    """CPU time (user and system, every thread) of this process so far: on a shared machine it drifts far less
    than wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load(args: argparse.Namespace):
    """The model, its dictionaries (FF layer -> Dictionary) and the corpus spec."""
    from ffkv.corpus import CorpusSpec
    from ffkv.dictionaries import Dictionary, open_dictionary
    from ffkv.models.loading import DTYPES, load_model

    if args.model is not None:
        loaded = load_model(args.model, args.dtype, args.device)
    else:
        loaded = gpt2_shaped(args.device, args.dtype, args.shape, args.layers)
    if args.dictionary is not None:
        dictionaries = open_dictionary(args.dictionary)
    else:
        view, dtype = loaded.view, DTYPES[args.dtype]
        g = torch.Generator(device=args.device).manual_seed(0)
        n, d = args.expansion * view.d_model, view.d_model

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=args.device) * scale).to(dtype)

        dictionaries = {layer: Dictionary(kind="transcoder", layer=layer, encoder=randn(n, d, scale=d ** -0.5),
                                          encoder_bias=randn(n, scale=0.1), decoder=randn(n, d, scale=d ** -0.5),
                                          decoder_bias=randn(d, scale=0.0), activation="topk", k=args.k)
                        for layer in map(int, args.dictionary_layers.split(","))}
    source = args.corpus or str(corpus_file(args.max_examples))
    spec = CorpusSpec(source=source, unit=args.unit, max_examples=args.max_examples, max_tokens=args.max_tokens)
    return loaded, dictionaries, spec


def index_once(args, loaded, dictionaries, spec, variant: str) -> dict:
    """One `build_index` of a variant: wall seconds, the pass over the corpus, tokens, peak GPU memory."""
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index

    out = Path(tempfile.mkdtemp(dir=os.environ.get("FFKV_BENCH_TMP"))) / "run"
    options = IndexOptions(top_k=args.top_k, mode=args.mode, sign=args.sign, control_keys=args.control_keys)
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    load_before = os.getloadavg()[0]
    cpu_before = cpu_seconds()
    seconds = timed(lambda: build_index(loaded, spec, out, options, BatchOptions(batch_size=args.batch_size),
                                        progress=False,
                                        dictionary=dictionaries if variant == "latents" else None))
    cpu = cpu_seconds() - cpu_before
    manifest = json.loads((out / "manifest.json").read_text())
    shutil.rmtree(out.parent)
    return {"variant": variant, "seconds": seconds, "cpu": cpu, "pass": manifest["timings"]["index_seconds"],
            "tokens": manifest["counts"]["tokens"], "load": load_before,
            "gpu_peak": torch.cuda.max_memory_allocated() if cuda else None}


def child(args: argparse.Namespace) -> None:
    """One variant in this process: its peak RSS and its RSS once everything is loaded, as one JSON line."""
    loaded, dictionaries, spec = load(args)
    if args.child == "latents":  # the dictionary's weights on the model's device, as the index holds them
        dictionaries = {layer: d.to(args.device) for layer, d in dictionaries.items()}
    loaded_rss = rss_bytes()
    result = index_once(args, loaded, dictionaries, spec, args.child)
    result.update(loaded_rss=loaded_rss, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    args = parse()
    torch.set_grad_enabled(False)
    if args.child is not None:
        child(args)
        return
    cuda = torch.device(args.device).type == "cuda"
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}", flush=True)
    loaded, dictionaries, spec = load(args)
    view = loaded.view
    n_latents = {layer: d.n_latents for layer, d in dictionaries.items()}
    ks = sorted({d.k for d in dictionaries.values()}, key=str)
    print(f"model {loaded.model_id}: {view.n_layers} layers x {view.d_m:,} keys, d_model {view.d_model}; "
          f"dictionary layers {sorted(n_latents)} with {sorted(set(n_latents.values()))} latents, "
          f"activation {sorted({d.activation for d in dictionaries.values()})}, k {ks}; device {args.device} "
          f"{args.dtype}; top-k {args.top_k}, sign {args.sign}, mode {args.mode}, control {args.control_keys}",
          flush=True)
    # Warm-up: the weights hash (paid once per loaded model) and a few examples through both variants.
    loaded.weights_hash()
    for variant in VARIANTS:
        index_once(args, loaded, dictionaries, replace(spec, max_examples=min(spec.max_examples, 8)), variant)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            result = index_once(args, loaded, dictionaries, spec, variant)
            runs[variant].append(result)
            gpu = f", peak GPU {result['gpu_peak'] / 2**30:.2f} GiB" if cuda else ""
            print(f"repeat {r}: {variant:8s} {result['seconds']:7.2f} s (pass {result['pass']:.2f} s, "
                  f"{result['tokens'] / result['pass']:,.0f} tok/s; CPU {result['cpu']:.2f} s), "
                  f"load {result['load']:.2f}{gpu}", flush=True)
    for name, field in (("whole build_index", "seconds"), ("pass over the corpus", "pass"),
                        ("CPU time of build_index", "cpu")):
        ratios = [b[field] / a[field] for a, b in zip(runs["neurons"], runs["latents"])]
        print(f"latents / neurons, {name}: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})")
    for variant in VARIANTS:
        mine = runs[variant]
        print(f"{variant}: best pass {min(r['pass'] for r in mine):.2f} s, median wall "
              f"{statistics.median(r['seconds'] for r in mine):.2f} s, median CPU "
              f"{statistics.median(r['cpu'] for r in mine):.2f} s")
    if args.rss if args.rss is not None else not cuda:
        del loaded, dictionaries
        for variant in VARIANTS:
            argv = [sys.executable, __file__, *sys.argv[1:], "--child", variant]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
            result = json.loads(line[len("RESULT "):])
            print(f"own process, {variant}: peak RSS {result['peak_rss'] / 2**20:,.0f} MiB, after loading "
                  f"{result['loaded_rss'] / 2**20:,.0f} MiB (the index's own: "
                  f"{(result['peak_rss'] - result['loaded_rss']) / 2**20:,.0f} MiB); {result['seconds']:.2f} s, "
                  f"CPU {result['cpu']:.2f} s, "
                  f"load {result['load']:.2f}", flush=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
