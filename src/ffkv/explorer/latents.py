"""What the explorer reads of a sparse dictionary's latents (docs/definitions.md), for a run indexed with one.

A latent is a memory of its own: its page shows what a neuron's shows (`ExplorerData.memory`), from the latents'
lookup tables (`ffkv.experiments.latent_lookups`: latent_stats.parquet, latent_value_top_tokens.parquet,
latent_trigger_coefficients.npy, explorer.duckdb's latent_triggers), so that it runs no model but for the value's
tokens (one decoder row through a projection, as the neuron page reads v_i). Latents are addressed as everywhere
(`ffkv.memories.address.LatentRef`: ``t4:42``, layers from 1); in code and tables layers count from 0 and a
latent's index is the tables' ``key``.

Each table is checked when read (its size against info.json's record, its columns against
`ffkv.store.schemas`); a damaged one is named with the command that writes it again.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

from ffkv.errors import DamagedRun, FfkvError, one_line
from ffkv.explorer.validation import BadRequest
from ffkv.memories.address import (LATENT_PREFIX, LatentRef, MemoryLayout, MemoryRef, latent_kind, quoted,
                                  whole_number)
from ffkv.store import integrity, lookups, schemas
from ffkv.store.annotations import Annotations
from ffkv.store.integrity import rewrite_command

if TYPE_CHECKING:  # pragma: no cover
    from ffkv.explorer.data import ExplorerData
    from ffkv.memories.sets import Latents

#: Top and bottom tokens a latent page shows of its value.
VALUE_TOKENS = 15
#: The latent studies' per-latent tables a latent page reads, and the columns it shows of the patterns'.
PATTERNS_LATENTS, CENSUS_LATENTS = "patterns_latents_keys", "census_latents_keys"
PATTERN_COLUMNS = {"label": "label", "shallow_score": "shallow_score", "semantic_z": "semantic_z"}


def read_table(folder: Path, name: str, schema: pa.Schema, info: dict[str, Any], fix: str) -> pd.DataFrame:
    """A lookup table of `folder` with `schema`'s columns, or `DamagedRun` naming it and `fix`: missing, another
    size than info.json records, not a whole Parquet file, or lacking a column of `schema`."""
    record = lookups.file_record(info, name)
    found = integrity.file_problem(folder, name, record, fix) or integrity.problem(folder, name, None, fix, schema)
    if found is not None:
        raise DamagedRun(found.line(folder))
    try:
        return pd.read_parquet(folder / name, columns=schema.names)
    except (pa.ArrowException, OSError, ValueError) as error:
        raise DamagedRun(f"{folder / name} is damaged (it cannot be read: {one_line(error)}): {fix}") from None


class LatentData:
    """The latents of the run `data` explores: their statistics, values' top tokens, trigger examples with
    per-token activations, and the dictionary itself when a page reads a value under another projection.

    Args:
        data: the explorer's data of a run indexed with a dictionary (`ffkv.store.lookups.has_latents`).
    """

    def __init__(self, data: "ExplorerData") -> None:
        self.data = data
        #: the human pattern labels of the latents (RUN/annotations/latent_labels.parquet), as the neurons' are kept
        self.annotations = Annotations(data.run.path, "latents")
        recorded = data.manifest.index.get("dictionary") or {}
        self.layout = MemoryLayout(data.n_layers, data.d_m,
                                   {int(layer): (str(d["kind"]), int(d["n_latents"])) for layer, d in recorded.items()})
        folder, info, run = data.folder, data.lookup_info, data.run.path
        fix = rewrite_command(run, "explorer/latent_stats.parquet", "lookups")
        stats = read_table(folder, "latent_stats.parquet", schemas.LATENT_STATS, info, fix)
        top = read_table(folder, "latent_value_top_tokens.parquet", schemas.VALUE_TOP_TOKENS, info, fix)
        self.stats = stats.astype({"layer": "int64", "key": "int64"}).set_index(["layer", "key"]).sort_index()
        k = int(top["rank"].max()) + 1 if len(top) else 0
        self.top_ids: dict[int, np.ndarray] = {}
        self.top_probs: dict[int, np.ndarray] = {}
        for layer, (_, n) in self.layout.latents.items():
            mine = top[top["layer"] == layer].sort_values(["key", "rank"])
            have = int((stats["layer"] == layer).sum())
            if have != n or len(mine) != n * k:
                raise DamagedRun(f"{folder / 'latent_stats.parquet'} is damaged (layer {layer + 1} has {have:,} "
                                 f"latents there and {len(mine) // max(k, 1):,} in latent_value_top_tokens.parquet; "
                                 f"the dictionary has {n:,}): {fix}")
            self.top_ids[layer] = mine["token_id"].to_numpy().reshape(n, k)
            self.top_probs[layer] = mine["prob"].to_numpy().reshape(n, k)
        self.coefficients = lookups.read_coefficients(
            folder, info, rewrite_command(run, f"explorer/{lookups.LATENT_COEFFICIENTS}", "lookups"), latents=True)
        self.described = info.get("latent_trigger_coefficients") or {}
        self._tables: dict[int, pd.DataFrame] = {}
        self._lock = threading.Lock()  # the layer tables' cache
        self._studies: dict[str, pd.DataFrame | None] = {}  # the latent studies' per-latent tables, read once
        self._reopen_lock = threading.Lock()
        self._memories_error: str | None = None  # why the dictionary could not be read again (`memories`)

    # ------------------------------------------------------------------ addresses
    @property
    def layers(self) -> list[int]:
        """The layers (from 0) that have a dictionary."""
        return sorted(self.layout.latents)

    def name(self, layer: int) -> str:
        """A dictionary's name as addresses write it: ``t4`` (a transcoder at layer 4, counted from 1)."""
        return f"{LATENT_PREFIX[self.layout.latents[layer][0]]}{layer + 1}"

    def size(self, layer: int) -> int:
        """How many latents the dictionary of `layer` (from 0) has."""
        return self.layout.latents[layer][1]

    def kind(self, layer: int) -> str:
        """"transcoder" or "sae"."""
        return self.layout.latents[layer][0]

    def check(self, address: str) -> LatentRef:
        """The latent an address names (``t4:42``), or a 404 that says which latents exist."""
        try:
            found = self.layout.parse(address)
        except FfkvError as exc:
            raise BadRequest(str(exc), 404) from None
        if isinstance(found, MemoryRef):
            raise BadRequest(f"{quoted(address)} names a neuron: its page is /memory/{found.layer + 1}/{found.key}", 404)
        return found

    def check_layer(self, text: str) -> int:
        """The layer (from 0) of a dictionary named as addresses write it (``t4``), or a 404 naming those there
        are."""
        text = str(text).strip()
        have = ", ".join(self.name(layer) for layer in self.layers)
        kind = latent_kind(text)
        try:
            layer = whole_number(text[1:], "a dictionary's LAYER must be an integer") - 1
        except FfkvError:
            layer = None
        if kind is None or layer not in self.layout.latents or self.kind(layer) != kind:
            raise BadRequest(f"no dictionary {quoted(text, 20)} in this run: it has {have} (layers from 1)", 404)
        return layer

    # ------------------------------------------------------------------ dictionary
    def memories(self) -> "Latents | None":
        """The run's dictionary as `ffkv.memories.sets.Latents`, read again from its files and checked to be the
        ones indexed (once); None when it cannot be (moved or changed: `memories_error` says why)."""
        with self._reopen_lock:
            if self._memories_error is None:
                try:
                    return self.data.dictionary()  # the reading the lookups' build made, where it ran here
                except FfkvError as exc:
                    self._memories_error = str(exc)
            return None

    @property
    def memories_error(self) -> str | None:
        """Why the dictionary could not be read again (None when it was, or before `memories`)."""
        return self._memories_error

    # ------------------------------------------------------------------ tables
    def triggers(self, layer: int, key: int) -> pd.DataFrame:
        """A latent's trigger examples with their example's token ids and text, strongest first (``direction``:
        +1 for every row: a latent's activation is never negative)."""
        trig = self.data._query(
            "SELECT CAST(1 AS TINYINT) AS direction, t.rank, t.coefficient, t.example_id, t.position, "
            "t.next_token_id, t.m_offset, t.m_start, t.m_length, x.token_ids, x.text FROM latent_triggers t "
            "JOIN texts x USING (example_id) WHERE t.layer = ? AND t.key = ? ORDER BY t.rank", [layer, key])
        return trig

    def value_top(self, layer: int, key: int) -> list[tuple[int, float]]:
        """A decoder row's top tokens under the identity projection, from the lookup table: (token id, p)."""
        return [(int(t), float(p)) for t, p in zip(self.top_ids[layer][key], self.top_probs[layer][key])]

    def latent(self, ref: LatentRef, projection: str | None = None, shown: str = "p",
               n_tokens: int = VALUE_TOKENS) -> dict:
        """Everything a latent's page shows: statistics, value tokens under `projection` read as `shown`
        (`ffkv.explorer.live.check_reading`), the activation histogram, the trigger examples with per-token
        activations (stored: no model runs; computed here where the build stored none, None without the model or
        the dictionary) and their next tokens."""
        from ffkv.explorer import live
        from ffkv.explorer.data import CENSUS_COLUMNS, stored_context

        projection = projection or live.default_reading(self.data.loaded)
        try:
            live.check_reading(projection, shown)
        except FfkvError as exc:
            raise BadRequest(str(exc), 422) from None
        data, layer, key = self.data, ref.layer, ref.latent
        trig = self.triggers(layer, key)
        token_lists = [[int(t) for t in ids] for ids in trig["token_ids"]]
        stored = stored_context(self.coefficients, trig)
        per_token = stored or [None] * len(token_lists)
        stats = self.stats.loc[(layer, key)].to_dict()
        target = None
        if len(trig):
            from ffkv.memories.targets import trigger_targets

            first = trig.iloc[0]
            t = int(trigger_targets(np.array([int(first["next_token_id"])]),
                                    np.array([int(first["token_ids"][int(first["position"])])]), data.encoder)[0])
            target = t if t >= 0 else None
        memories = self.memories() if getattr(data.loaded, "view", None) is not None else None
        if memories is None:  # no model, or a dictionary gone or changed: the stored identity top tokens
            value = {"shown": "p", "top": self.value_top(layer, key), "bottom": [], "top_value": None,
                     "target_rank": None}
            projection, shown = "identity", "p"
        else:
            with data.model.lock:
                value = live.value_tokens(data.loaded, layer, key, projection, n_tokens, target, shown, memories)
                if stored is None and token_lists:  # a build that stored none (a small model's pages compute them)
                    per_token = data._context(layer, key, token_lists, latents=memories)
        scale, groups = data.shown_examples(trig, token_lists, per_token)
        examples = groups.get(1, [])
        next_counts = Counter(e["next_token_id"] for e in examples)
        last_counts = Counter(e["last"] for e in examples)
        common_last, n_last = last_counts.most_common(1)[0] if last_counts else ("", 0)
        return {
            "ref": ref, "address": str(ref), "layer": layer, "key": key, "kind": ref.kind, "name": self.name(layer),
            "n_latents": self.size(layer), "stats": stats, "projection": projection, "examples": examples,
            "value": {"shown": value["shown"], "top_value": value.get("top_value"),
                      "target_rank": value.get("target_rank"), "top_p": value.get("top_p"),
                      "entropy_share": value.get("entropy_share"), "uniform": value.get("uniform"),
                      "top": [{"token_id": t, "token": data.token(t), "value": v} for t, v in value["top"]],
                      "bottom": [{"token_id": t, "token": data.token(t), "value": v} for t, v in value["bottom"]]},
            "dictionary_error": self.memories_error, "human": self.annotations.of(layer, key),
            "histogram": {"counts": [int(c) for c in stats.get("activation_histogram", [])],
                          "lo": float(stats.get("activation_lo", 0.0)), "hi": float(stats.get("activation_hi", 0.0)),
                          "positions": int(self.described.get("sample_positions", 0)),
                          "examples": int(data.lookup_info.get("activation_sample", {}).get("examples", 0))},
            "next_tokens": [{"token_id": t, "token": data.token(t), "count": c} for t, c in next_counts.most_common(10)],
            "surface": {"token": common_last, "share": n_last / len(examples) if examples else 0.0},
            # [before, after]: the tokens around each trigger whose activations the build stored, where it stored a
            # window rather than whole examples; None otherwise
            "coefficient_scale": scale, "window": self.described.get("window") if stored else None,
            # how many of the strongest examples have stored activations, where the build stored those ranks' only
            "stored_ranks": self.described.get("ranks") if stored else None,
            # per-token activations shown for these rows, stored or computed (else the trigger's alone)
            "shaded": any(a is not None for a in per_token),
            "dead": not len(trig),
            # `ffkv explain --latents`, `ffkv score`: the latent's own (never its control's), as a neuron's are read
            "explanations": data.explanations_of(layer, key, kind="latent"),
            # the latent studies' own rows (`ffkv analyze`: patterns_latents_keys, census_latents_keys), as a neuron
            # page reads its key's: its automatic pattern label and its census line
            "auto": self._studied(PATTERNS_LATENTS, PATTERN_COLUMNS, layer, key),
            "census": self._studied(CENSUS_LATENTS, CENSUS_COLUMNS, layer, key),
        }

    def _studied(self, name: str, columns: Mapping[str, str], layer: int, key: int) -> dict | None:
        """A latent's row of a latent study's per-latent table (read once, checked), or None before it ran."""
        with self._lock:
            if name not in self._studies:
                self._studies[name] = self.data.per_memory(name, columns)
        table = self._studies[name]
        if table is None or (layer, key) not in table.index:
            return None
        return {c: v.item() if hasattr(v, "item") else v for c, v in table.loc[(layer, key)].items()}

    def layer_table(self, layer: int) -> pd.DataFrame:
        """One row per latent of a layer (from 0): the latent layer page's columns (statistics, the value's top
        three tokens, the trigger prefixes' common last token; ``explanation`` and ``explanation_score`` where
        `ffkv explain --latents` ran, as `ExplorerData.explanation_columns` reads a neuron's). Built once per layer."""
        with self._lock:
            table = self._tables.get(layer)
        if table is None:
            table = self.stats.loc[layer].reset_index()
            table["top_tokens"] = self.data.tokens_of(self.top_ids[layer][table["key"].to_numpy(), :3]).tolist()
            table["top_token"] = [t[0] if t else "" for t in table["top_tokens"]]
            common = table["common_last_token_id"].to_numpy()
            table["common_last_token"] = np.where(common >= 0, self.data.tokens_of(common), "")
            table["dead"] = table["n_triggers"] == 0
            table = table.drop(columns=["activation_histogram"])
            explained = self.data.explanation_columns(layer, kind="latent")
            if len(explained):
                table = table.merge(explained, on="key", how="left")
            with self._lock:
                self._tables[layer] = table
        return table

    def summary(self) -> list[dict]:
        """Per dictionary: its layer (from 0), name, kind, latents, the dead (never fired over the index), the
        mean share of sample positions where a latent is active, and the agreement rate of its values."""
        out = []
        for layer in self.layers:
            s = self.stats.loc[layer]
            out.append({"layer": layer, "name": self.name(layer), "kind": self.kind(layer), "latents": self.size(layer),
                        "dead": int((s["n_triggers"] == 0).sum()),
                        "active": float(s["activation_frequency"].mean()) if len(s) else 0.0,
                        # of the latents with a top-1 trigger target, as Figure 4 and values_latents count
                        "agreement": float(s["agreement"].sum() / max(1, int((s["next_token_rank"] >= 0).sum())))})
        return out

    # ------------------------------------------------------------------ search
    def promoting(self, token_ids: list[int], limit: int = 50) -> list[dict]:
        """Latents whose value ranks one of `token_ids` among its stored top tokens (identity projection), best
        rank first, then the most probable: address, layer, key, rank, prob, token, the value's top token."""
        rows = []
        for layer in self.layers:
            ids, probs = self.top_ids[layer], self.top_probs[layer]
            for token_id in token_ids:
                keys, ranks = np.nonzero(ids == token_id)
                rows += [(int(r), -float(probs[k, r]), layer, int(k), token_id) for k, r in zip(keys, ranks)]
        rows.sort()
        return [{"address": str(LatentRef(layer, key, self.kind(layer))), "layer": layer, "key": key, "rank": r,
                 "prob": -p, "token_id": t, "token": self.data.token(t),
                 "top_token": self.data.token(int(self.top_ids[layer][key, 0]))} for r, p, layer, key, t in rows[:limit]]

    def of_examples(self, example_ids: list[int], chips: int = 50) -> dict[int, tuple[list[dict], int]]:
        """Per example id: the latents it is a trigger example of, strongest first (at most `chips`), and how many
        there are."""
        if not example_ids:
            return {}
        trig = self.data._query(
            "SELECT example_id, layer, key, rank, coefficient, position, last_token_id, "
            "count(*) OVER (PARTITION BY example_id) AS n, "
            "row_number() OVER (PARTITION BY example_id ORDER BY coefficient DESC, layer, key) AS place "
            f"FROM latent_triggers_by_example WHERE example_id IN ({','.join('?' * len(example_ids))}) "
            "QUALIFY place <= ? ORDER BY example_id, place", [*example_ids, chips])
        out: dict[int, tuple[list[dict], int]] = {}
        columns = ("example_id", "layer", "key", "rank", "coefficient", "position", "last_token_id", "n")
        for e, layer, key, rank, coefficient, position, last, n in zip(*(trig[c].tolist() for c in columns)):
            found, _ = out.get(e, ([], 0))
            found.append({"address": str(LatentRef(int(layer), int(key), self.kind(int(layer)))), "layer": int(layer),
                          "key": int(key), "rank": int(rank), "coefficient": float(coefficient), "direction": 1,
                          "latent": True, "position": int(position), "token": self.data.token(int(last))})
            out[e] = (found, int(n))
        return out


__all__ = ["VALUE_TOKENS", "LatentData", "read_table"]
