"""Whether a trigger table's ids lie within the run's shape: its layers, each layer's memories, the ranks of top-k.

A table that passes its record (`ffkv.store.integrity`) may still have been written by someone else, record and
all; an id outside the run's shape would index past an array in a reader. Every reader of a trigger table checks
the ids it read against the run's manifest (`sizes`) before it uses them (`problem`): such a table is damaged,
never a crash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import pandas as pd

    from ffkv.store.manifest import Manifest


def sizes(manifest: Manifest, rel: str) -> dict[int, int]:
    """Layer (from 0) -> how many memories the trigger table `rel` (``trigger_examples.parquet``,
    ``control_trigger_examples.parquet``, ``latent_trigger_examples.parquet``,
    ``latent_control_trigger_examples.parquet``) may hold in it, by the run's manifest."""
    model = manifest.model
    if rel.startswith("latent_"):
        dictionary = manifest.identity.index.get("dictionary") or {}
        width = {int(layer): int(entry["n_latents"]) for layer, entry in dictionary.items()}
        return {layer: manifest.control_keys for layer in width} if "control" in rel else width
    n = manifest.control_keys if rel.startswith("control_") else int(model.d_m)
    return {layer: n for layer in range(int(model.n_layers))}


def problem(found: pd.DataFrame, allowed: Mapping[int, int], top_k: int) -> str | None:
    """What lies outside the run's shape in `found` (one row per layer: ``layer``, ``key_min``, ``key_max``,
    ``rank_min``, ``rank_max``; `spans` makes it from a table's rows), or None: a layer not in `allowed`, a memory
    outside ``[0, allowed[layer])``, a rank outside ``[0, top_k)``."""
    for row in found.itertuples(index=False):
        layer = int(row.layer)
        if layer not in allowed:
            return f"layer id {layer} in its rows; the run's layer ids (from 0) are {_listed(allowed)}"
        if int(row.key_min) < 0 or int(row.key_max) >= allowed[layer]:
            return (f"memory {int(row.key_max) if int(row.key_max) >= allowed[layer] else int(row.key_min)} of "
                    f"layer {layer} in its rows; that layer has {allowed[layer]:,}")
        if int(row.rank_min) < 0 or int(row.rank_max) >= top_k:
            return f"rank {int(row.rank_max) if int(row.rank_max) >= top_k else int(row.rank_min)} in its rows; " \
                   f"the run keeps the top {top_k}"
    return None


def spans(rows: pd.DataFrame) -> pd.DataFrame:
    """`problem`'s input from a trigger table's rows (``layer``, ``key``, ``rank``)."""
    grouped = rows.groupby("layer", sort=True).agg(key_min=("key", "min"), key_max=("key", "max"),
                                                   rank_min=("rank", "min"), rank_max=("rank", "max"))
    return grouped.reset_index()


#: `problem`'s input from a table of explorer.duckdb (or any SQL table of trigger rows): format with its name.
SPANS_SQL = ("SELECT layer, min(key) AS key_min, max(key) AS key_max, min(rank) AS rank_min, max(rank) AS rank_max "
             "FROM {table} GROUP BY layer ORDER BY layer")


def _listed(allowed: Mapping[int, int]) -> str:
    layers = sorted(allowed)
    if layers and layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]} to {layers[-1]}"
    return ", ".join(map(str, layers)) or "none"


__all__ = ["SPANS_SQL", "problem", "sizes", "spans"]
