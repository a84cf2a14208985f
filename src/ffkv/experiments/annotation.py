"""The human side of SPEC section 4: a sample of keys to label, as the paper's experts did.

`export_sample` writes a CSV of seeded random keys per layer with their top prefixes;
a person fills in a ``label`` per key; `ffkv.store.annotations.import_csv` stores the
labels in the run, where `ffkv analyze --only patterns` compares them with the
automatic ones.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ffkv.experiments.common import RunContext, open_run
from ffkv.store import atomic


def export_sample(run_dir: str | Path, out: str | Path, keys_per_layer: int = 10, top: int = 25,
                  seed: int = 0, loaded=None) -> Path:
    """Write a CSV for human annotation: `keys_per_layer` seeded random keys per layer, `top` prefixes each.

    One row per prefix (layer, key, rank, prefix, next token, coefficient) and an empty
    ``label`` column (shallow, semantic, both or none) to fill in on any row of the key,
    plus an optional ``description``. Automatic labels are left out so as not to prime.
    """
    run, manifest, loaded = open_run(run_dir, loaded)
    ctx = RunContext(run, manifest, loaded, progress=False, seed=seed)
    view = loaded.view
    rng = np.random.default_rng([seed, 7])
    trig = ctx.triggers()
    trig = trig[trig["rank"] < top]
    rows = []
    for layer in range(view.n_layers):
        chosen = np.sort(rng.choice(view.d_m, size=min(keys_per_layer, view.d_m), replace=False))
        sub = trig[(trig["layer"] == layer) & trig["key"].isin(chosen)]
        for t in sub.itertuples(index=False):
            rows.append({"layer": layer, "key": int(t.key), "rank": int(t.rank),
                         "prefix": ctx.prefix_text(t.example_id, t.position), "next_token": ctx.token(t.next_token_id),
                         "coefficient": f"{t.coefficient:.4g}", "example_id": int(t.example_id),
                         "position": int(t.position), "label": "", "description": ""})
    out = Path(out)
    with atomic.atomic_path(out) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["layer", "key", "label"])
            writer.writeheader()
            writer.writerows(rows)
    return out
