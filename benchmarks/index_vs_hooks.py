"""`ffkv index` against the hooks a researcher writes (nnsight, TransformerLens) and the bare forward pass.

One process, one loaded model, the same lines; the sides take turns (the order rotates), `--repeats`
times:

- `index`: `ffkv index` through its library entry point (`build_index`) with its defaults: both
  directions of every key, and the 256 random control keys per layer in the same pass. It reads and
  tokenizes the corpus, and writes every table.
- `nnsight`: the script a researcher would write with nnsight (`nnsight_triggers` below): every line
  tokenized and sorted by length, batches of the same size and token budget as ffkv's, inference
  mode, each layer's coefficients (the down-projection's input) reduced inside the trace to each
  example's extreme and its first position in both directions, the trace stopped after the last
  layer's coefficients, then per layer one stable sort that merges the batch into a running top-k
  (ties: lower example id, as SPEC section 3). No control keys.
- `tl`: the same with TransformerLens (`TransformerBridge.boot_transformers` around the loaded Hugging
  Face model, hook `blocks.{l}.mlp.hook_post`, `stop_at_layer`). The bridge computes attention itself
  (its own reshapes and eager softmax, for its attention hooks), whose last bits differ from the model's
  SDPA, so its table agrees with ffkv's on part of the rows only (printed): the same work, not the same
  bits.
- `forward`: the model's blocks over ffkv's own batches of the same lines, nothing captured.

Before timing, each peer's trigger table is compared with the one `ffkv index` wrote (layer, key,
direction, rank, coefficient bits, example id, position, next token). Printed: per side the median
wall and CPU time (user + system of this process) with the spread, each round's ratios, the peak RSS
above the process's level before the side ran (sampled every 5 ms), and the load average.

    python benchmarks/index_vs_hooks.py --model SmolLM2-135M-Instruct.Q4_1.gguf --lines 300   # long lines
    python benchmarks/index_vs_hooks.py --model ... --corpus short --lines 1200                # short lines
    python benchmarks/index_vs_hooks.py --model gpt2-small --sides index,nnsight,tl,forward     # GPT-2's shape

`--model gpt2-small` is GPT-2 small's shape with random weights (`common.gpt2_shaped`); a path loads
as `ffkv index --model PATH` does. Needs the `benchmark` extra (nnsight, transformer-lens).
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from common import gpt2_shaped, shared_data

SIDES = ("index", "nnsight", "tl", "forward")


# --- the plain scripts a researcher writes -------------------------------------------------------


def length_sorted_batches(ids: list[list[int]], batch_size: int, max_batch_tokens: int) -> list[list[int]]:
    """Example indices sorted by length, cut into batches of at most `batch_size` and `max_batch_tokens`."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches, batch = [], []
    for i in order:
        if len(batch) == batch_size or (batch and len(ids[i]) * (len(batch) + 1) > max_batch_tokens):
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + [batch]


def merge_top_k(state: list[torch.Tensor] | None, new: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """Keep the k best of state + new per row: (value, example id, position, next token), each (rows, n);
    higher value first, ties to the lower example id."""
    v, e, p, t = new if state is None else (torch.cat([a, b], dim=1) for a, b in zip(state, new))
    order = e.argsort(dim=1, stable=True)
    order = order.gather(1, (-v.gather(1, order)).argsort(dim=1, stable=True))[:, :k]
    return [x.gather(1, order) for x in (v, e, p, t)]


def plain_triggers(lines: list[str], tokenizer, run_layers, n_layers: int, k: int,
                   batch_size: int, max_batch_tokens: int, groups: list[list[int]] | None = None
                   ) -> list[list[torch.Tensor]]:
    """The streaming top-k around a hook library: `run_layers(input_ids)` returns, per layer, the
    coefficients' per-example (max, argmax, min, argmin) over real positions, each (B, d_m). `groups`: the
    examples of each batch (default: every line sorted by length, `length_sorted_batches`)."""
    ids = tokenizer(lines)["input_ids"]
    special = torch.tensor(tokenizer.all_special_ids or [-1])
    state: list = [None] * n_layers
    with torch.inference_mode():
        for batch in groups or length_sorted_batches(ids, batch_size, max_batch_tokens):
            batch = sorted(batch)
            t = max(len(ids[i]) for i in batch)
            x = torch.tensor([ids[i] + [0] * (t - len(ids[i])) for i in batch])
            length = torch.tensor([len(ids[i]) for i in batch])[:, None]
            real = (torch.arange(t)[None, :] < length) & ~torch.isin(x, special)
            nxt = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
            nxt = torch.where(torch.arange(t)[None, :] + 1 < length, nxt, -1)
            eid = torch.tensor(batch)
            for layer, (hi, hi_pos, lo, lo_pos) in enumerate(run_layers(x, real)):
                values = torch.cat([hi, -lo], dim=1).T                    # (2 d_m, B): +m then -m
                pos = torch.cat([hi_pos, lo_pos], dim=1).T
                new = [values, eid[None, :].expand_as(pos), pos, nxt.gather(1, pos.T).T]
                state[layer] = merge_top_k(state[layer], new, k)
    return state


def extremes(c: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per example and key: the largest coefficient over real positions and its first position, the smallest and its."""
    hi, hi_pos = c.masked_fill(~real[:, :, None], float("-inf")).max(dim=1)
    lo, lo_pos = c.masked_fill(~real[:, :, None], float("inf")).min(dim=1)
    return hi, hi_pos, lo, lo_pos


def nnsight_triggers(model, tokenizer, lines, k, batch_size, max_batch_tokens, groups=None):
    """The nnsight script: the reduction runs inside the trace, so no layer's coefficients are kept."""
    from nnsight import LanguageModel

    lm = LanguageModel(model, tokenizer=tokenizer)
    blocks = lm.transformer.h if hasattr(model, "transformer") else lm.model.layers
    down = (lambda b: b.mlp.c_proj) if hasattr(model, "transformer") else (lambda b: b.mlp.down_proj)

    def run_layers(x, real):
        out = []
        with lm.trace(x) as tracer:
            for block in blocks:
                out.append([t.save() for t in extremes(down(block).input, real)])
            tracer.stop()
        return out

    return plain_triggers(lines, tokenizer, run_layers, len(blocks), k, batch_size, max_batch_tokens, groups)


def tl_triggers(model, tokenizer, lines, k, batch_size, max_batch_tokens, groups=None):
    """The TransformerLens script: a hook on each block's `mlp.hook_post` (its coefficients)."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(model.config.model_type, hf_model=model, tokenizer=tokenizer)
    n = bridge.cfg.n_layers

    def run_layers(x, real):
        out = []
        hooks = [(f"blocks.{l}.mlp.hook_post", lambda c, hook: out.append(extremes(c, real))) for l in range(n)]
        bridge.run_with_hooks(x, fwd_hooks=hooks, stop_at_layer=n)
        return out

    return plain_triggers(lines, tokenizer, run_layers, n, k, batch_size, max_batch_tokens, groups)


# --- the benchmark -------------------------------------------------------------------------------


def short_or_long_lines(kind: str, n: int) -> Path:
    """n WikiText-103 validation lines (headings left out, detokenized), or n of its sentences of 3-30 words."""
    from ffkv.corpus.sentences import split_sentences
    from ffkv.corpus.wikitext import detokenize

    lines: list[str] = []
    for raw in (shared_data() / "wikitext-103" / "wiki.valid.raw").read_text(encoding="utf-8").splitlines():
        raw = raw.strip()
        if raw and not raw.startswith("="):
            if kind == "short":
                lines += [s for s in split_sentences(detokenize(raw)) if 3 <= len(s.split()) <= 30]
            else:
                lines.append(detokenize(raw))
        if len(lines) >= n:
            break
    path = Path(tempfile.mkdtemp()) / f"{kind}-{n}.txt"
    path.write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
    return path


def table_of(state: list[list[torch.Tensor]]):
    """A peer's state as the columns of ffkv's trigger table, in its order (layer, key, direction desc, rank)."""
    v, e, p, t = (torch.stack([s[i] for s in state]) for i in range(4))    # (L, 2 d_m, k)
    n_layers, rows, k = v.shape
    v = v * torch.tensor([1.0, -1.0]).repeat_interleave(rows // 2)[None, :, None]
    grouped = [x.view(n_layers, 2, rows // 2, k).transpose(1, 2).reshape(-1) for x in (v, e, p, t)]
    return {"coefficient": grouped[0].view(torch.int32), "example_id": grouped[1],
            "position": grouped[2].to(torch.int32), "next_token_id": grouped[3].to(torch.int32)}


def agreement(state, run: Path) -> str:
    """How many of the peer's trigger rows equal ffkv's (every column, coefficient bits included)."""
    import pyarrow.parquet as pq

    ours = pq.read_table(run / "trigger_examples.parquet")
    theirs = table_of(state)
    column = lambda name: torch.from_numpy(ours[name].to_numpy().copy())  # noqa: E731
    same = torch.ones(ours.num_rows, dtype=torch.bool)
    for name, values in theirs.items():
        mine = column(name)
        mine = mine.view(torch.int32) if name == "coefficient" else mine
        if mine.shape != values.shape:
            return f"DIFFERENT SHAPE ({ours.num_rows:,} rows against {values.numel():,})"
        same &= mine == values
    n = int(same.sum())
    return ("bitwise identical" if n == ours.num_rows else "NOT identical") + f": {n:,} of {ours.num_rows:,} rows"


class PeakRSS:
    """The peak resident memory of this process above its level at the start, sampled every 5 ms."""

    def __enter__(self):
        self.start = self.peak = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._now())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())
        self.above = self.peak - self.start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small", help="gpt2-small (random weights) or a model path (.gguf)")
    parser.add_argument("--corpus", choices=("long", "short"), default="long",
                        help="long: WikiText-103 lines; short: its sentences of 3-30 words, one a line")
    parser.add_argument("--lines", type=int, default=300)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--sides", default="index,nnsight,forward", help=f"comma-separated, of {','.join(SIDES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-check", action="store_true", help="skip comparing the peers' tables with ffkv's")
    args = parser.parse_args()
    sides = args.sides.split(",")

    from ffkv.batching import collate, length_batches, windows
    from ffkv.corpus import CorpusReader, CorpusSpec
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index, run_forward
    from ffkv.models.loading import load_model

    loaded = gpt2_shaped() if args.model == "gpt2-small" else load_model(args.model)
    hf_tokenizer = loaded.tokenizer.hf
    corpus = short_or_long_lines(args.corpus, args.lines)
    lines = [l for l in corpus.read_text(encoding="utf-8").splitlines() if l.strip()]
    spec = CorpusSpec(source=str(corpus), unit="line", max_examples=len(lines))
    batching = BatchOptions(batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens)
    examples = list(CorpusReader(spec, loaded.tokenizer))
    if [list(map(int, e.token_ids)) for e in examples] != [list(x) for x in hf_tokenizer(lines)["input_ids"]]:
        raise SystemExit("ffkv's examples are not the lines' token ids: the peers would index something else")
    batches = [collate(g, loaded.tokenizer.pad_id, loaded.special_ids, 1)
               for w in windows(examples, batching.batch_size * batching.window_batches)
               for g in length_batches(w, batching.batch_size, batching.max_batch_tokens)]
    n_tokens = sum(b.n_tokens for b in batches)
    tl_model = copy.deepcopy(loaded.model) if "tl" in sides else None  # the bridge switches its attention to eager
    peer = lambda fn, model: lambda: fn(model, hf_tokenizer, lines, args.top_k, args.batch_size,  # noqa: E731
                                         args.max_batch_tokens)
    work = Path(tempfile.mkdtemp())
    runs = iter(range(10**6))

    def index():
        out = work / f"run{next(runs)}"
        build_index(loaded, spec, out, IndexOptions(top_k=args.top_k, sign="both"), batching, progress=False)
        return out

    def forward():
        for b in batches:
            run_forward(loaded, b)

    fns = {"index": index, "nnsight": peer(nnsight_triggers, loaded.model), "tl": peer(tl_triggers, tl_model),
           "forward": forward}
    print(f"model={loaded.model_id} layers={loaded.view.n_layers} d_m={loaded.view.d_m} corpus={args.corpus} "
          f"examples={len(examples)} tokens={n_tokens} batches={len(batches)} top_k={args.top_k} "
          f"threads={torch.get_num_threads()}", flush=True)
    reference = index()  # also the warm-up
    if not args.no_check:
        # The peers sort every line by length; ffkv sorts within windows of consecutive examples (its memory does
        # not grow with the corpus). Where that makes other batches, each example's padding differs and so do the
        # last bits of its coefficients: the check then runs again with ffkv's batches, which must agree bitwise.
        ffkv_groups = [[int(e.example_id) for e in g] for w in windows(examples, batching.batch_size *
                       batching.window_batches) for g in length_batches(w, batching.batch_size,
                                                                         batching.max_batch_tokens)]
        same_batches = sorted(map(sorted, ffkv_groups)) == sorted(map(sorted, length_sorted_batches(
            [list(e.token_ids) for e in examples], args.batch_size, args.max_batch_tokens)))
        for name in ("nnsight", "tl"):
            if name in sides:
                print(f"{name}'s trigger table against ffkv's: {agreement(fns[name](), reference)}", flush=True)
                if not same_batches:
                    fn = nnsight_triggers if name == "nnsight" else tl_triggers
                    again = fn(loaded.model if name == "nnsight" else tl_model, hf_tokenizer, lines, args.top_k,
                               args.batch_size, args.max_batch_tokens, ffkv_groups)
                    print(f"  in ffkv's batches (windows of {batching.batch_size * batching.window_batches:,} "
                          f"examples): {agreement(again, reference)}", flush=True)
    shutil.rmtree(reference)
    if args.repeats < 1:  # the check alone
        return
    wall = {s: [] for s in sides}
    cpu = {s: [] for s in sides}
    peak = {s: 0 for s in sides}
    loads = []
    for r in range(args.repeats):
        order = sides[r % len(sides):] + sides[: r % len(sides)]
        for s in order:
            loads.append(os.getloadavg()[0])
            c0, t0 = time.process_time(), time.perf_counter()
            with PeakRSS() as rss:
                out = fns[s]()
            wall[s].append(time.perf_counter() - t0)
            cpu[s].append(time.process_time() - c0)
            peak[s] = max(peak[s], rss.above)
            if s == "index":
                shutil.rmtree(out)
        print(f"round {r}: " + ", ".join(f"{s} {wall[s][-1]:.2f} s" for s in order)
              + f" (load {loads[-len(order)]:.2f})", flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"\nload average (1 min) before each run: {min(loads):.2f}-{max(loads):.2f}; "
          f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    for s in sides:
        print(f"{s:8s} wall {med(wall[s]):7.2f} s ({min(wall[s]):.2f}-{max(wall[s]):.2f})  "
              f"CPU {med(cpu[s]):7.2f} s ({min(cpu[s]):.2f}-{max(cpu[s]):.2f})  "
              f"peak RSS above start {peak[s] / 2**30:.2f} GiB  {n_tokens / med(wall[s]):,.0f} tok/s")
    if "index" in sides:
        for s in sides:
            if s != "index":
                pw = [a / b for a, b in zip(wall["index"], wall[s])]
                pc = [a / b for a, b in zip(cpu["index"], cpu[s])]
                print(f"index / {s}: wall {med(wall['index']) / med(wall[s]):.3f} (rounds "
                      + ", ".join(f"{x:.3f}" for x in pw) + f"), CPU {med(cpu['index']) / med(cpu[s]):.3f} (rounds "
                      + ", ".join(f"{x:.3f}" for x in pc) + ")")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
