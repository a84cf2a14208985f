"""Explorer latency on a synthetic run of a real model's shape: every page type, first and warm.

Writes a synthetic run directory straight to Parquet (no model needed): the trigger table of
every key, both directions where the shape has them, the examples they use, the per-key metrics
tables of `ffkv analyze` that the layer page shows (patterns, census), then the explorer's lookup
tables beside it, and times:

- the lookups' database build (`ffkv.experiments.lookups.build_database`, the part that grows with the
  trigger table; the per-key tables are written synthetic, and so is the per-token coefficient file of the rows
  the database locates, `ffkv.experiments.trigger_contexts`: random values, as many as a model's build writes):
  time, disk size, peak memory of its process;
- in another process, the explorer's start and each page type through its ASGI app: the overview,
  the layer page sorted by each of its columns, the memory page, token and full-text search, the
  concepts of a layer, and the trace page, all with a tokenizer but no model weights (a memory page
  reads its stored coefficients, as with a model; a trace needs the weights and says so); "first" is
  each page type's first request after the start, "warm" the median of the following ones (other
  layers, keys, sorts); the process's peak memory;
- `ffkv report RUN` in its own process: time, report size, peak memory.

Shapes: ``paper`` (16 x 4,096 keys, top-50, one direction, GPT-2's vocabulary size, 400k examples)
and ``llama-8b`` (Llama-3.1-8B: 32 x 14,336 keys, top-100, both directions: 91.75M trigger rows,
its tokenizer's 128,256-token vocabulary, 1.2M examples). The 8B run takes several GB: give
``--work`` on a disk with room (``--keep`` leaves it there for another run of this script).

    python benchmarks/explorer_latency.py [--shape paper|llama-8b] [--work DIR] [--keep] [--requests 50]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from ffkv.store import atomic, schemas  # noqa: E402
from ffkv.store.manifest import Identity, Manifest, ModelInfo  # noqa: E402
from ffkv.store.run import RunDir  # noqa: E402

#: name -> (layers, keys, top-k, directions, vocabulary, examples, longest example in tokens).
SHAPES = {
    "paper": (16, 4096, 50, (1,), 50_257, 400_000, 40),
    "llama-8b": (32, 14_336, 100, (1, -1), 128_256, 1_200_000, 96),
    "tiny": (2, 512, 10, (1, -1), 128_256, 20_000, 40),  # a smoke test of this script
}


class WordTokenizer:
    """Stands in for the model's tokenizer: token i is the word "w{i}"."""

    pad_id = 0
    special_ids = frozenset()

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def token_strings(self, ids):
        return [f" w{int(i)}" for i in ids]

    def decode(self, ids):
        return "".join(self.token_strings(ids))

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]


class Stub:
    """A `LoadedModel` with a tokenizer and no weights: the model is absent; pages that need no forward
    pass answer from the run's tables."""

    view = None
    model = None

    def __init__(self, vocab_size: int) -> None:
        self.tokenizer = WordTokenizer(vocab_size)


def peak_rss_gib() -> float:
    """This process's peak resident memory (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def disk_gib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**30


def write_run(run: Path, shape: str, seed: int = 0) -> None:
    """The synthetic run: examples, trigger table (written layer by layer: memory stays at one layer's
    rows), patterns and census metrics, manifest."""
    layers, keys, top_k, directions, vocab, n_examples, longest = SHAPES[shape]
    rng = np.random.default_rng(seed)
    run.mkdir(parents=True)
    t = time.perf_counter()
    lengths = rng.integers(8, longest, n_examples)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with pq.ParquetWriter(run / "examples.parquet", schemas.EXAMPLES, compression="zstd") as writer:
        for start in range(0, n_examples, 65_536):
            stop = min(n_examples, start + 65_536)
            tokens = rng.integers(0, vocab, int(offsets[stop] - offsets[start])).astype(np.int32)
            lists = pa.ListArray.from_arrays(pa.array((offsets[start:stop + 1] - offsets[start]).astype(np.int32)),
                                             pa.array(tokens))
            writer.write_table(pa.table({
                "example_id": pa.array(np.arange(start, stop, dtype=np.int64)), "token_ids": lists,
                "text": pa.array([f"example {i} about topic {i % 997}" for i in range(start, stop)])},
                schema=schemas.EXAMPLES), row_group_size=65_536)
    n_dir = len(directions)
    per_layer = keys * n_dir * top_k
    with pq.ParquetWriter(run / "trigger_examples.parquet", schemas.TRIGGER_EXAMPLES, compression="zstd") as writer:
        for layer in range(layers):
            example_id = rng.integers(0, n_examples, per_layer)
            position = (rng.random(per_layer) * (lengths[example_id] - 1)).astype(np.int32)
            m = -np.sort(-rng.gamma(2.0, 1.0, (keys * n_dir, top_k)).astype(np.float32), axis=1)
            sign = np.tile(np.repeat(np.array(directions, dtype=np.float32), top_k), keys)
            # next token: a synthetic id (the token after the prefix, as the index records it)
            writer.write_table(pa.table({
                "layer": np.full(per_layer, layer, dtype=np.int16),
                "key": np.repeat(np.arange(keys, dtype=np.int32), n_dir * top_k),
                "direction": np.tile(np.repeat(np.array(directions, dtype=np.int8), top_k), keys),
                "rank": np.tile(np.arange(top_k, dtype=np.int16), keys * n_dir),
                "coefficient": m.ravel() * sign, "example_id": example_id.astype(np.int64), "position": position,
                "next_token_id": rng.integers(0, vocab, per_layer).astype(np.int32),
            }, schema=schemas.TRIGGER_EXAMPLES), row_group_size=1_048_576)
    n = layers * keys
    layer_col, key_col = np.repeat(np.arange(layers), keys), np.tile(np.arange(keys), layers)
    labels = np.array(["shallow", "semantic", "both", "none"])[rng.integers(0, 4, n)]
    import pandas as pd

    sign = "both" if n_dir == 2 else "positive"
    index = {"top_k": top_k, "mode": "example", "sign": sign}
    manifest = Manifest(
        identity=Identity(model_id="synthetic", weights_sha256=f"synthetic-{seed}", dtype="float32",
                          corpus={"source": "synthetic"}, corpus_fingerprint="synthetic", index=index),
        model=ModelInfo(id="synthetic", family="Llama" if shape == "llama-8b" else "GPT-2", n_layers=layers,
                        d_m=keys, d_model=4096 if shape == "llama-8b" else 1024, vocab_size=vocab, dtype="float32",
                        gated=shape == "llama-8b", parallel=False, encoder=False, resid_mid="sequential"),
        corpus={"source": "synthetic"}, index=index, status="complete", timings={"index_seconds": 0.0},
        counts={"examples": n_examples, "tokens": int(offsets[-1])})
    rdir = RunDir(run)
    for table in ("examples", "trigger_examples"):  # recorded as the index records them (ffkv.store.integrity)
        rdir.record_table(manifest, rdir.table(table).name, "index")
    rdir.write_manifest(manifest)  # before the metrics: each metrics table is recorded in it as written
    rdir.write_metric("patterns_keys", pd.DataFrame({
        "layer": layer_col, "key": key_col, "label": labels,
        "description": [f"ends in w{t}" for t in rng.integers(0, vocab, n)],
        "shallow_score": rng.random(n), "semantic_score": rng.random(n), "n_triggers": np.full(n, top_k)}),
        {"synthetic": True})
    classes = np.array(["dead", "detector", "positional", "other"])[rng.integers(0, 4, n)]
    rdir.write_metric("census", pd.DataFrame({
        "layer": layer_col, "key": key_col, "class": classes,
        "value_type": np.array(["prediction", "suppression", "other"])[rng.integers(0, 3, n)],
        "eraser": rng.random(n) < 0.05, "rule": [f"last token w{t}" for t in rng.integers(0, vocab, n)],
        "rule_f1": rng.random(n), "position_eta2": rng.random(n), "firing_sign": rng.choice([-1, 1], n),
        "two_way": rng.random(n) < 0.1}), {"synthetic": True})
    explained = rng.random(n) < 0.1  # `ffkv explain` and `ffkv score` on a tenth of the memories
    m = int(explained.sum())
    memory = {"kind": "memory", "layer": layer_col[explained], "key": key_col[explained], "direction": 1,
              "explainer": "openai:http://127.0.0.1:1/v1#synthetic"}
    rdir.write_metric("explanations", pd.DataFrame({
        **memory, "explanation": [f"fires on w{t} and topic {t % 50}" for t in rng.integers(0, vocab, m)]}),
        {"synthetic": True})
    rdir.write_metric("explanation_scores", pd.concat([pd.DataFrame({
        **memory, "baseline": baseline, "score": rng.uniform(-0.2, 1.0, m), "simulator": memory["explainer"]})
        for baseline in ("own", "shuffled")], ignore_index=True), {"synthetic": True})
    print(json.dumps({"step": "write", "trigger_rows": layers * per_layer, "examples": n_examples,
                      "seconds": round(time.perf_counter() - t, 1), "trigger_table_gib": round(
                          disk_gib(run / "trigger_examples.parquet"), 3),
                      "examples_table_gib": round(disk_gib(run / "examples.parquet"), 3)}))


def write_lookups(run: Path, shape: str, seed: int = 0) -> None:
    """The explorer's lookup tables, as `ffkv analyze` writes them: the database from the run's tables (timed),
    the per-key tables synthetic (they need the model's weights)."""
    import pandas as pd

    from ffkv.experiments import trigger_contexts
    from ffkv.experiments.lookups import HISTOGRAM_BINS, TOP_TOKENS, build_database
    from ffkv.store.lookups import write_info

    layers, keys, _, _, vocab, _, _ = SHAPES[shape]
    rng = np.random.default_rng(seed)
    folder = run / "explorer"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    t = time.perf_counter()
    located = build_database(RunDir(run), folder / "explorer.duckdb")["triggers"]
    seconds = time.perf_counter() - t
    rows = trigger_contexts.plan(folder / "explorer.duckdb")
    coefficients = {"file": None, "reason": "no rows located"}
    if rows is not None:  # what a model's build writes there, with random values
        cells = int(rows["m_length"].sum())
        values = rng.gamma(2.0, 1.0, cells).astype(np.float32)
        dtype = trigger_contexts.write(folder / trigger_contexts.FILE, values)
        coefficients = {"file": trigger_contexts.FILE, "cells": cells, "dtype": dtype, **located,
                        "max_cells": trigger_contexts.MAX_CELLS, "synthetic": True}
    n = layers * keys
    probs = -np.sort(-rng.dirichlet(np.ones(TOP_TOKENS), n).astype(np.float32), axis=1)
    atomic.write_parquet(folder / "value_top_tokens.parquet", pa.table({
        "layer": np.repeat(np.arange(layers, dtype=np.int16), keys * TOP_TOKENS),
        "key": np.tile(np.repeat(np.arange(keys, dtype=np.int32), TOP_TOKENS), layers),
        "rank": np.tile(np.arange(TOP_TOKENS, dtype=np.int16), n),
        "token_id": rng.integers(0, vocab, n * TOP_TOKENS).astype(np.int32), "prob": probs.ravel() * 0.1,
    }, schema=schemas.VALUE_TOP_TOKENS))
    stats = pd.DataFrame({
        "layer": np.repeat(np.arange(layers, dtype=np.int16), keys), "key": np.tile(np.arange(keys, dtype=np.int32), layers),
        "confidence": rng.random(n).astype(np.float32), "top_token_id": rng.integers(0, vocab, n).astype(np.int32),
        "agreement": rng.random(n) < 0.02, "next_token_rank": rng.integers(0, vocab, n).astype(np.int32),
        "logsumexp": rng.random(n).astype(np.float32), "value_norm": rng.random(n).astype(np.float32),
        "activation_frequency": rng.random(n).astype(np.float32), "shallow_share": rng.random(n).astype(np.float32),
        "common_last_token_id": rng.integers(0, vocab, n).astype(np.int32),
        "activation_lo": -rng.random(n).astype(np.float32), "activation_hi": rng.random(n).astype(np.float32),
        "activation_histogram": list(rng.integers(0, 1000, (n, HISTOGRAM_BINS)).astype(np.int32))})
    atomic.write_parquet(folder / "key_stats.parquet",
                         pa.Table.from_pandas(stats, schema=schemas.KEY_STATS, preserve_index=False))
    write_info(RunDir(run), RunDir(run).manifest(), folder, projection="identity", top_tokens=TOP_TOKENS,
               activation_sample={"examples": 256, "positions": 8192}, trigger_coefficients=coefficients)
    print(json.dumps({"step": "lookups", "database_seconds": round(seconds, 1), "located": located,
                      "coefficient_cells": coefficients.get("cells"),
                      "database_gib": round(disk_gib(folder / "explorer.duckdb"), 3),
                      "lookups_gib": round(disk_gib(folder), 3), "peak_rss_gib": round(peak_rss_gib(), 2)}))


def timed_get(client, url: str, status: int = 200) -> tuple[float, int]:
    """Seconds to answer `url`, and the answer's bytes."""
    t = time.perf_counter()
    r = client.get(url)
    elapsed = time.perf_counter() - t
    assert r.status_code == status, (url, r.status_code, r.text[-300:])
    return elapsed, len(r.content)


def serve_pages(run: Path, shape: str, requests: int) -> None:
    """Start the explorer and time every page type, first and warm (one JSON line)."""
    from starlette.testclient import TestClient

    from ffkv.explorer import create_app, pages

    layers, keys, _, _, vocab, _, _ = SHAPES[shape]
    t = time.perf_counter()
    app = create_app(run, loaded=Stub(vocab))
    started = time.perf_counter() - t
    rng = np.random.default_rng(1)
    layer = lambda: 1 + int(rng.integers(layers))  # noqa: E731 - pages count layers from 1
    times: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {}

    def page(kind: str, urls, status: int = 200) -> None:
        for url in urls:
            seconds, size = timed_get(client, url, status)
            times.setdefault(kind, []).append(seconds)
            sizes.setdefault(kind, []).append(size)

    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        page("overview", ["/"] * (1 + requests // 10))
        sorts = [s for c, _, s in pages.LAYER_COLUMNS if s]
        page("layer", [f"/layer/{layer()}"])
        for s in sorts:
            page(f"layer sorted by {s}", [f"/layer/{layer()}?sort={s.replace(' ', '+')}&order={o}"
                                          for o in ("desc", "asc", "desc")])
        page("memory", [f"/memory/{layer()}/{rng.integers(keys)}" for _ in range(1 + requests)])
        page("token search", [f"/search?token=w{rng.integers(vocab)}" for _ in range(1 + requests // 5)])
        page("text search", [f"/search?q=topic+{rng.integers(997)}" for _ in range(1 + requests // 5)])
        page("concepts", [f"/concepts?layer={layer()}" for _ in range(4)])
        page("trace form", ["/trace"] * 4)
        page("trace, model absent", [f"/trace?prompt=w{rng.integers(vocab)}+w{rng.integers(vocab)}"] * 4, 503)
    out = {kind: {"first_ms": round(1e3 * xs[0], 1),
                  "warm_median_ms": round(1e3 * statistics.median(xs[1:]), 1) if len(xs) > 1 else None,
                  "warm_max_ms": round(1e3 * max(xs[1:]), 1) if len(xs) > 1 else None, "n": len(xs),
                  "median_kb": round(statistics.median(sizes[kind]) / 1e3, 1)}
           for kind, xs in times.items()}
    print(json.dumps({"step": "serve", "start_seconds": round(started, 2), "pages": out,
                      "peak_rss_gib": round(peak_rss_gib(), 2)}))


def child(step: str, run: Path, shape: str, requests: int = 0) -> dict:
    """Run one step in its own process (its own peak memory); returns its JSON line."""
    cmd = [sys.executable, __file__, "--step", step, "--run", str(run), "--shape", shape, "--requests", str(requests)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(run: Path) -> dict:
    """`ffkv report RUN` as a user runs it: wall time, the report's size, the process's peak memory
    (GNU time's maximum resident set size)."""
    ffkv = Path(sys.executable).with_name("ffkv")
    t = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%M", str(ffkv), "report", str(run)], capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"ffkv report failed:\n{done.stderr[-3000:]}")
    peak_kib = int(done.stderr.strip().splitlines()[-1])
    size = (run / "report.html").stat().st_size
    return {"step": "report", "seconds": round(seconds, 2), "report_kib": round(size / 1024, 1),
            "peak_rss_gib": round(peak_kib / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="paper")
    parser.add_argument("--work", type=Path, default=None, help="where the synthetic run is written (default: a "
                        "temporary folder, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the run in --work (and reuse one found there)")
    parser.add_argument("--requests", type=int, default=50, help="memory pages timed (other pages: fewer)")
    parser.add_argument("--step", choices=("write", "lookups", "serve"), help=argparse.SUPPRESS)
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "write":
        return write_run(args.run, args.shape)
    if args.step == "lookups":
        return write_lookups(args.run, args.shape)
    if args.step == "serve":
        return serve_pages(args.run, args.shape, args.requests)
    import os

    work = args.work or Path(tempfile.mkdtemp(prefix="ffkv-explorer-latency-"))
    run = work / f"run-{args.shape}"
    print(f"shape {args.shape}: {SHAPES[args.shape][:5]} (layers, keys, top-k, directions, vocabulary); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        if not (args.keep and (run / "manifest.json").exists()):
            shutil.rmtree(run, ignore_errors=True)
            print(json.dumps(child("write", run, args.shape)), flush=True)
        print(json.dumps(child("lookups", run, args.shape)) + f"  (load average {os.getloadavg()[0]:.2f})",
              flush=True)
        print(json.dumps(child("serve", run, args.shape, args.requests)) + f"  (load average "
              f"{os.getloadavg()[0]:.2f})", flush=True)
        print(json.dumps(report(run)) + f"  (load average {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
