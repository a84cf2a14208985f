"""What the explorer reads from a run directory, and how it finds it fast.

The lookup tables in RUN/explorer/ (`ffkv.store.lookups`) are built by `ffkv analyze`; a run
that was only indexed gets them on the explorer's first start (into RUN/explorer, or a
temporary folder when the run directory is read-only). Pages then answer from DuckDB point
queries and small in-memory arrays: a memory page reads ~t rows.

Layers and keys are 0-based here, as in every table of the run; the pages show layers
counted from 1 (`ffkv.presentation.style.layer_number`).
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from ffkv.errors import FfkvError
from ffkv.experiments.registry import key_columns
from ffkv.explorer.latents import LatentData
from ffkv.explorer.model import ModelHandle
from ffkv.explorer.validation import BadRequest, integer, layer_key
from ffkv.memories.address import LatentRef, whole_number
from ffkv.memories.sets import Latents, refuse_unused_dictionary
from ffkv.memories.translators import RUN_FILE as TRANSLATORS_FILE
from ffkv.store import lookups
from ffkv.store.annotations import Annotations
from ffkv.store.database import EXPLORER_TABLES, LATENT_TABLES, open_database
from ffkv.store.integrity import rewrite_command
from ffkv.store.run import RunDir
from ffkv.store.schemas import Direction

#: The per-key table of `ffkv analyze` whose label, description and scores the pages show.
PATTERN_KEYS = "patterns_keys"
#: Columns of patterns_keys the pages show (the rest stay in the table), in this order.
PATTERN_COLUMNS = ("label", "description", "shallow_score", "shallow_score_2", "shallow_score_3",
                   "shared_suffix_text", "semantic_score", "semantic_z", "semantic_cutoff", "mean_pairwise_cosine",
                   "n_triggers", "n_embedded", "dead")
#: The census of `ffkv analyze --only census` (metrics/census.parquet): its columns the pages show, renamed.
CENSUS_KEYS = "census"
CENSUS_COLUMNS = {"class": "census_class", "value_type": "census_value_type", "eraser": "census_eraser",
                  "rule": "census_rule", "rule_f1": "census_rule_f1", "position_eta2": "census_position_eta2",
                  "firing_sign": "census_firing_sign", "two_way": "census_two_way"}
#: Memories whose per-token coefficients over their trigger examples are kept (256 x 100 examples x
#: 128 tokens of float32: 13 MB).
CONTEXT_CACHE = 256
#: Tokens of a trigger example a memory page shows before and after the trigger position: an example longer than
#: the window (a WikiText line of hundreds of tokens) is cut to it, with a mark for what is left out, so that a page
#: of 40 examples stays small (the example's whole text is in its JSON); a shorter one is shown whole.
SHOWN_BEFORE, SHOWN_AFTER = 48, 16
#: The mark of tokens left out of a shown example.
GAP = {"text": "…", "m": None, "shade": 0.0, "trigger": False, "next": False, "after": False, "gap": True}
#: Trigger directions (`direction` of trigger_examples.parquet, format 3): largest m, most negative m.
DIRECTIONS = {Direction.POSITIVE: "largest coefficients", Direction.NEGATIVE: "most negative coefficients"}


def stored_context(coefficients: np.ndarray | None, trig: pd.DataFrame) -> list | None:
    """The per-token coefficients of trigger rows (``m_offset``, ``m_start``, ``m_length``, ``token_ids``) as the
    build stored them in the flat array `coefficients`, each as long as its example (NaN outside the stored window,
    `ffkv.experiments.trigger_contexts.window_for`, and in every token of a row it did not locate, beyond the ranks
    an index of more than `trigger_contexts.MAX_ROWS` rows stores: `trigger_contexts.located_ranks`), or None when
    the build stored no coefficients (then the explorer computes them)."""
    if coefficients is None:
        return None
    out = []
    for offset, start, n, ids in zip(trig["m_offset"], trig["m_start"], trig["m_length"], trig["token_ids"]):
        full = np.full(len(ids), np.nan, dtype=np.float32)
        if not pd.isna(offset):
            full[int(start):int(start) + int(n)] = coefficients[int(offset):int(offset) + int(n)]
        out.append(full)
    return out


class ExplorerData:
    """The run as the explorer's pages need it.

    Args:
        run_dir: a complete run directory.
        loaded: the run's model, a `ModelHandle`, or None to load it in the background.
        progress: print a line per preparation step (a first start on a run `ffkv analyze` has not prepared).
        dictionary_at: where the sparse dictionary the run was indexed with lies now, if its files moved
            (`ffkv.dictionaries.reopen`); default: where the run records it.
    """

    def __init__(self, run_dir: str | Path, loaded: Any = None, progress: bool = False,
                 dictionary_at: str | Path | None = None) -> None:
        self.run = RunDir(run_dir)
        self.dictionary_at = dictionary_at
        self.manifest = self.run.require_complete()
        refuse_unused_dictionary(self.manifest.index.get("dictionary"), dictionary_at, self.run.path)
        model = self.manifest.model
        self.n_layers, self.d_m, self.vocab_size = model.n_layers, model.d_m, model.vocab_size
        self.encoder = model.encoder
        self.model = loaded if isinstance(loaded, ModelHandle) else ModelHandle(self.run.path, loaded)
        self.progress = progress
        self.reopened: Latents | None = None  # the run's dictionary, once read (`dictionary`)
        self.folder = lookups.find(self.run, self.manifest) or self._build()
        self.lookup_info = lookups.read_info(self.folder)
        has_latents = lookups.has_latents(self.run, self.manifest)
        self._db = open_database(self.folder / "explorer.duckdb",
                                 rewrite_command(self.run.path, "explorer/explorer.duckdb", "lookups"),
                                 {**EXPLORER_TABLES, **(LATENT_TABLES if has_latents else {})})
        self._db_lock = threading.Lock()
        stats = pd.read_parquet(self.folder / "key_stats.parquet")
        self.key_stats = stats.set_index(["layer", "key"]).sort_index()
        top = pd.read_parquet(self.folder / "value_top_tokens.parquet", columns=["token_id", "prob", "rank"])
        k = int(top["rank"].max()) + 1 if len(top) else 0
        self.top_ids = top["token_id"].to_numpy().reshape(self.n_layers, self.d_m, k)
        self.top_probs = top["prob"].to_numpy().reshape(self.n_layers, self.d_m, k)
        # Per-token coefficients of the trigger examples, stored by the build (None: computed when asked for); a file
        # that is not the one info.json records is refused here, naming it.
        fix = rewrite_command(self.run.path, f"explorer/{lookups.COEFFICIENTS}", "lookups")
        self.coefficients = lookups.read_coefficients(self.folder, self.lookup_info, fix)
        self.annotations = Annotations(self.run.path)
        # A run indexed with a sparse dictionary: its latents' pages (`ffkv.explorer.latents`); None without one.
        self.latents = LatentData(self) if has_latents else None
        self.key_metrics = self._load_key_metrics()
        self.census = self._load_census()
        self.explanations = self._load_explanations()
        self.experiment_columns = self._load_experiment_columns()
        self._tokens: list[str] | None = None
        self._token_array: np.ndarray | None = None
        self._summary: pd.DataFrame | None = None  # per-layer aggregates of the (fixed) lookup tables
        self._contexts: dict[tuple[bool, int, int], list] = {}  # guarded by model.lock, like the forward passes
        self._token_index: dict[str, list[int]] | None = None

    # ------------------------------------------------------------ preparation
    @property
    def loaded(self):
        """The run's model (waits for the background load)."""
        return self.model.get()

    @property
    def translators_file(self) -> Path:
        """Where the run keeps its fitted translators (`ffkv analyze --only translators`); it may not exist."""
        return self.run.path / TRANSLATORS_FILE

    def _build(self) -> Path:
        from ffkv.experiments.heldout import run_threshold
        from ffkv.experiments.lookups import build, refuse_damaged_sources

        refuse_damaged_sources(self.run, self.manifest)  # before anything is computed from them
        folder = lookups.writable_folder(self.run)
        if self.progress:
            analyses = self.manifest.analyses
            why = ("its lookup tables are missing or out of date (deleted, damaged, or built from another index)"
                   if "lookups" in analyses else "its analyses did not build the lookup tables" if analyses
                   else "this run was not analysed")
            print(f"ffkv serve: {why}; building the explorer's lookup tables in {folder} "
                  f"(`ffkv analyze {self.run.path} --only lookups` builds them ahead)", flush=True)
        threshold, source = run_threshold(self.run, self.manifest, self.loaded, progress=self.progress)
        return build(self.run, self.manifest, self.loaded, folder, threshold, progress=self.progress,
                     threshold_source=source, dictionary_at=self.dictionary_at,
                     latents=self.dictionary() if lookups.has_latents(self.run, self.manifest) else None)

    def dictionary(self) -> Latents:
        """The sparse dictionary the run was indexed with, read again from its files and checked to be the one indexed
        (`ffkv.memories.sets.Latents.of_run`), once: the lookups' build here and the latent pages share the reading
        (hashing a large dictionary's files takes long). Raises `FfkvError`, naming the file, where it cannot be."""
        if self.reopened is None:
            self.reopened = Latents.of_run(self.loaded.view, self.manifest.index.get("dictionary"),
                                           self.dictionary_at, self.run.path)
        return self.reopened

    def _load_key_metrics(self) -> pd.DataFrame | None:
        """The automatic pattern label, description and scores of every key (`ffkv analyze --only
        patterns`: metrics/patterns_keys.parquet), or None before that experiment ran."""
        if not self.run.has_metric(PATTERN_KEYS):
            return None
        table = self.run.read_metric(PATTERN_KEYS).astype({"layer": "int64", "key": "int64"})
        keep = [c for c in PATTERN_COLUMNS if c in table.columns]
        return table[["layer", "key", *keep]].set_index(["layer", "key"]).sort_index()

    def _load_census(self) -> pd.DataFrame | None:
        """Each key's census class, value type and detector rule (`ffkv analyze --only census`), or None."""
        return self.per_memory(CENSUS_KEYS, CENSUS_COLUMNS)

    def per_memory(self, name: str, columns: Mapping[str, str]) -> pd.DataFrame | None:
        """A study's per-memory table metrics/NAME (its record checked), its `columns` renamed as they map, indexed
        by (layer, key); None where the run holds no such table."""
        if not self.run.has_metric(name):
            return None
        table = self.run.read_metric(name, columns=["layer", "key", *columns])
        table = table.astype({"layer": "int64", "key": "int64"}).rename(columns=dict(columns))
        return table.set_index(["layer", "key"]).sort_index()

    def _load_experiment_columns(self) -> pd.DataFrame | None:
        """The per-key columns the registered experiments declare (`ffkv.experiments.registry.KeyColumn`), from
        whichever of their tables the run holds, indexed by (layer, key); None when it holds none."""
        joined = None
        for table in dict.fromkeys(c.table for c in key_columns()):
            if not self.run.has_metric(table):
                continue
            wanted = [c for c in key_columns() if c.table == table]
            t = self.run.read_metric(table, columns=["layer", "key", *(c.column for c in wanted)])
            t = t.astype({"layer": "int64", "key": "int64"}).rename(columns={c.column: c.name for c in wanted})
            t = t.set_index(["layer", "key"]).sort_index()
            joined = t if joined is None else joined.join(t, how="outer")
        return joined

    def _load_explanations(self) -> pd.DataFrame:
        """Every explained memory's explanations and scores (`ffkv explain`, `ffkv score`): the neurons' (kind
        "memory") and, for a run indexed with a dictionary, its latents' (kind "latent", `ffkv explain --latents`;
        never a control's), indexed by (kind, layer, key). A row naming a memory this run does not have (a layer
        without a dictionary, a latent past its size: a table written by hand) is left out: no page shows it."""
        from ffkv.experiments.explanations import memory_explanations

        tables = [memory_explanations(self.run).assign(kind="memory")]
        if self.latents is not None:
            tables.append(memory_explanations(self.run, kind="latent").assign(kind="latent"))
        table = pd.concat([t for t in tables if len(t)] or tables[:1], ignore_index=True)
        size = {"memory": {layer: self.d_m for layer in range(self.n_layers)},
                "latent": {layer: n for layer, (_, n) in self.latents.layout.latents.items()}
                if self.latents is not None else {}}
        exists = [0 <= key < size[kind].get(layer, 0)
                  for kind, layer, key in zip(table["kind"], table["layer"], table["key"])]
        table = table[np.array(exists, bool)]
        return table.set_index(["kind", "layer", "key"], drop=False).sort_index()

    def explanations_of(self, layer: int, key: int, kind: str = "memory") -> list[dict]:
        """A memory's explanations (one per direction and explainer), with score and shuffled baseline (None
        before `ffkv score`); `kind` "latent" for a dictionary's latent (`key` its index)."""
        if (kind, layer, key) not in self.explanations.index:
            return []
        rows = self.explanations.loc[[(kind, layer, key)]]
        return [{"direction": int(r.direction), "explanation": r.explanation, "explainer": r.explainer,
                 "score": None if pd.isna(r.score) else float(r.score),
                 "shuffled_score": None if pd.isna(r.shuffled_score) else float(r.shuffled_score),
                 "simulator": r.simulator if isinstance(r.simulator, str) else None} for r in rows.itertuples()]

    def explanation_columns(self, layer: int, kind: str = "memory") -> pd.DataFrame:
        """Per explained key of a layer (0-based; of its dictionary's latents for `kind` "latent"): ``explanation``,
        its explanations (a negative direction's marked "m < 0:"), and ``explanation_score``, the best simulation
        score among them (NaN before `ffkv score`)."""
        rows = self.explanations[(self.explanations["kind"] == kind) & (self.explanations["layer"] == layer)]
        if rows.empty:
            return pd.DataFrame(columns=["key", "explanation", "explanation_score"])
        text = [("m < 0: " if int(d) < 0 else "") + str(x) for d, x in zip(rows["direction"], rows["explanation"])]
        rows = rows.assign(text=text, score=pd.to_numeric(rows["score"], errors="coerce")).reset_index(drop=True)
        grouped = rows.groupby("key", sort=True)
        return pd.DataFrame({"explanation": grouped["text"].agg(" · ".join),
                             "explanation_score": grouped["score"].max()}).reset_index().astype({"key": "int64"})

    def explanation_search(self, text: str, limit: int = 50) -> list[dict]:
        """Memories (neurons, and a dictionary's latents) whose explanation has, for every word of `text` (split
        at spaces), a word starting with it (case-insensitive: "year" finds "years", "a" does not find "character",
        "$" finds "'$'"), best simulation score first (unscored last), then by layer and key: layer, key,
        direction, explanation, score, and a latent's ``address`` (``t4:42``; None for a neuron)."""
        words = (text or "").lower().split()
        if not words or self.explanations.empty:
            return []
        table = self.explanations.reset_index(drop=True)
        low = table["explanation"].astype(str).str.lower()
        keep = np.ones(len(low), bool)
        for word in words:
            keep &= low.str.contains(r"(?<!\w)" + re.escape(word), regex=True).to_numpy(bool)
        hits = table[keep].assign(score=lambda t: pd.to_numeric(t["score"], errors="coerce"),
                                  latent=lambda t: t["kind"] == "latent")
        hits = hits.sort_values(["score", "latent", "layer", "key"], ascending=[False, True, True, True],
                                na_position="last")
        return [{"layer": int(r.layer), "key": int(r.key), "direction": int(r.direction),
                 "explanation": str(r.explanation), "score": None if pd.isna(r.score) else float(r.score),
                 "address": str(LatentRef(int(r.layer), int(r.key), self.latents.kind(int(r.layer))))
                 if r.kind == "latent" else None}
                for r in hits.head(limit).itertuples()]

    def census_of(self, layer: int, key: int) -> dict | None:
        """The census row of a key (columns of `CENSUS_COLUMNS`' new names), or None before the census ran."""
        if self.census is None or (layer, key) not in self.census.index:
            return None
        return {c: v.item() if hasattr(v, "item") else v for c, v in self.census.loc[(layer, key)].items()}

    def warm(self) -> None:
        """Compute what a process's first memory page would otherwise wait for: the vocabulary's strings, the
        tables' first query, the model's first projection (`ffkv serve` runs it once the model is loaded)."""
        self.tokens()
        self.memory(0, 0, context=False)
        if self.latents is not None:  # the dictionary read again and checked, and its first value read
            first = self.latents.layers[0]
            self.latents.latent(self.latents.layout.check_latent(first, 0))

    # --------------------------------------------------------------- tokens
    def tokens(self) -> list[str]:
        """Readable string of every token id (computed once)."""
        if self._tokens is None:
            tok = self.loaded.tokenizer
            try:
                strings = list(tok.token_strings(list(range(self.vocab_size))))
            except Exception:  # noqa: BLE001 - ids past the tokenizer's own vocabulary (padded heads)
                strings = []
                for i in range(self.vocab_size):
                    try:
                        strings.append(tok.token_strings([i])[0])
                    except Exception:  # noqa: BLE001
                        strings.append(f"<{i}>")
            self._tokens = strings
        return self._tokens

    def tokens_of(self, token_ids: np.ndarray) -> np.ndarray:
        """`token` of every id of an array at once (an object array of the same shape)."""
        if self._token_array is None:
            self._token_array = np.array(self.tokens(), dtype=object)
        ids = np.asarray(token_ids, dtype=np.int64)
        inside = (ids >= 0) & (ids < len(self._token_array))
        out = self._token_array[np.where(inside, ids, 0)]
        if not inside.all():
            out[~inside] = [self.token(int(i)) for i in ids[~inside]]
        return out

    def token(self, token_id: int | None) -> str:
        if token_id is None or token_id < 0:
            return "⟨end⟩"
        strings = self.tokens()
        return strings[token_id] if token_id < len(strings) else f"<{token_id}>"

    def sequence(self, token_ids: list[int]) -> list[str]:
        """The tokens of one text as the reader sees them (`ffkv.models.token_display.sequence_strings`): joined,
        the text; a character split over byte tokens shown whole on the token that completes it."""
        from ffkv.models.token_display import sequence_strings

        return sequence_strings(self.loaded.tokenizer, token_ids)

    def token_ids_for(self, text: str) -> list[int]:
        """Ids of a token typed by a user: exact string, else the same string without surrounding spaces,
        or ``#123`` for id 123. An unknown token is a 404 that says so."""
        if text is None or text == "":
            raise BadRequest("type a token to search for", 422)
        if len(text) > 200:
            raise BadRequest("a token is at most 200 characters", 422)
        if text.startswith("#") and text[1:].isascii() and text[1:].isdigit():
            try:
                i = whole_number(text[1:], "a token id (#ID) must be an integer")
            except FfkvError as exc:
                raise BadRequest(str(exc), 404) from None
            if i >= self.vocab_size:
                raise BadRequest(f"token id {i} is not in the vocabulary (0 to {self.vocab_size - 1})", 404)
            return [i]
        if self._token_index is None:
            index: dict[str, list[int]] = {}
            for i, s in enumerate(self.tokens()):
                index.setdefault(s, []).append(i)
                if s.strip() != s:
                    index.setdefault("\0" + s.strip(), []).append(i)
            self._token_index = index
        found = self._token_index.get(text) or self._token_index.get("\0" + text.strip()) \
            or self._token_index.get(text.strip())
        if not found:
            raise BadRequest(f"{text!r} is not a token of this model's vocabulary "
                             "(search a single token, or #ID for a token id)", 404)
        return found

    # -------------------------------------------------------------- queries
    def _query(self, sql: str, params: list[Any] | None = None) -> pd.DataFrame:
        with self._db_lock:
            cursor = self._db.cursor()
        try:
            return cursor.execute(sql, params or []).df()
        finally:
            cursor.close()

    def check(self, layer, key) -> tuple[int, int]:
        """(layer index, key) from a layer counted from 1 and a key, as pages and URLs write them."""
        return layer_key(layer, key, self.n_layers, self.d_m)

    def value_top(self, layer: int, key: int) -> list[dict]:
        """A value's top tokens under the identity projection (the lookup table)."""
        return [{"token_id": int(t), "token": self.token(int(t)), "prob": float(p)}
                for t, p in zip(self.top_ids[layer, key], self.top_probs[layer, key])]

    def value_top_ids(self, layer: int, top: int) -> np.ndarray | None:
        """(d_m, top) token ids of each value's top tokens under the identity projection, best first, from the
        lookup table (no model weights needed); None when the table was built otherwise or holds fewer."""
        if self.lookup_info.get("projection") != "identity" or self.top_ids.shape[2] < top:
            return None
        return self.top_ids[layer, :, :top]

    def labels_of(self, layer: int, key: int) -> dict:
        """The automatic pattern label of `ffkv analyze` (if any) and the human labels of a key."""
        auto = {}
        if self.key_metrics is not None and (layer, key) in self.key_metrics.index:
            row = self.key_metrics.loc[(layer, key)]
            auto = {c: row[c] for c in self.key_metrics.columns if pd.notna(row[c]) and row[c] != ""}
        return {"auto": auto, "human": self.annotations.of(layer, key)}

    def triggers(self, layer: int, key: int) -> pd.DataFrame:
        """The trigger examples of a key, with their example's token ids and text, strongest first per direction."""
        trig = self._query("SELECT t.direction, t.rank, t.coefficient, t.example_id, t.position, t.next_token_id, "
                           "t.m_offset, t.m_start, t.m_length, x.token_ids, x.text FROM triggers t "
                           "JOIN texts x USING (example_id) "
                           "WHERE t.layer = ? AND t.key = ? ORDER BY t.direction DESC, t.rank", [layer, key])
        return trig

    def _top1_target(self, trig: pd.DataFrame) -> int | None:
        """The trigger target of a key's top-1 trigger example (`ffkv.memories.targets`), None when it has none."""
        from ffkv.memories.targets import trigger_targets

        first = trig[(trig["direction"] == 1) & (trig["rank"] == 0)]
        if first.empty:
            return None
        row = first.iloc[0]
        last = int(row["token_ids"][int(row["position"])])
        target = int(trigger_targets(np.array([int(row["next_token_id"])]), np.array([last]), self.encoder)[0])
        return target if target >= 0 else None

    def _stored_context(self, trig: pd.DataFrame) -> list | None:
        """The per-token coefficients of a key's trigger examples as the build stored them (`stored_context`)."""
        return stored_context(self.coefficients, trig)

    def _context(self, layer: int, key: int, token_lists: list[list[int]], latents=None) -> list:
        """`live.context_coefficients` of a key's trigger examples (with `latents`, `ffkv.memories.sets.Latents`:
        `live.latent_context` of latent `key`), kept for the last `CONTEXT_CACHE` memories (a reader switching the
        projection, or coming back to a memory, costs no second forward pass)."""
        from ffkv.explorer import live

        address = (latents is not None, layer, key)
        cached = self._contexts.pop(address, None)
        if cached is None:
            cached = live.context_coefficients(self.loaded, layer, key, token_lists) if latents is None else \
                live.latent_context(self.loaded, latents, layer, key, token_lists)
        self._contexts[address] = cached  # most recent last
        while len(self._contexts) > CONTEXT_CACHE:
            self._contexts.pop(next(iter(self._contexts)))
        return cached

    def memory(self, layer: int, key: int, projection: str | None = None, n_tokens: int = 15,
               context: bool = True, shown: str = "p") -> dict:
        """Everything the memory page shows about key `key` of layer index `layer`.

        Args:
            projection, shown: how the value is read (`ffkv.explorer.live.check_reading`): a projection of
                ffkv's vocabulary (None: the one the model reads its layers' outputs through,
                `ffkv.memories.projection.reading_projection`), its tokens' probabilities ("p") or logits ("logit").
            n_tokens: top and bottom tokens of the value.
            context: compute m_i over each trigger example's whole context (runs the model).
        """
        from ffkv.explorer import live

        layer = integer(layer, "layer index", 0, self.n_layers - 1)
        key = integer(key, "key", 0, self.d_m - 1)
        projection = projection or live.default_reading(self.loaded)
        try:
            live.check_reading(projection, shown)
        except FfkvError as exc:
            raise BadRequest(str(exc), 422) from None
        trig = self.triggers(layer, key)
        token_lists = [[int(t) for t in ids] for ids in trig["token_ids"]]
        loaded = self.loaded
        stored = self._stored_context(trig) if context else None
        per_token: list = stored or [None] * len(token_lists)
        described = (self.lookup_info.get("trigger_coefficients") or {}) if stored else {}  # the build's record
        if getattr(loaded, "view", None) is None:  # a tokenizer without a model: the stored identity top tokens
            value = {"shown": "p", "top": [(t["token_id"], t["prob"]) for t in self.value_top(layer, key)],
                     "bottom": []}
            projection = "identity"
        else:
            with self.model.lock:
                value = live.value_tokens(loaded, layer, key, projection, n_tokens, self._top1_target(trig), shown)
                if context and stored is None:
                    per_token = self._context(layer, key, token_lists)
        scale, groups = self.shown_examples(trig, token_lists, per_token)
        positive = groups.get(1, [])
        stats = self.key_stats.loc[(layer, key)].to_dict()
        next_counts = Counter(e["next_token_id"] for e in positive)
        last_counts = Counter(e["last"] for e in positive)
        common_last, n_last = (last_counts.most_common(1)[0] if last_counts else ("", 0))
        labels = self.labels_of(layer, key)
        info = self.lookup_info.get("activation_sample", {})
        return {
            "layer": layer, "key": key, "stats": stats, "projection": projection,
            "triggers": [{"direction": d, "title": DIRECTIONS.get(d, str(d)), "examples": groups[d]}
                         for d in sorted(groups, reverse=True)],
            "examples": positive,
            "top_token": self.token(int(stats["top_token_id"])),
            "value": {"shown": value["shown"], "top_value": value.get("top_value"),
                      "target_rank": value.get("target_rank"), "top_p": value.get("top_p"),
                      "entropy_share": value.get("entropy_share"), "uniform": value.get("uniform"),
                      "top": [{"token_id": t, "token": self.token(t), "value": v} for t, v in value["top"]],
                      "bottom": [{"token_id": t, "token": self.token(t), "value": v} for t, v in value["bottom"]]},
            "histogram": {"counts": [int(c) for c in stats.get("activation_histogram", [])],
                          "lo": float(stats.get("activation_lo", 0.0)), "hi": float(stats.get("activation_hi", 0.0)),
                          "positions": int(info.get("positions", 0)), "examples": int(info.get("examples", 0))},
            "next_tokens": [{"token_id": t, "token": self.token(t), "count": c} for t, c in next_counts.most_common(10)],
            "surface": {"token": common_last, "share": n_last / len(positive) if positive else 0.0},
            "auto": labels["auto"], "human": labels["human"], "coefficient_scale": scale,
            # [before, after]: the tokens around each trigger whose coefficients the build stored, where it stored a
            # window rather than whole examples (`ffkv.experiments.trigger_contexts.window_for`); None otherwise.
            "window": described.get("window"),
            # How many of each direction's strongest examples have stored coefficients, where the build stored them
            # for those ranks only (`ffkv.experiments.trigger_contexts.located_ranks`); None: every example's.
            "stored_ranks": described.get("ranks"),
            "census": self.census_of(layer, key),
            "explanations": self.explanations_of(layer, key),
            # Never active over the indexed corpus (`ffkv.experiments.dead`): its rows are not trigger examples.
            "dead": labels["auto"].get("label") == "dead",
        }

    def shown_examples(self, trig: pd.DataFrame, token_lists: list[list[int]], per_token: list
                       ) -> tuple[float, dict[int, list[dict]]]:
        """A memory's (or a latent's) trigger examples as its page shows them: each cut to the window around its
        trigger (`SHOWN_BEFORE`, `SHOWN_AFTER`), its tokens shaded by their coefficient over the largest |m| of
        them all. Returns (that largest |m|, direction -> the examples in rank order).

        Args:
            trig: the trigger rows (``direction``, ``rank``, ``coefficient``, ``example_id``, ``position``,
                ``next_token_id``, ``text``), strongest first per direction.
            token_lists: each row's example's token ids.
            per_token: each row's per-token coefficients (NaN where none was stored), or None for a row without.
        """
        scale = max([float(np.nanmax(np.abs(c), initial=0.0)) for c in per_token if c is not None and len(c)]
                    + [float(trig["coefficient"].abs().max()) if len(trig) else 0.0]) or 1.0
        groups: dict[int, list[dict]] = {}
        for row, ids, coefficients in zip(trig.itertuples(index=False), token_lists, per_token):
            pos = int(row.position)
            tokens = []
            first, last = max(0, pos - SHOWN_BEFORE), min(len(ids), pos + SHOWN_AFTER + 1)
            if len(ids) <= SHOWN_BEFORE + SHOWN_AFTER + 1:  # a short example is shown whole
                first, last = 0, len(ids)
            texts = self.sequence(ids)
            for j in range(first, last):
                # The trigger position's coefficient is the index's own (stored coefficients are float16).
                m = None if coefficients is None else float(row.coefficient) if j == pos else float(coefficients[j])
                outside = m is not None and math.isnan(m)  # outside the stored window: no coefficient, marked so
                m = None if outside else m
                tokens.append({"text": texts[j], "m": m, "shade": 0.0 if m is None else m / scale,
                               "trigger": j == pos, "next": j == pos + 1, "after": j > pos, "outside": outside})
            if first > 0:
                tokens.insert(0, {**GAP, "omitted": first})
            if last < len(ids):
                tokens.append({**GAP, "after": True, "omitted": len(ids) - last})
            groups.setdefault(int(row.direction), []).append({
                "rank": int(row.rank), "coefficient": float(row.coefficient), "direction": int(row.direction),
                "bar": 100.0 * abs(float(row.coefficient)) / scale,
                "example_id": int(row.example_id), "position": pos, "tokens": tokens, "first": first,
                "next_token_id": int(row.next_token_id), "next": self.token(int(row.next_token_id)),
                "last": self.token(ids[pos]), "text": row.text,
            })
        return scale, groups

    def layer_keys(self, layer: int) -> pd.DataFrame:
        """One row per key of a layer: the layer page's columns (statistics, automatic and human labels)."""
        table = self.key_stats.loc[layer].reset_index()
        table["top_tokens"] = self.tokens_of(self.top_ids[layer, table["key"].to_numpy(), :3]).tolist()
        table = table.merge(self.strongest(layer), on="key", how="left")
        if self.key_metrics is not None and layer in self.key_metrics.index.get_level_values(0):
            table = table.join(self.key_metrics.xs(layer, level="layer"), on="key")
        if self.census is not None and layer in self.census.index.get_level_values(0):
            table = table.join(self.census.xs(layer, level="layer"), on="key")
            # What a detector detects: its rule, where the census calls the key a detector.
            table["census_detects"] = table["census_rule"].where(table["census_class"] == "detector", "")
        if self.experiment_columns is not None and layer in self.experiment_columns.index.get_level_values(0):
            table = table.join(self.experiment_columns.xs(layer, level="layer"), on="key")
        explained = self.explanation_columns(layer)
        if len(explained):
            table = table.merge(explained, on="key", how="left")
        human = self.annotations.all()
        human = human[human.layer == layer].sort_values("time").drop_duplicates("key", keep="last")
        return table.merge(human[["key", "label", "description"]].rename(
            columns={"label": "human_label", "description": "human_description"}), on="key", how="left")

    def strongest(self, layer: int) -> pd.DataFrame:
        """Per key of a layer (0-based): ``top_coefficient``, its largest m over the index (its rank-1 trigger
        example), and, where the index kept the most negative ones (``--sign both``), ``negative_strength``: -m of
        its most negative trigger example, 0 when even that one is positive."""
        # NULL where the index kept no m < 0 (DuckDB's greatest() would read that NULL as 0: a column of zeros).
        table = self._query("SELECT key, max(coefficient) FILTER (WHERE direction = 1) AS top_coefficient, "
                            "-min(coefficient) FILTER (WHERE direction = -1) AS negative_strength "
                            "FROM triggers WHERE layer = ? AND rank = 0 GROUP BY key", [layer])
        if table["negative_strength"].isna().all():
            table = table.drop(columns="negative_strength")
        else:
            table["negative_strength"] = table["negative_strength"].clip(lower=0)
        return table.astype({"key": "int64"})

    def layer_summary(self) -> pd.DataFrame:
        """Per layer (0-based `layer`): key statistics, shares of automatic labels, annotated keys."""
        if self._summary is None:  # the lookup and metrics tables do not change while the explorer runs
            stats = self.key_stats.reset_index()
            stats["with_target"] = stats["next_token_rank"] >= 0  # the keys Figure 4 judges: a top-1 trigger target
            summary = stats.groupby("layer").agg(
                keys=("key", "size"), keys_with_target=("with_target", "sum"),
                agreement_rate=("agreement", "sum"), mean_activation_frequency=("activation_frequency", "mean"),
            ).reset_index()
            summary["agreement_rate"] = summary["agreement_rate"] / summary["keys_with_target"].clip(lower=1)
            if self.key_metrics is not None and "label" in self.key_metrics.columns:
                shares = self.key_metrics["label"].groupby(level="layer").value_counts(normalize=True).unstack(
                    fill_value=0)
                for label in ("shallow", "semantic", "both", "none"):
                    summary[f"share_{label}"] = [float(shares[label].get(layer, 0)) if label in shares else 0.0
                                                 for layer in summary["layer"]]
            self._summary = summary
        summary = self._summary.copy()
        human = self.annotations.all()
        counts = human.groupby("layer")["key"].nunique() if len(human) else pd.Series(dtype=int)
        summary["annotated_keys"] = [int(counts.get(layer, 0)) for layer in summary["layer"]]
        return summary

    def promoting(self, text: str, limit: int = 50, page: int = 1) -> dict:
        """Memories whose value ranks the token highest: exact ranks from the top-token table, `limit` a page (page
        `page` of them), then, on the last page, past them, the keys giving the token the most probability.
        ``n_ranked`` counts the memories that rank it among their top tokens, ``n_top`` those whose top it is."""
        ids = self.token_ids_for(text)
        rows = []
        for token_id in ids:
            layers, keys, ranks = np.nonzero(self.top_ids == token_id)
            for layer, key, rank in zip(layers, keys, ranks):
                rows.append((int(rank), -float(self.top_probs[layer, key, rank]), int(layer), int(key), token_id))
        rows.sort()
        n_pages = max(1, -(-len(rows) // limit))
        page = integer(page, "page", 1, n_pages, 422)
        found = [{"rank": r, "prob": -p, "layer": layer, "key": key, "token_id": t, "token": self.token(t),
                  "top_token": self.token(int(self.top_ids[layer, key, 0]))}
                 for r, p, layer, key, t in rows[(page - 1) * limit:page * limit]]
        more = self._most_probable(ids[0], limit) if len(found) < limit else []
        seen = {(f["layer"], f["key"]) for f in found}
        for item in more:
            if len(found) >= limit:
                break
            if (item["layer"], item["key"]) not in seen:
                found.append(item)
        return {"token_ids": ids, "token": self.token(ids[0]), "results": found,
                "top_tokens": int(self.top_ids.shape[2]), "n_ranked": len(rows),
                "n_top": sum(1 for r in rows if r[0] == 0), "page": page, "n_pages": n_pages}

    def _most_probable(self, token_id: int, limit: int) -> list[dict]:
        """Keys with the highest p_i(token) = exp(v_i·E_x - logsumexp_i), from the model's weights."""
        view = getattr(self.loaded, "view", None)
        if view is None:
            return []
        import torch

        with torch.no_grad():
            e = view.unembedding[token_id].float()
            lse = torch.tensor(self.key_stats["logsumexp"].to_numpy()).view(self.n_layers, self.d_m)
            logp = torch.stack([view.values(layer).float() @ e for layer in range(self.n_layers)]).cpu() - lse
        flat = logp.flatten().topk(min(limit, logp.numel()))
        out = []
        for value, index in zip(flat.values.tolist(), flat.indices.tolist()):
            layer, key = divmod(index, self.d_m)
            out.append({"rank": None, "prob": float(np.exp(value)), "layer": layer, "key": key, "token_id": token_id,
                        "token": self.token(token_id), "top_token": self.token(int(self.top_ids[layer, key, 0]))})
        return out

    def text_search(self, text: str, limit: int = 50, chips: int = 50, page: int = 1) -> list[dict]:
        """Trigger examples whose text contains `text` (case-insensitive), `limit` a page (page `page`, in example
        order; `text_matches` counts them all), each with the memories it triggers, strongest coefficient first (at
        most `chips` of them; `n_memories` counts all), each with the position and token it fired on."""
        pattern = self._text_pattern(text)
        hits = self._query("SELECT example_id, text FROM texts WHERE text ILIKE ? ESCAPE '\\' "
                           "ORDER BY example_id LIMIT ? OFFSET ?", [pattern, limit, (max(1, int(page)) - 1) * limit])
        if hits.empty:
            return []
        ids = [int(i) for i in hits["example_id"]]
        trig = self._query(
            "SELECT example_id, layer, key, direction, rank, coefficient, position, last_token_id, "
            "count(*) OVER (PARTITION BY example_id) AS n, "
            "row_number() OVER (PARTITION BY example_id ORDER BY abs(coefficient) DESC, layer, key) AS place "
            f"FROM triggers_by_example WHERE example_id IN ({','.join('?' * len(ids))}) QUALIFY place <= ? "
            "ORDER BY example_id, place", [*ids, chips])
        memories: dict[int, list[dict]] = {}
        counts: dict[int, int] = {}
        columns = ("example_id", "layer", "key", "rank", "direction", "coefficient", "position", "last_token_id", "n")
        for e, layer, key, rank, direction, coefficient, position, last, n in zip(*(trig[c].tolist() for c in columns)):
            memories.setdefault(e, []).append({"layer": layer, "key": key, "rank": rank, "direction": direction,
                                               "coefficient": coefficient, "position": position,
                                               "token": self.token(int(last))})
            counts[e] = n
        return [{"example_id": e, "text": text, "memories": memories.get(e, []), "n_memories": counts.get(e, 0)}
                for e, text in zip(hits["example_id"].tolist(), hits["text"].tolist())]

    def text_matches(self, text: str) -> int:
        """How many trigger examples' texts contain `text` (case-insensitive)."""
        found = self._query("SELECT count(*) AS n FROM texts WHERE text ILIKE ? ESCAPE '\\'",
                            [self._text_pattern(text)])
        return int(found["n"].iloc[0])

    @staticmethod
    def _text_pattern(text: str | None) -> str:
        """The ILIKE pattern of a search text, its wildcards literal; a blank or overlong text refused."""
        if text is None or not text.strip():
            raise BadRequest("type some text to search the trigger examples for", 422)
        if len(text) > 500:
            raise BadRequest(f"search text has {len(text):,} characters; the limit is 500", 413)
        return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"

    def close(self) -> None:
        self._db.close()
