"""What the explorer reads from a run directory, and how it finds it fast.

On first start the explorer writes, beside the run's tables, a folder ``RUN/explorer/``:

    info.json                  what the cache was built from (rebuilt when that changes)
    key_stats.parquet          one row per (layer, key): value confidence, agreement, rank of the
                               top-1 trigger's next token, activation frequency, ‖v_i‖, shallow share
    value_top_tokens.parquet   layer, key, rank, token_id, prob: each value's top tokens
    explorer.duckdb            DuckDB copy of the trigger examples (sorted, indexed by layer, key)
                               and of the text of the examples they use (indexed by example id)

Every file is written to a temporary name and renamed. Pages then answer from DuckDB
point queries and from small in-memory arrays: a memory page reads ~t rows.
"""

from __future__ import annotations

import json
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ffkv.explorer.lookups import activation_frequency, value_tables
from ffkv.explorer.validation import BadRequest, layer_key
from ffkv.memories.targets import trigger_targets
from ffkv.store import atomic, schemas
from ffkv.store.annotations import Annotations
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

CACHE_VERSION = 1
TOP_TOKENS = 10
SAMPLE_EXAMPLES = 256


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")


def _fingerprint(run: RunDir, manifest: Manifest) -> dict:
    files = {}
    for name in ("trigger_examples", "examples"):
        st = run.table(name).stat()
        files[name] = [st.st_size, st.st_mtime_ns]
    return {"cache_version": CACHE_VERSION, "top_tokens": TOP_TOKENS, "identity": manifest.identity.to_dict(),
            "files": files}


CACHE_FILES = ("explorer.duckdb", "key_stats.parquet", "value_top_tokens.parquet")


def cache_is_valid(run: RunDir, manifest: Manifest, folder: Path) -> bool:
    """Whether folder holds the explorer's tables for exactly this run's index."""
    info_path = folder / "info.json"
    if not info_path.exists() or not all((folder / n).exists() for n in CACHE_FILES):
        return False
    try:
        return json.loads(info_path.read_text()).get("fingerprint") == _fingerprint(run, manifest)
    except (OSError, json.JSONDecodeError):
        return False


def write_cache_info(run: RunDir, manifest: Manifest, folder: Path, **details: Any) -> None:
    """Mark the explorer's tables in folder as built for this run's index (written last)."""
    atomic.write_json(folder / "info.json", {"fingerprint": _fingerprint(run, manifest), "projection": "identity",
                                             "top_tokens": TOP_TOKENS, **details})


def cache_folder(run: RunDir) -> Path:
    """RUN/explorer, or a temporary folder when the run directory is read-only."""
    folder = run.cache_dir
    try:
        folder.mkdir(exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe", delete=True)
        probe.close()
        return folder
    except OSError:
        return Path(tempfile.mkdtemp(prefix="ffkv-explorer-"))


def build_database(run: RunDir, path: Path) -> None:
    """Write explorer.duckdb atomically: triggers (with each prefix's last token) and texts."""
    with atomic.atomic_path(path) as tmp:
        tmp.unlink()
        con = duckdb.connect(str(tmp))
        try:
            con.execute("SET threads TO 2")
            te, ex = _sql_path(run.table("trigger_examples")), _sql_path(run.table("examples"))
            con.execute(f"""
                CREATE TABLE texts AS
                SELECT example_id, token_ids, text FROM read_parquet('{ex}')
                WHERE example_id IN (SELECT DISTINCT example_id FROM read_parquet('{te}'))
                ORDER BY example_id""")
            con.execute(f"""
                CREATE TABLE triggers AS
                SELECT t.layer, t.key, t.rank, t.coefficient, t.example_id, t.position, t.next_token_id,
                       CAST(x.token_ids[t.position + 1] AS INTEGER) AS last_token_id
                FROM read_parquet('{te}') t JOIN texts x USING (example_id)
                ORDER BY t.layer, t.key, t.rank""")
            con.execute("CREATE INDEX triggers_layer_key ON triggers (layer, key)")
            con.execute("CREATE UNIQUE INDEX texts_id ON texts (example_id)")
            con.execute("CHECKPOINT")
        finally:
            con.close()
        wal = Path(str(tmp) + ".wal")
        if wal.exists():
            wal.unlink()


#: The per-key table of `ffkv analyze` whose label, description and scores the pages show.
PATTERN_KEYS = "patterns_keys"


class ExplorerData:
    """The run as the explorer's pages need it.

    Args:
        run_dir: a complete run directory.
        loaded: the run's model (for the lookup tables, token strings, and traces).
        progress: print a line per preparation step (first start only).
    """

    def __init__(self, run_dir: str | Path, loaded, progress: bool = False) -> None:
        self.run = RunDir(run_dir)
        self.manifest = self.run.require_complete()
        model = self.manifest.model
        self.n_layers, self.d_m, self.vocab_size = model.n_layers, model.d_m, model.vocab_size
        self.loaded = loaded
        self.progress = progress
        self.folder = cache_folder(self.run)
        self._prepare()
        self._db = duckdb.connect(str(self.folder / "explorer.duckdb"), read_only=True)
        self._db_lock = threading.Lock()
        stats = pd.read_parquet(self.folder / "key_stats.parquet")
        self.key_stats = stats.set_index(["layer", "key"]).sort_index()
        top = pd.read_parquet(self.folder / "value_top_tokens.parquet")
        k = int(top["rank"].max()) + 1 if len(top) else 0
        self.top_ids = top["token_id"].to_numpy().reshape(self.n_layers, self.d_m, k)
        self.top_probs = top["prob"].to_numpy().reshape(self.n_layers, self.d_m, k)
        self.annotations = Annotations(self.run.path)
        self.key_metrics = self._load_key_metrics()
        self._tokens: list[str] | None = None
        self._token_index: dict[str, list[int]] | None = None

    # ------------------------------------------------------------ preparation
    def _say(self, text: str) -> None:
        if self.progress:
            print(f"ffkv serve: {text}", flush=True)

    def _prepare(self) -> None:
        if cache_is_valid(self.run, self.manifest, self.folder):
            return
        self._say(f"first start on this run: preparing lookup tables in {self.folder}")
        build_database(self.run, self.folder / "explorer.duckdb")
        con = duckdb.connect(str(self.folder / "explorer.duckdb"), read_only=True)
        try:
            first = con.execute("SELECT layer, key, next_token_id, last_token_id FROM triggers WHERE rank = 0"
                                ).fetchnumpy()
            shallow = con.execute("""
                SELECT layer, key, arg_max(last_token_id, n) AS common_last_token_id,
                       CAST(max(n) AS FLOAT) / sum(n) AS shallow_share
                FROM (SELECT layer, key, last_token_id, count(*) AS n FROM triggers GROUP BY ALL)
                GROUP BY layer, key""").df()
        finally:
            con.close()
        top1_target = np.full((self.n_layers, self.d_m), -1, dtype=np.int64)
        top1_target[first["layer"].astype(int), first["key"].astype(int)] = trigger_targets(
            first["next_token_id"], first["last_token_id"], self.manifest.model.encoder)

        self._say("projecting every value onto the vocabulary")
        top_table, stats = value_tables(self.loaded, top1_target, TOP_TOKENS)
        self._say(f"activation frequency over {SAMPLE_EXAMPLES} examples")
        sample = pq.ParquetFile(self.run.table("examples"))
        batch = next(sample.iter_batches(batch_size=SAMPLE_EXAMPLES, columns=["token_ids"]), None)
        tokens = batch.column(0).to_pylist() if batch is not None else []
        stats["activation_frequency"] = activation_frequency(self.loaded, tokens).ravel()
        stats = stats.merge(shallow.astype({"layer": "int16", "key": "int32"}), on=["layer", "key"], how="left")
        stats["shallow_share"] = stats["shallow_share"].fillna(0).astype("float32")
        stats["common_last_token_id"] = stats["common_last_token_id"].fillna(-1).astype("int32")
        atomic.write_parquet(self.folder / "value_top_tokens.parquet", top_table)
        atomic.write_parquet(self.folder / "key_stats.parquet",
                             pa.Table.from_pandas(stats, schema=schemas.KEY_STATS, preserve_index=False))
        write_cache_info(self.run, self.manifest, self.folder, activation_sample_examples=len(tokens))

    def _load_key_metrics(self) -> pd.DataFrame | None:
        """The automatic pattern label, description and scores of every key (`ffkv analyze --only
        patterns`: metrics/patterns_keys.parquet), or None before that experiment ran."""
        if not self.run.has_metric(PATTERN_KEYS):
            return None
        table = self.run.read_metric(PATTERN_KEYS).astype({"layer": "int64", "key": "int64"})
        keep = [c for c in table.columns if c not in ("layer", "key")
                and (pd.api.types.is_numeric_dtype(table[c]) or c in ("label", "description"))]
        return table[["layer", "key", *keep]].set_index(["layer", "key"]).sort_index()

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

    def token(self, token_id: int) -> str:
        if token_id is None or token_id < 0:
            return "⟨end⟩"
        strings = self.tokens()
        return strings[token_id] if token_id < len(strings) else f"<{token_id}>"

    def token_ids_for(self, text: str) -> list[int]:
        """Ids of a token typed by a user: exact string, else the same string without surrounding spaces,
        or ``#123`` for id 123. An unknown token is a 404 that says so."""
        if text is None or text == "":
            raise BadRequest("type a token to search for", 422)
        if len(text) > 200:
            raise BadRequest("a token is at most 200 characters", 422)
        if text.startswith("#") and text[1:].isdigit():
            i = int(text[1:])
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
        return layer_key(layer, key, self.n_layers, self.d_m)

    def value_top(self, layer: int, key: int) -> list[dict]:
        return [{"token_id": int(t), "token": self.token(int(t)), "prob": float(p)}
                for t, p in zip(self.top_ids[layer, key], self.top_probs[layer, key])]

    def labels_of(self, layer: int, key: int) -> dict:
        """The automatic pattern label of `ffkv analyze` (if any) and the human labels of a key."""
        auto = {}
        if self.key_metrics is not None and (layer, key) in self.key_metrics.index:
            row = self.key_metrics.loc[(layer, key)]
            auto = {c: row[c] for c in self.key_metrics.columns if pd.notna(row[c])}
        return {"auto": auto, "human": self.annotations.of(layer, key)}

    def memory(self, layer: int, key: int) -> dict:
        """Everything the memory page shows about key `key` of layer `layer`."""
        layer, key = self.check(layer, key)
        trig = self._query("SELECT rank, coefficient, example_id, position, next_token_id FROM triggers "
                           "WHERE layer = ? AND key = ? ORDER BY rank", [layer, key])
        ids = [int(i) for i in trig["example_id"].unique()]
        texts = self._query("SELECT example_id, token_ids, text FROM texts WHERE example_id IN "
                            f"({','.join('?' * len(ids))})", ids) if ids else pd.DataFrame(
            columns=["example_id", "token_ids", "text"])
        texts = texts.set_index("example_id")
        top_coef = float(trig["coefficient"].abs().max()) if len(trig) else 1.0
        examples = []
        for row in trig.itertuples(index=False):
            token_ids = [int(t) for t in texts.at[row.example_id, "token_ids"]]
            pos = int(row.position)
            examples.append({
                "rank": int(row.rank), "coefficient": float(row.coefficient),
                "bar": 100.0 * abs(float(row.coefficient)) / top_coef if top_coef else 0.0,
                "example_id": int(row.example_id), "position": pos,
                "prefix": [self.token(t) for t in token_ids[:pos]], "last": self.token(token_ids[pos]),
                "rest": [self.token(t) for t in token_ids[pos + 1:]],
                "next_token_id": int(row.next_token_id), "next": self.token(int(row.next_token_id)),
                "text": texts.at[row.example_id, "text"],
            })
        stats = self.key_stats.loc[(layer, key)].to_dict()
        next_counts = Counter(e["next_token_id"] for e in examples)
        last_counts = Counter(e["last"] for e in examples)
        common_last, n_last = (last_counts.most_common(1)[0] if last_counts else ("", 0))
        labels = self.labels_of(layer, key)
        return {
            "layer": layer, "key": key, "examples": examples, "stats": stats,
            "top_token": self.token(int(stats["top_token_id"])),
            "value_top": self.value_top(layer, key),
            "next_tokens": [{"token_id": t, "token": self.token(t), "count": c} for t, c in next_counts.most_common(10)],
            "surface": {"token": common_last, "share": n_last / len(examples) if examples else 0.0},
            "auto": labels["auto"], "human": labels["human"],
        }

    def layer_keys(self, layer: int) -> pd.DataFrame:
        """One row per key of a layer: the sortable columns of the layer page."""
        layer = self.check(layer, 0)[0]
        table = self.key_stats.loc[layer].reset_index()
        table["top_token"] = [self.token(int(t)) for t in table["top_token_id"]]
        table["common_last_token"] = [self.token(int(t)) if t >= 0 else "" for t in table["common_last_token_id"]]
        if self.key_metrics is not None:
            extra = self.key_metrics.xs(layer, level="layer", drop_level=True) \
                if layer in self.key_metrics.index.get_level_values(0) else None
            if extra is not None:
                table = table.join(extra, on="key")
        human = self.annotations.all()
        human = human[human.layer == layer].sort_values("time").drop_duplicates("key", keep="last")
        table = table.merge(human[["key", "label", "description"]].rename(
            columns={"label": "human_label", "description": "human_description"}), on="key", how="left")
        return table

    def layer_summary(self) -> pd.DataFrame:
        """Per-layer summary of the key statistics (the overview page)."""
        stats = self.key_stats.reset_index()
        top1 = self._query("SELECT layer, avg(coefficient) AS mean_top1_coefficient FROM triggers "
                           "WHERE rank = 0 GROUP BY layer ORDER BY layer")
        summary = stats.groupby("layer").agg(
            keys=("key", "size"), agreement_rate=("agreement", "mean"), mean_confidence=("confidence", "mean"),
            median_next_token_rank=("next_token_rank", lambda r: float(np.median(r[r >= 0])) if (r >= 0).any() else np.nan),
            mean_activation_frequency=("activation_frequency", "mean"), mean_shallow_share=("shallow_share", "mean"),
        ).reset_index()
        summary = summary.merge(top1.astype({"layer": summary["layer"].dtype}), on="layer", how="left")
        human = self.annotations.all()
        counts = human.groupby("layer")["key"].nunique() if len(human) else pd.Series(dtype=int)
        summary["annotated_keys"] = [int(counts.get(layer, 0)) for layer in summary["layer"]]
        if self.key_metrics is not None and "label" in self.key_metrics.columns:
            shares = self.key_metrics["label"].groupby(level="layer").value_counts(normalize=True).unstack(fill_value=0)
            for label in shares.columns:
                summary[f"share_{label}"] = [float(shares[label].get(layer, 0)) for layer in summary["layer"]]
        return summary

    def promoting(self, text: str, limit: int = 50) -> dict:
        """Memories whose value ranks the token highest: exact ranks from the top-token table,
        then, past it, the keys giving the token the most probability."""
        ids = self.token_ids_for(text)
        rows = []
        for token_id in ids:
            layers, keys, ranks = np.nonzero(self.top_ids == token_id)
            for layer, key, rank in zip(layers, keys, ranks):
                rows.append((int(rank), -float(self.top_probs[layer, key, rank]), int(layer), int(key), token_id))
        rows.sort()
        found = [{"rank": r, "prob": -p, "layer": layer, "key": key, "token_id": t, "token": self.token(t),
                  "top_token": self.token(int(self.top_ids[layer, key, 0]))} for r, p, layer, key, t in rows[:limit]]
        more = self._most_probable(ids[0], limit) if len(found) < limit else []
        seen = {(f["layer"], f["key"]) for f in found}
        for item in more:
            if len(found) >= limit:
                break
            if (item["layer"], item["key"]) not in seen:
                found.append(item)
        return {"token_ids": ids, "token": self.token(ids[0]), "results": found,
                "top_tokens": int(self.top_ids.shape[2])}

    def _most_probable(self, token_id: int, limit: int) -> list[dict]:
        """Keys with the highest p_i(token) = exp(v_i·E_x - logsumexp_i), from the model's weights."""
        import torch

        view = getattr(self.loaded, "view", None)
        if view is None:
            return []
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

    def text_search(self, text: str, limit: int = 50) -> list[dict]:
        """Trigger examples whose text contains `text` (case-insensitive), with the memories they trigger."""
        if text is None or not text.strip():
            raise BadRequest("type some text to search the trigger examples for", 422)
        if len(text) > 500:
            raise BadRequest(f"search text has {len(text):,} characters; the limit is 500", 413)
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        hits = self._query("SELECT example_id, text FROM texts WHERE text ILIKE ? ESCAPE '\\' "
                           "ORDER BY example_id LIMIT ?", [pattern, limit])
        if hits.empty:
            return []
        ids = [int(i) for i in hits["example_id"]]
        trig = self._query("SELECT example_id, layer, key, rank, coefficient FROM triggers WHERE example_id IN "
                           f"({','.join('?' * len(ids))}) ORDER BY coefficient DESC", ids)
        out = []
        for row in hits.itertuples(index=False):
            mems = trig[trig.example_id == row.example_id].head(12)
            out.append({"example_id": int(row.example_id), "text": row.text,
                        "memories": [{"layer": int(m.layer), "key": int(m.key), "rank": int(m.rank),
                                      "coefficient": float(m.coefficient)} for m in mems.itertuples(index=False)],
                        "n_memories": int((trig.example_id == row.example_id).sum())})
        return out

    def close(self) -> None:
        self._db.close()
