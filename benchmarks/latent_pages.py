"""The explorer's latent pages on a run indexed with a sparse dictionary: first views, the layer page, search.

In one process, with the run's model loaded and the explorer's data opened and warmed as `ffkv serve` does
(`ExplorerData(...).warm()`: the vocabulary's strings, the dictionary read again and checked, the first value
read), this times, per dictionary layer:

- the first view of `--per-layer` random latents never viewed before, as HTML (`pages.latent_page`), and of as
  many others as the JSON twin (`pages.latent_json`, serialised); then the same for latents that have trigger
  examples (at this size many latents never fire over a small index, and a dead latent's page is nearly empty);
  with each page's size;
- the latent layer page (`pages.latent_layer_page`, ``/layer/t4``): its first request (the layer's table built),
  then warm, every sort order it offers, ascending and descending, and the last page of the default order;

then the search across neurons and latents (`pages.search_page`: a token's promoting memories, a text's
trigger examples with the latents each triggers). Budgets: a latent page's first view under
0.5 s, a layer page under 1 s warm.

    python benchmarks/latent_pages.py RUN [--per-layer 20] [--seed 0] [--tokens " the,ing, city"] [--texts "the,river"]
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

from memory_first_view import summary

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

FIRST_VIEW_BUDGET = 0.5
LAYER_PAGE_BUDGET = 1.0


def sizes(values: list[int]) -> str:
    return f"page {statistics.median(values) / 1000:.0f} kB median, {max(values) / 1000:.0f} kB max"


def timed(function, *args):
    begun = time.perf_counter()
    out = function(*args)
    return time.perf_counter() - begun, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="an analysed run indexed with --dictionary (its explorer tables built)")
    parser.add_argument("--per-layer", type=int, default=20,
                        help="random latents first viewed per dictionary layer, as HTML and as JSON each "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", default=" the,ing, city",
                        help="tokens searched for (comma-separated; default: %(default)r)")
    parser.add_argument("--texts", default="the,river", help="texts searched for (comma-separated)")
    args = parser.parse_args()

    from ffkv.explorer import pages
    from ffkv.explorer.data import ExplorerData
    from ffkv.explorer.model import load_run_model

    run = Path(args.run)
    load = os.getloadavg()
    seconds, loaded = timed(load_run_model, run)
    print(f"model loaded in {seconds:.1f} s")
    opened, data = timed(ExplorerData, run, loaded)
    if data.latents is None:
        raise SystemExit(f"{run} was indexed without a dictionary: it has no latent pages")
    latents = data.latents
    warmed, _ = timed(lambda: (data.warm(), pages.warm()))
    print(f"run {run}: {data.n_layers} layers x {data.d_m:,} neurons; dictionaries "
          + ", ".join(f"{latents.name(layer)} ({latents.size(layer):,} latents)" for layer in latents.layers))
    print(f"the explorer's data opened in {opened:.3f} s; warmed as `ffkv serve` warms it in {warmed:.3f} s")

    rng = np.random.default_rng(args.seed)
    failed: list[str] = []
    for layer in latents.layers:
        name, n = latents.name(layer), latents.size(layer)
        stats = latents.stats.loc[layer]
        live = stats.index[stats["n_triggers"].to_numpy() > 0].to_numpy()
        print(f"{name} ({n:,} latents, {n - len(live):,} dead over the index):")
        # any latent, then latents with trigger examples (a dead latent's page is nearly empty); each latent is
        # viewed once, as HTML or as JSON, never before in this process
        anywhere = rng.choice(n, 2 * args.per_layer, replace=False)
        alive = rng.choice(np.setdiff1d(live, anywhere), min(2 * args.per_layer, len(np.setdiff1d(live, anywhere))),
                           replace=False)
        for what, chosen in (("random", anywhere), ("random with trigger examples", alive)):
            html_s, html_b, json_s, json_b = [], [], [], []
            for i, key in enumerate(chosen):
                address = f"{name}:{int(key)}"
                if i % 2 == 0:
                    seconds, html = timed(pages.latent_page, data, address)
                    html_s.append(seconds)
                    html_b.append(len(html.encode()))
                else:
                    seconds, text = timed(lambda a: json.dumps(pages.latent_json(data, a)), address)
                    json_s.append(seconds)
                    json_b.append(len(text.encode()))
            print(f"  latent page, first view, {what}, HTML: {summary(html_s)}; {sizes(html_b)}")
            print(f"  latent page, first view, {what}, JSON: {summary(json_s)}; {sizes(json_b)}")
            if max(html_s + json_s) >= FIRST_VIEW_BUDGET:
                failed.append(f"{name} first view ({what}) max {max(html_s + json_s):.3f} s")

        busiest = stats["activation_frequency"].nlargest(3).index.to_numpy()  # the most active: the fullest pages
        busy = [timed(pages.latent_page, data, f"{name}:{int(key)}") for key in busiest]
        print(f"  latent page, first view, the 3 most active latents ({', '.join(map(str, busiest))}), HTML: "
              f"{summary([t for t, _ in busy])}; {sizes([len(h.encode()) for _, h in busy])}")
        if max(t for t, _ in busy) >= FIRST_VIEW_BUDGET:
            failed.append(f"{name} first view (most active) max {max(t for t, _ in busy):.3f} s")

        cold, html = timed(pages.latent_layer_page, data, name)
        print(f"  layer page /layer/{name}, first request (its table built): {cold:.3f} s, "
              f"{len(html.encode()) / 1000:.0f} kB")
        table = latents.layer_table(layer)  # the sorts the page offers: its columns, as `latent_layer_page` keeps them
        sorts = [s for c, _, s in pages.LATENT_COLUMNS if c in table.columns
                 and not (c == "explanation_score" and table[c].isna().all())]
        warm: dict[str, float] = {}
        warm_b: list[int] = []
        for sort in sorts:
            for order in ("asc", "desc"):
                seconds, html = timed(pages.latent_layer_page, data, name, sort, order)
                warm[f"{sort} {order}"] = seconds
                warm_b.append(len(html.encode()))
        n_pages = -(-n // pages.PAGE_SIZE)
        last, html = timed(pages.latent_layer_page, data, name, None, "asc", str(n_pages))
        warm[f"latent asc, page {n_pages}"] = last
        slowest = max(warm, key=warm.get)
        print(f"  layer page warm, {len(sorts)} sorts x asc/desc and the last page: {summary(list(warm.values()))}; "
              f"slowest {slowest!r}; {sizes(warm_b)}")
        if warm[slowest] >= LAYER_PAGE_BUDGET:
            failed.append(f"{name} layer page warm max {warm[slowest]:.3f} s ({slowest})")

    for token in [t for t in args.tokens.split(",") if t]:
        first, html = timed(pages.search_page, data, token)
        again, _ = timed(pages.search_page, data, token)
        print(f"search ?token={token!r} (neurons and latents promoting it): {first:.3f} s, again {again:.3f} s, "
              f"{len(html.encode()) / 1000:.0f} kB")
    for text in [t for t in args.texts.split(",") if t]:
        first, html = timed(pages.search_page, data, None, text)
        again, _ = timed(pages.search_page, data, None, text)
        print(f"search ?q={text!r} (trigger examples, with the neurons and latents each triggers): {first:.3f} s, "
              f"again {again:.3f} s, {len(html.encode()) / 1000:.0f} kB")
    data.close()
    print(f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("budgets (first view < 0.5 s, layer page < 1 s warm): " + ("held" if not failed else
                                                                      "missed: " + "; ".join(failed)))


if __name__ == "__main__":
    main()
