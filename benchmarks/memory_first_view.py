"""The first view of a memory page on a real run: stored per-token coefficients against a forward pass.

A memory page shades every token of a key's trigger examples by the key's coefficient there. The
explorer's tables store those coefficients (`ffkv.experiments.trigger_contexts`); before, the page
ran the model over the key's trigger examples the first time it was asked for. In one process, with
the run's model loaded as `ffkv serve` loads it, this times the page (`pages.memory_page`: the
tables' queries, the value under the identity projection, the HTML) for keys never viewed before,
`--per-band` random keys in each third of the layers (a forward pass costs more the deeper the key), with
each page's size; `--forward N` also times N views computed by a forward pass (the explorer's fallback,
what every first view cost before the coefficients were stored). It also reports what the stored
coefficients cost: the build's seconds and the file's size (explorer/info.json), beside the index's
own seconds (manifest.json) for scale. On a run that stored none (a small model's pages compute their own,
`trigger_contexts.LIVE_MACS`) the per-band views are those computed views.

    python benchmarks/memory_first_view.py RUN [--per-band 20] [--forward 0] [--seed 0]
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
    """Median, p90 and max of page times, with n (also `latent_pages.py`'s)."""
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return (f"median {statistics.median(ordered):.3f} s, p90 {p90:.3f} s, max {ordered[-1]:.3f} s "
            f"(n = {len(ordered)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="an analysed run directory (its explorer tables built), e.g. runs/demo")
    parser.add_argument("--per-band", type=int, default=20,
                        help="random keys timed in each third of the layers (default: %(default)s)")
    parser.add_argument("--forward", type=int, default=0,
                        help="also time this many first views computed by a forward pass (default: none)")
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
    begun = time.perf_counter()
    data = ExplorerData(run, loaded)  # reads the tables, and checks the stored coefficients' SHA-256
    opened = time.perf_counter() - begun
    stored = data.coefficients
    how = "stored" if stored is not None else "computed (none stored)"  # a small model's pages compute their own
    rng = np.random.default_rng(args.seed)
    bands = np.array_split(np.arange(data.n_layers), 3)  # first, middle and last third of the layers
    keys_by_band = [[(int(layer), int(key)) for layer, key in zip(rng.choice(band, args.per_band),
                                                                    rng.choice(data.d_m, args.per_band, replace=False))]
                    for band in bands]
    layer, key = int(rng.integers(data.n_layers)), int(rng.integers(data.d_m))
    begun = time.perf_counter()
    pages.memory_page(data, layer + 1, key)
    first_page = time.perf_counter() - begun  # the process's first page: vocabulary strings, templates

    timings: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {}
    for band, keys in zip(bands, keys_by_band):
        name = f"layers {band[0] + 1}-{band[-1] + 1}"
        for layer, key in keys:
            begun = time.perf_counter()
            html = pages.memory_page(data, layer + 1, key)
            timings.setdefault(name, []).append(time.perf_counter() - begun)
            sizes.setdefault(name, []).append(len(html.encode()))
            assert 'id="triggers"' in html
    forward: list[float] = []
    for layer, key in [divmod(int(i), data.d_m) for i in rng.choice(data.n_layers * data.d_m, args.forward)]:
        data.coefficients = None  # the explorer's fallback: a forward pass over the key's trigger examples
        begun = time.perf_counter()
        pages.memory_page(data, layer + 1, key)
        forward.append(time.perf_counter() - begun)
    data.coefficients = stored
    data.close()

    info = lookups.read_info(run / "explorer")
    built = info.get("trigger_coefficients") or {}
    manifest = json.loads((run / "manifest.json").read_text())
    print(f"run {run}: {data.n_layers} layers x {data.d_m:,} keys, model {manifest['model']['id']}; "
          f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"the explorer's tables opened (the stored coefficients' file checked) in {opened:.3f} s")
    print(f"the process's first memory page (vocabulary strings, templates): {first_page:.3f} s")
    for band, seconds in timings.items():
        print(f"first view, {how}, {band}: {summary(seconds)}; page {statistics.median(sizes[band]) / 1000:.0f} kB "
              f"median, {max(sizes[band]) / 1000:.0f} kB max")
    if forward:
        every = [t for seconds in timings.values() for t in seconds]
        print(f"first view, forward pass (any layer): {summary(forward)}; forward pass / stored, medians: "
              f"{statistics.median(forward) / statistics.median(every):.1f}x")
    if stored is None:
        print(f"stored coefficients: none ({built.get('reason')}); the tables built in "
              f"{info.get('seconds', float('nan')):.1f} s; the index took "
              f"{manifest.get('timings', {}).get('index_seconds', float('nan')):.1f} s")
        return
    window = built.get("window")
    kept = "whole examples" if window is None else \
        f"a window of {window[0]} tokens before each trigger and {window[1]} after"
    print(f"stored coefficients: {kept}, at most {built.get('max_cells', 0):,} values; "
          f"{built.get('cells', 0):,} ({built.get('dtype')}), {built.get('bytes', 0) / 2**20:.1f} MiB; "
          f"built in {built.get('seconds', float('nan')):.1f} s of the tables' {info.get('seconds', float('nan')):.1f} s; "
          f"the index took {manifest.get('timings', {}).get('index_seconds', float('nan')):.1f} s")


if __name__ == "__main__":
    main()
