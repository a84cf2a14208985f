"""Trigger mining per sentence: ffkv's reduction against the paper's algorithm, on the same activations.

The paper's released code keeps, for every layer and key, a running top-k list and
updates it in a Python loop: one step per layer and key per sentence. ffkv reduces a
whole batch on the device at once (`TriggerReducer`). Both consume identical
coefficient tensors captured once from a GPT-2-small-shaped model; the forward pass
is not timed. Goal: at least 1,000 times faster per sentence.

    python benchmarks/mining_vs_paper.py [--device cuda] [--sentences 256] [--paper-sentences 4]
"""

from __future__ import annotations

import argparse
import heapq

import torch

from common import corpus_file, gpt2_shaped, timed


def paper_mining(coefficients: torch.Tensor, example_id: int, heaps: list[list[list]], k: int) -> None:
    """One sentence, as the released code does it: a Python step per layer and key."""
    acts = coefficients.cpu().numpy()  # (L, T, d_m)
    for layer in range(acts.shape[0]):
        per_key_max = acts[layer]
        for key in range(acts.shape[2]):
            column = per_key_max[:, key]
            position = int(column.argmax())
            entry = (float(column[position]), -example_id, position)
            heap = heaps[layer][key]
            if len(heap) < k:
                heapq.heappush(heap, entry)
            elif entry > heap[0]:
                heapq.heapreplace(heap, entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--paper-sentences", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    from ffkv.corpus import CorpusReader, CorpusSpec
    from ffkv.batching import collate
    from ffkv.indexing.reducer import TriggerReducer
    from ffkv.indexing.topk import TopKState

    loaded = gpt2_shaped(args.device, args.dtype)
    view, k = loaded.view, 50
    spec = CorpusSpec(source=str(corpus_file(args.sentences)), unit="sentence", max_examples=args.sentences)
    examples = list(CorpusReader(spec, loaded.tokenizer))
    batches = [collate(examples[i: i + args.batch_size], loaded.tokenizer.pad_id, loaded.tokenizer.special_ids)
               .to(args.device) for i in range(0, len(examples), args.batch_size)]
    captured = []
    for b in batches:
        with view.capture(("coefficients",)) as cap:
            view.forward(b.input_ids, b.attention_mask)
        captured.append([cap["coefficients"][l] for l in range(view.n_layers)])

    def ours():
        reducer = TriggerReducer(TopKState.empty(view.n_layers, view.d_m, k, view.device), "example")
        for b, layers in zip(batches, captured):
            reducer.start(b)
            for l, c in enumerate(layers):
                reducer("coefficients", l, c.clone())  # the reducer works in place; keep the inputs
            reducer.commit()
        reducer.flush()

    def clone_all():
        for layers in captured:
            for c in layers:
                c.clone()

    ours()  # warm-up
    t_ours = max(timed(ours) - timed(clone_all), 1e-9) / len(examples)

    heaps = [[[] for _ in range(view.d_m)] for _ in range(view.n_layers)]
    b0, layers0 = batches[0], captured[0]
    n_paper = min(args.paper_sentences, len(b0.example_ids))

    def paper():
        for row in range(n_paper):
            n = int(b0.attention_mask[row].sum())
            acts = torch.stack([c[row, :n] for c in layers0])
            paper_mining(acts, int(b0.example_ids[row]), heaps, k)

    t_paper = timed(paper) / n_paper
    print(f"device={args.device} layers={view.n_layers} keys/layer={view.d_m} top-k={k} "
          f"sentences: ffkv {len(examples)}, paper loop {n_paper}")
    print(f"per sentence: paper algorithm {t_paper * 1e3:.1f} ms, ffkv {t_ours * 1e6:.1f} us")
    print(f"speed-up = {t_paper / t_ours:,.0f}x   (goal >= 1,000x)")


if __name__ == "__main__":
    main()
