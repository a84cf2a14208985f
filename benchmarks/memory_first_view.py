"""The first view of a memory page on a real run: stored per-token coefficients against a forward pass.

A memory page shades every token of a key's trigger examples by the key's coefficient there. The
explorer's tables store those coefficients (`ffkv.experiments.trigger_contexts`); before, the page
ran the model over the key's trigger examples the first time it was asked for. In one process, with
the run's model loaded as `ffkv serve` loads it, this times the page (`pages.memory_page`: the
tables' queries, the value under the identity projection, the HTML) for keys never viewed before,
taking turns: one key read from the stored coefficients, the next computed by a forward pass (the
explorer's fallback, what every first view cost before). It also reports what the stored
coefficients cost: the build's seconds and the file's size (explorer/info.json), beside the index's
own seconds (manifest.json) for scale.

    python benchmarks/memory_first_view.py RUN [--keys 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))


def summary(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return (f"median {statistics.median(ordered):.3f} s, p90 {p90:.3f} s, max {ordered[-1]:.3f} s "
            f"(n = {len(ordered)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="an analysed run directory (its explorer tables built), e.g. runs/demo")
    parser.add_argument("--keys", type=int, default=40, help="keys timed each way (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from ffkv.explorer import pages
    from ffkv.explorer.data import ExplorerData
    from ffkv.explorer.model import load_run_model
    from ffkv.store import lookups

    run = Path(args.run)
    load = os.getloadavg()
    started = time.perf_counter()
    loaded = load_run_model(run)
    print(f"model loaded in {time.perf_counter() - started:.1f} s")
    data = ExplorerData(run, loaded)
    if data.coefficients is None:
        raise SystemExit(f"{run} has no stored trigger coefficients: `ffkv analyze {run} --only lookups` builds them")
    stored = data.coefficients
    rng = np.random.default_rng(args.seed)
    chosen = rng.choice(data.n_layers * data.d_m, size=2 * args.keys + 1, replace=False)
    keys = [divmod(int(i), data.d_m) for i in chosen]

    layer, key = keys.pop()
    begun = time.perf_counter()
    pages.memory_page(data, layer + 1, key)
    first_page = time.perf_counter() - begun  # the process's first page: vocabulary strings, templates

    timings: dict[str, list[float]] = {"stored": [], "forward pass": []}
    for i, (layer, key) in enumerate(keys):
        way = "stored" if i % 2 == 0 else "forward pass"
        data.coefficients = stored if way == "stored" else None
        begun = time.perf_counter()
        html = pages.memory_page(data, layer + 1, key)
        timings[way].append(time.perf_counter() - begun)
        assert 'id="triggers"' in html
    data.coefficients = stored
    data.close()

    info = lookups.read_info(run / "explorer")
    built = info.get("trigger_coefficients") or {}
    manifest = json.loads((run / "manifest.json").read_text())
    print(f"run {run}: {data.n_layers} layers x {data.d_m:,} keys, model {manifest['model']['id']}; "
          f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"the process's first memory page (vocabulary strings, templates): {first_page:.3f} s")
    for way, seconds in timings.items():
        print(f"first view, {way:>12}: {summary(seconds)}")
    ratio = statistics.median(timings["forward pass"]) / statistics.median(timings["stored"])
    print(f"forward pass / stored, medians: {ratio:.1f}x")
    print(f"stored coefficients: {built.get('cells', 0):,} ({built.get('dtype')}), {built.get('bytes', 0) / 2**20:.1f} MiB; "
          f"built in {built.get('seconds', float('nan')):.1f} s of the tables' {info.get('seconds', float('nan')):.1f} s; "
          f"the index took {manifest.get('timings', {}).get('index_seconds', float('nan')):.1f} s")


if __name__ == "__main__":
    main()
