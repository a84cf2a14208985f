"""`ffkv analyze` steps over one plain forward pass of the same model on the same held-out examples.

Side by side in one process, on a GPT-2-small-shaped model (random weights, the real
GPT-2 tokenizer) and real WikiText-103 sentences:

- forward: the model's blocks over the held-out examples, same batches as the analysis;
- values: every value of every layer projected onto the vocabulary (L x d_m x |V|, chunked),
  with top tokens, entropies, trigger ranks and Table 2;
- composition + refinement: their one shared capture pass and every table and figure.

    python benchmarks/analysis_overhead.py [--device cuda] [--n-eval 256] [--sentences 512]
    python benchmarks/analysis_overhead.py --paper-memory   # values' peak memory at the paper's scale
    python benchmarks/analysis_overhead.py --paper-memory --values-shape llama-8b --values-keys 1046
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
from pathlib import Path

import torch

from common import corpus_file, gpt2_shaped, timed


#: name -> (d_m, d, |V|, layers) for the values step's memory: the paper's model and Llama-3.1-8B.
VALUE_SHAPES = {"paper": (4096, 1024, 267_744, 16), "llama-8b": (14_336, 4096, 128_256, 32)}


def paper_memory(chunk_bytes: int, shape: str = "paper", keys: int | None = None) -> None:
    """Peak working memory of one layer's value scan for the paper's shape (d_m 4,096, d 1,024, |V| 267,744)
    or Llama-3.1-8B's (d_m 14,336, d 4,096, |V| 128,256).

    Every layer is scanned the same way one after the other, so one layer's peak is the whole step's.
    `keys` scans only that many keys of the layer (the memory bound is per chunk; the time is then
    extrapolated to every key of every layer, once per direction).
    """
    import time

    import numpy as np

    from ffkv.memories import projection

    d_m, d, vocab, n_layers = VALUE_SHAPES[shape]
    scanned = keys or d_m

    class Head(torch.nn.Linear):
        pass

    class Arch:
        def unembed(self, model):
            return model.head

    class View:  # just what scan_values touches
        def __init__(self):
            self.model = torch.nn.Module()
            self.model.head = Head(d, vocab, bias=False)
            self.arch = Arch()
            self._values = torch.randn(scanned, d) / 32

        def values(self, layer):
            return self._values

        vocab_size = vocab

        @property
        def unembedding(self):
            return self.model.head.weight

    view = View()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)
    chunk = projection.chunk_size(vocab, chunk_bytes)
    start = time.perf_counter()
    projection.scan_values(view, 0, "identity", np.zeros(scanned, dtype=np.int64), chunk=chunk)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    weights = (vocab * d + scanned * d) * 4 / 2**30
    print(f"{shape} shape: d_m={d_m:,} d={d:,} |V|={vocab:,}; chunk = {chunk} keys ({chunk_bytes / 2**20:.0f} MiB of logits)")
    print(f"scanned {scanned:,} keys in {seconds:.1f} s (load average {os.getloadavg()[0]:.1f}): every key of the "
          f"{n_layers} layers, once per direction, would take {seconds * d_m / scanned * n_layers * 2 / 3600:.2f} h here")
    print(f"process peak RSS before the scan {before:.2f} GiB (E and V: {weights:.2f} GiB), after {after:.2f} GiB; "
          f"working memory of the scan {after - before:.2f} GiB (bound 4 x chunk = {4 * chunk_bytes / 2**30:.2f} GiB); "
          f"all L x d_m x |V| logits at once would be {n_layers * d_m * vocab * 4 / 2**30:.0f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sentences", type=int, default=512, help="corpus lines to index (trigger examples)")
    parser.add_argument("--n-eval", type=int, default=256, help="held-out examples")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--paper-memory", action="store_true", help="measure the values step's memory at the paper's scale")
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--values-shape", choices=tuple(VALUE_SHAPES), default="paper",
                        help="with --paper-memory: the paper's model or Llama-3.1-8B's shape")
    parser.add_argument("--values-keys", type=int, default=None,
                        help="with --paper-memory: scan only this many keys of the layer (time extrapolated)")
    args = parser.parse_args()
    if args.paper_memory:
        paper_memory(args.chunk_mib * 2**20, args.values_shape, args.values_keys)
        return

    from ffkv.corpus import CorpusSpec
    from ffkv.experiments import registry
    from ffkv.experiments.analyze import run_step
    from ffkv.experiments.common import Projections, RunContext, eval_spec, open_run
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index

    loaded = gpt2_shaped(args.device, args.dtype, layers=args.layers)
    folder = Path(tempfile.mkdtemp())
    spec = CorpusSpec(source=str(corpus_file(args.sentences)), unit="sentence", heldout_fraction=0.5)
    build_index(loaded, spec, folder / "run", IndexOptions(top_k=50), BatchOptions(batch_size=32), progress=False)
    run, manifest, loaded = open_run(folder / "run", loaded)

    def context() -> RunContext:
        return RunContext(run, manifest, loaded, projections=Projections(), progress=False,
                          eval_spec=eval_spec(manifest, n_eval=args.n_eval))

    ctx = context()
    held = ctx.held_out()
    rows = [(i, e.token_ids) for i, e in enumerate(held.examples)]
    prepared = [b for _, b in ctx.batches(rows)]
    n_tokens = sum(b.n_tokens for b in prepared)

    def forward():
        for b in prepared:
            loaded.view.forward(b.input_ids, b.attention_mask)

    def values_step():
        run_step(context(), registry.get("values"))

    from ffkv.experiments.values import value_tokens

    tops = {layer: value_tokens(ctx, layer) for layer in range(loaded.view.n_layers)}

    def heldout_step():
        c = context()
        c.once("held_out", lambda: held)  # reading the corpus is not part of the measured step
        for layer, top in tops.items():  # made by `values`, which runs first in `analyze`
            c.once(("value_tokens", layer), lambda top=top: top)
        run_step(c, registry.get("composition"))
        run_step(c, registry.get("refinement"))

    forward()  # warm-up
    t_f, t_v, t_h = [], [], []
    for _ in range(args.repeats):
        t_f.append(timed(forward))
        t_v.append(timed(values_step))
        t_h.append(timed(heldout_step))
    f, v, h = min(t_f), min(t_v), min(t_h)
    view = loaded.view
    print(f"device={args.device} dtype={args.dtype} layers={view.n_layers} d_m={view.d_m} |V|={view.vocab_size} "
          f"held-out examples={len(held.examples)} tokens={n_tokens}")
    print(f"plain forward: {f:.2f} s   values: {v:.2f} s   composition+refinement: {h:.2f} s "
          f"(value top tokens from the values step)")
    print(f"ratio values/forward = {v / f:.2f}   ratio composition+refinement/forward = {h / f:.2f}")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
