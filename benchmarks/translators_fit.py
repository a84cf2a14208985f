"""Fitting the per-layer translators (`ffkv analyze --only translators`) at the paper's shape, random weights.

The fit's cost per training position is independent of the model's blocks: per layer, one translated
vector (d x d), its |V| logits through the final LayerNorm and Eᵀ, forward and backward, in chunks of
positions. This script feeds `ffkv.memories.translators.fit_translators` a synthetic stream at the paper's
shape (16 layers, d = 1,024, |V| = 50,257 by default) and reports the time per step and per position and
the peak resident memory, so that a fit over N positions and E epochs costs about N x E x (s / position).

    python benchmarks/translators_fit.py [--positions 256] [--steps 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from ffkv.memories.projection import chunk_size
from ffkv.memories.translators import fit_translators


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50_257)
    p.add_argument("--positions", type=int, default=256, help="positions per minibatch (one optimizer step)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--chunk-bytes", type=int, default=64 * 2**20, help="the experiment's FIT_CHUNK_BYTES")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    L, d, V, n = args.layers, args.d_model, args.vocab, args.positions
    E = torch.randn(V, d, device=dev) / d ** 0.5
    norm = torch.nn.LayerNorm(d).to(dev).requires_grad_(False)
    resid = torch.randn(L, n, d, device=dev)
    head_in = torch.randn(n, d, device=dev)
    chunk = chunk_size(V, args.chunk_bytes)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def stream():
        for _ in range(args.steps):
            yield resid, (lambda part: norm(head_in[part]) @ E.T)

    start = time.perf_counter()
    fitted = fit_translators(stream, lambda x: norm(x) @ E.T, L, d, chunk, epochs=1, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"shape: {L} layers, d={d}, |V|={V:,}; {n} positions per step, chunks of {chunk} positions")
    print(f"{args.steps} steps: {seconds:.1f} s, {seconds / args.steps:.2f} s per step, "
          f"{1e3 * seconds / (args.steps * n):.2f} ms per position (all {L} layers)")
    print(f"peak resident memory {peak:.2f} GiB ({before:.2f} GiB before the fit: weights and the synthetic batch)")
    if dev.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print(f"fitted {fitted.info['steps']} steps; train KL layer 0: {fitted.info['train_kl_last_epoch'][0]:.3f}")


if __name__ == "__main__":
    main()
