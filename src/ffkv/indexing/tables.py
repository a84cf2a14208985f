"""The index's public tables, written in one canonical layout: the examples, the trigger examples of the model's
keys, of their random control, and of a dictionary's latents and control latents.

`examples.parquet` is always sorted by example id and cut into row groups of
`ROW_GROUP` rows, and `trigger_examples.parquet` is always sorted by (layer, key,
direction descending, rank): so a run split into shards and merged gives the same bytes as one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from ffkv.indexing.topk import EMPTY, TopKState
from ffkv.memories.controls import RandomKeys
from ffkv.store import atomic, schemas

ROW_GROUP = 65_536


def examples_table(examples: list) -> pa.Table:
    """Examples (objects with example_id, token_ids, text) as an Arrow table."""
    return pa.table({
        "example_id": pa.array([e.example_id for e in examples], pa.int64()),
        "token_ids": pa.array([np.asarray(e.token_ids, dtype=np.int32) for e in examples], pa.list_(pa.int32())),
        "text": pa.array([e.text for e in examples], pa.string()),
    }, schema=schemas.EXAMPLES)


def _sorted_batches(sources: list[Iterator[pa.RecordBatch]]) -> Iterator[pa.Table]:
    """Merge streams that are each sorted by example_id into one sorted stream of tables."""
    buffers: list[pa.Table | None] = [None] * len(sources)

    def refill(i: int) -> None:
        while buffers[i] is None or buffers[i].num_rows == 0:
            batch = next(sources[i], None)
            if batch is None:
                buffers[i] = None
                return
            buffers[i] = pa.Table.from_batches([batch])

    for i in range(len(sources)):
        refill(i)
    while any(b is not None for b in buffers):
        live = [i for i, b in enumerate(buffers) if b is not None]
        # Every row up to the smallest "last id" among live buffers can be emitted now.
        bound = min(buffers[i]["example_id"][-1].as_py() for i in live)
        ready = []
        for i in live:
            ids = buffers[i]["example_id"].to_numpy()
            n = int(np.searchsorted(ids, bound, side="right"))
            ready.append(buffers[i].slice(0, n))
            buffers[i] = buffers[i].slice(n)
            if buffers[i].num_rows == 0:
                refill(i)
        yield pa.concat_tables(ready).sort_by("example_id")


def write_examples(path: Path, sorted_sources: Iterable[Iterator[pa.RecordBatch]]) -> int:
    """Write examples from streams each sorted by id, merged, in fixed row groups; returns the row count."""
    rows = 0
    pending: list[pa.Table] = []
    n_pending = 0
    with atomic.atomic_path(path) as tmp:
        with pq.ParquetWriter(tmp, schemas.EXAMPLES, compression="zstd") as writer:
            for table in _sorted_batches(list(sorted_sources)):
                pending.append(table)
                n_pending += table.num_rows
                while n_pending >= ROW_GROUP:
                    whole = pa.concat_tables(pending)
                    writer.write_table(whole.slice(0, ROW_GROUP), row_group_size=ROW_GROUP)
                    pending, n_pending = [whole.slice(ROW_GROUP)], whole.num_rows - ROW_GROUP
                    rows += ROW_GROUP
            if n_pending:
                writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP)
                rows += n_pending
    return rows


def parquet_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """Record batches of a Parquet file, in file order."""
    return pq.ParquetFile(path).iter_batches(batch_size=ROW_GROUP)


def trigger_table(state: TopKState, directions: tuple[int, ...] = (1,)) -> pa.Table:
    """The state as the public trigger_examples table, sorted by (layer, key, direction desc, rank).

    Args:
        directions: the directions whose row blocks the state holds (`ffkv.indexing.topk.SIGNS`);
            the rows of direction -1 hold -m, written back as the coefficient m.
    """
    state = state.to("cpu")
    n_layers, rows, k = state.values.shape
    d_m = rows // len(directions)
    # (L, directions, d_m, k) -> (L, d_m, directions, k): a key's directions side by side, +1 first.
    grouped = [t.view(n_layers, len(directions), d_m, k).transpose(1, 2)
               for t in (state.values, state.example_id, state.position, state.next_token)]
    values, example_id, position, next_token = grouped
    sign = torch.tensor(directions, dtype=torch.float32)[None, None, :, None]
    filled = example_id != EMPTY
    shape = filled.shape
    if bool(filled.all()):  # the usual end of a run: every slot filled, in row-major order (nonzero's order)
        grid = lambda n, dim, dtype: torch.arange(n, dtype=dtype).view(  # noqa: E731
            [n if d == dim else 1 for d in range(4)]).expand(shape).reshape(-1)
        layer, key, rank = grid(n_layers, 0, torch.int16), grid(d_m, 1, torch.int32), grid(k, 3, torch.int16)
        direction = torch.tensor(directions, dtype=torch.int8).view(1, 1, -1, 1).expand(shape).reshape(-1)
        pick = lambda t: t.reshape(-1)  # noqa: E731
    else:
        layer, key, block, rank = torch.nonzero(filled, as_tuple=True)
        direction = torch.tensor(directions, dtype=torch.int8)[block]
        pick = lambda t: t[filled]  # noqa: E731
    return pa.table({
        "layer": pa.array(layer.to(torch.int16).numpy()),
        "key": pa.array(key.to(torch.int32).numpy()),
        "direction": pa.array(direction.numpy()),
        "rank": pa.array(rank.to(torch.int16).numpy()),
        "coefficient": pa.array(pick(values * sign).numpy()),
        "example_id": pa.array(pick(example_id).numpy()),
        "position": pa.array(pick(position).numpy()),
        "next_token_id": pa.array(pick(next_token).numpy()),
    }, schema=schemas.TRIGGER_EXAMPLES)


def state_from_table(table: pa.Table, n_layers: int, d_m: int, k: int,
                     directions: tuple[int, ...] = (1,)) -> TopKState:
    """The inverse of `trigger_table`: a state holding a table's entries."""
    state = TopKState.empty(n_layers, d_m * len(directions), k)
    column = lambda name, dtype: torch.tensor(table[name].to_numpy().astype(dtype))  # noqa: E731
    if "direction" in table.column_names:
        direction = column("direction", np.int64)
    else:  # a table of format 1 or 2: every row is of the positive direction
        direction = torch.ones(table.num_rows, dtype=torch.int64)
    block = torch.zeros_like(direction)
    for i, d in enumerate(directions):
        block[direction == d] = i
    if not torch.isin(direction, torch.tensor(directions)).all():
        raise ValueError(f"the table holds directions {sorted(set(direction.tolist()))}, not only {directions}")
    at = (column("layer", np.int64), block * d_m + column("key", np.int64), column("rank", np.int64))
    state.values[at] = column("coefficient", np.float32) * direction.float()
    state.example_id[at] = column("example_id", np.int64)
    state.position[at] = column("position", np.int32)
    state.next_token[at] = column("next_token_id", np.int32)
    return state


def write_triggers(path: Path, state: TopKState, directions: tuple[int, ...] = (1,)) -> None:
    """Write trigger_examples.parquet atomically."""
    atomic.write_parquet(path, trigger_table(state, directions))


#: The control's tables in a run directory (`ffkv.memories.controls`): its trigger examples, and its keys.
CONTROL_TRIGGERS, CONTROL_KEYS = "control_trigger_examples", "control_keys"


def control_keys_table(keys: RandomKeys) -> pa.Table:
    """Per layer and control memory: the real key it borrows its norms, biases and value from, and its norm."""
    layers = range(keys.view.n_layers)
    source = [keys.source(layer).numpy() for layer in layers]
    norms = [keys.layers[layer].keys.float().norm(dim=1).cpu().numpy() for layer in layers]
    return pa.table({
        "layer": pa.array(np.repeat(np.arange(len(source)), keys.n).astype(np.int16)),
        "key": pa.array(np.tile(np.arange(keys.n), len(source)).astype(np.int32)),
        "source_key": pa.array(np.concatenate(source).astype(np.int32)),
        "key_norm": pa.array(np.concatenate(norms).astype(np.float32)),
    }, schema=schemas.CONTROL_KEYS)


def write_control(run, state: TopKState, keys: RandomKeys, directions: tuple[int, ...] = (1,)) -> None:
    """Write the control's trigger examples (the layout of trigger_examples.parquet) and its keys."""
    write_triggers(run.table(CONTROL_TRIGGERS), state, directions)
    atomic.write_parquet(run.table(CONTROL_KEYS), control_keys_table(keys))


#: A dictionary's tables in a run directory (`ffkv.memories.latent_keys`): its latents' trigger examples, its control
#: latents' trigger examples (the layout of trigger_examples.parquet; layer: the model's, key: the latent), and
#: the control latents' borrowed latents (the layout of control_keys.parquet).
LATENT_TRIGGERS = "latent_trigger_examples"
LATENT_CONTROL_TRIGGERS = "latent_control_trigger_examples"
LATENT_CONTROL_KEYS = "latent_control_keys"


def latent_trigger_table(states: dict[int, TopKState], directions: tuple[int, ...] = (1,)) -> pa.Table:
    """Per-layer states (FF layer -> a one-layer state) as one trigger table, with only the entries where the latent
    fired (coefficient > 0: a latent's trigger is an example where it is active; a dead latent has none)."""
    tables = []
    for layer, state in sorted(states.items()):
        t = trigger_table(state, directions)
        t = t.set_column(0, "layer", pa.array(np.full(t.num_rows, layer, dtype=np.int16)))
        tables.append(t.filter(pc.greater(t["coefficient"], 0)))
    return pa.concat_tables(tables) if tables else schemas.TRIGGER_EXAMPLES.empty_table()


def write_latents(run, latents: dict[int, TopKState], control: dict[int, TopKState] | None, keys,
                  directions: tuple[int, ...] = (1,)) -> list[str]:
    """Write a dictionary's tables (`LatentKeys` `keys`); returns the names written."""
    atomic.write_parquet(run.table(LATENT_TRIGGERS), latent_trigger_table(latents, directions))
    if control is None:
        return [LATENT_TRIGGERS]
    atomic.write_parquet(run.table(LATENT_CONTROL_TRIGGERS), latent_trigger_table(control, directions))
    layers = keys.layers
    norms = [keys.controls[layer].encoder.float().norm(dim=1).cpu().numpy() for layer in layers]
    atomic.write_parquet(run.table(LATENT_CONTROL_KEYS), pa.table({
        "layer": pa.array(np.repeat(np.asarray(layers), keys.n_control).astype(np.int16)),
        "key": pa.array(np.tile(np.arange(keys.n_control), len(layers)).astype(np.int32)),
        "source_key": pa.array(np.concatenate([keys.source(layer).numpy() for layer in layers]).astype(np.int32)),
        "key_norm": pa.array(np.concatenate(norms).astype(np.float32)),
    }, schema=schemas.CONTROL_KEYS))
    return [LATENT_TRIGGERS, LATENT_CONTROL_TRIGGERS, LATENT_CONTROL_KEYS]
