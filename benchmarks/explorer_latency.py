"""Explorer latency on a run the size of the paper's model: 16 layers x 4,096 keys x 50 trigger examples.

Writes a synthetic run directory straight to Parquet (3.3M trigger rows over 400k examples,
no model needed), the explorer's lookup tables beside it, then times the explorer's pages
through its ASGI app, in this process: the memory page (the issue's bound: well under a
second; with a tokenizer but no model, so it reads the tables only: the per-token coefficients
of a real model's memory page add one forward pass over its trigger examples), the layer page,
token search and full-text search.

    python benchmarks/explorer_latency.py [--layers 16] [--keys 4096] [--top-k 50] [--examples 400000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from ffkv.store import atomic, schemas  # noqa: E402
from ffkv.store.manifest import Identity, Manifest, ModelInfo  # noqa: E402
from ffkv.store.run import RunDir  # noqa: E402

VOCAB = 50257


class WordTokenizer:
    """Stands in for the model's tokenizer: token i is the word "w{i}"."""

    vocab_size = VOCAB
    pad_id = 0
    special_ids = frozenset()

    def token_strings(self, ids):
        return [f" w{int(i)}" for i in ids]

    def decode(self, ids):
        return "".join(self.token_strings(ids))

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]


class Stub:
    """A `LoadedModel` without a model: pages that need no forward pass work with it."""

    tokenizer = WordTokenizer()
    view = None
    model = None


def write_run(folder: Path, layers: int, keys: int, top_k: int, n_examples: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    run = folder / "run"
    run.mkdir(parents=True)
    t = time.perf_counter()
    lengths = rng.integers(8, 40, n_examples)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = rng.integers(0, VOCAB, int(offsets[-1])).astype(np.int32)
    token_lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    texts = pa.array([f"example {i} about topic {i % 997}" for i in range(n_examples)])
    atomic.write_parquet(run / "examples.parquet", pa.table(
        {"example_id": pa.array(np.arange(n_examples, dtype=np.int64)), "token_ids": token_lists, "text": texts},
        schema=schemas.EXAMPLES))
    n = layers * keys * top_k
    example_id = rng.integers(0, n_examples, n)
    position = (rng.random(n) * (lengths[example_id] - 1)).astype(np.int32)
    coefficient = -np.sort(-rng.gamma(2.0, 1.0, (layers * keys, top_k)).astype(np.float32), axis=1).ravel()
    atomic.write_parquet(run / "trigger_examples.parquet", pa.table({
        "layer": np.repeat(np.arange(layers, dtype=np.int16), keys * top_k),
        "key": np.tile(np.repeat(np.arange(keys, dtype=np.int32), top_k), layers),
        "direction": np.ones(n, dtype=np.int8),  # one direction, as a ReLU model's run
        "rank": np.tile(np.arange(top_k, dtype=np.int16), layers * keys),
        "coefficient": coefficient, "example_id": example_id.astype(np.int64), "position": position,
        "next_token_id": tokens[offsets[example_id] + position + 1],
    }, schema=schemas.TRIGGER_EXAMPLES))
    index = {"top_k": top_k, "mode": "example", "sign": "positive"}
    manifest = Manifest(
        identity=Identity(model_id="synthetic", weights_sha256=f"synthetic-{seed}", dtype="float32",
                          corpus={"source": "synthetic"}, corpus_fingerprint="synthetic", index=index),
        model=ModelInfo(id="synthetic", family="GPT-2", n_layers=layers, d_m=keys, d_model=1024, vocab_size=VOCAB,
                        dtype="float32", gated=False, parallel=False, encoder=False, resid_mid="sequential"),
        corpus={"source": "synthetic"}, index=index, status="complete", timings={"index_seconds": 0.0},
        counts={"examples": n_examples, "tokens": int(offsets[-1])})
    RunDir(run).write_manifest(manifest)
    print(f"synthetic run: {n:,} trigger rows, {n_examples:,} examples, written in {time.perf_counter() - t:.1f} s")
    return run


def write_lookups(run: Path, layers: int, keys: int, seed: int = 0) -> None:
    """The explorer's lookup tables, as its first start would write them (synthetic values)."""
    import pandas as pd

    from ffkv.experiments.lookups import HISTOGRAM_BINS, TOP_TOKENS, build_database
    from ffkv.store.lookups import write_info

    rng = np.random.default_rng(seed)
    folder = run / "explorer"
    folder.mkdir()
    t = time.perf_counter()
    build_database(RunDir(run), folder / "explorer.duckdb")
    print(f"explorer.duckdb built in {time.perf_counter() - t:.1f} s "
          f"({(folder / 'explorer.duckdb').stat().st_size / 2**20:.0f} MiB)")
    n = layers * keys
    probs = -np.sort(-rng.dirichlet(np.ones(TOP_TOKENS), n).astype(np.float32), axis=1)
    atomic.write_parquet(folder / "value_top_tokens.parquet", pa.table({
        "layer": np.repeat(np.arange(layers, dtype=np.int16), keys * TOP_TOKENS),
        "key": np.tile(np.repeat(np.arange(keys, dtype=np.int32), TOP_TOKENS), layers),
        "rank": np.tile(np.arange(TOP_TOKENS, dtype=np.int16), n),
        "token_id": rng.integers(0, VOCAB, n * TOP_TOKENS).astype(np.int32), "prob": probs.ravel() * 0.1,
    }, schema=schemas.VALUE_TOP_TOKENS))
    stats = pd.DataFrame({
        "layer": np.repeat(np.arange(layers, dtype=np.int16), keys), "key": np.tile(np.arange(keys, dtype=np.int32), layers),
        "confidence": rng.random(n).astype(np.float32), "top_token_id": rng.integers(0, VOCAB, n).astype(np.int32),
        "agreement": rng.random(n) < 0.02, "next_token_rank": rng.integers(0, VOCAB, n).astype(np.int32),
        "logsumexp": rng.random(n).astype(np.float32), "value_norm": rng.random(n).astype(np.float32),
        "activation_frequency": rng.random(n).astype(np.float32), "shallow_share": rng.random(n).astype(np.float32),
        "common_last_token_id": rng.integers(0, VOCAB, n).astype(np.int32),
        "activation_lo": -rng.random(n).astype(np.float32), "activation_hi": rng.random(n).astype(np.float32),
        "activation_histogram": list(rng.integers(0, 1000, (n, HISTOGRAM_BINS)).astype(np.int32))})
    atomic.write_parquet(folder / "key_stats.parquet",
                         pa.Table.from_pandas(stats, schema=schemas.KEY_STATS, preserve_index=False))
    write_info(RunDir(run), RunDir(run).manifest(), folder, activation_sample={"examples": 256, "positions": 8192})


def timed_get(client, url: str) -> float:
    t = time.perf_counter()
    r = client.get(url)
    elapsed = time.perf_counter() - t
    assert r.status_code == 200, (url, r.status_code, r.text[-300:])
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--examples", type=int, default=400_000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    from starlette.testclient import TestClient

    from ffkv.explorer import create_app

    with tempfile.TemporaryDirectory() as tmp:
        run = write_run(Path(tmp), args.layers, args.keys, args.top_k, args.examples)
        write_lookups(run, args.layers, args.keys)
        t = time.perf_counter()
        app = create_app(run, loaded=Stub())
        print(f"explorer started (cache valid) in {time.perf_counter() - t:.2f} s")
        rng = np.random.default_rng(1)
        with TestClient(app, base_url="http://127.0.0.1:8000") as client:
            first = timed_get(client, f"/memory/{args.layers}/{args.keys - 1}")  # layers count from 1 in URLs
            memory = [timed_get(client, f"/memory/{1 + rng.integers(args.layers)}/{rng.integers(args.keys)}")
                      for _ in range(args.requests)]
            layer = [timed_get(client, f"/layer/{1 + rng.integers(args.layers)}?sort=activation%20frequency&order=desc")
                     for _ in range(10)]
            token = [timed_get(client, f"/search?token=w{rng.integers(VOCAB)}") for _ in range(10)]
            text = [timed_get(client, f"/search?q=topic+{rng.integers(997)}") for _ in range(10)]
        ms = lambda xs: f"median {1e3 * statistics.median(xs):.1f} ms, p95 {1e3 * np.percentile(xs, 95):.1f} ms, max {1e3 * max(xs):.1f} ms"  # noqa: E731
        print(f"memory page (first request): {1e3 * first:.1f} ms")
        print(f"memory page ({args.requests} random keys): {ms(memory)}")
        print(f"layer page, sorted ({len(layer)}): {ms(layer)}")
        print(f"token search ({len(token)}): {ms(token)}")
        print(f"full-text search ({len(text)}): {ms(text)}")


if __name__ == "__main__":
    main()
