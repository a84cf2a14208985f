"""Patterns in the keys (SPEC section 4; paper Section 3.2, Figure 2, Appendix A).

For every key, from its top-t trigger prefixes:

- **Shallow score**: the share of prefixes ending with the most common last token
  (also reported for the last bigram and trigram). The key's *shared suffix* is the
  longest last n-gram (n <= 3) shared by at least `SHALLOW_SHARE` of its prefixes.
  Label shallow when the shallow score >= `SHALLOW_SHARE` (30%).
- **Semantic score**: prefixes are embedded with the analysed model's own
  representations (the residual stream after layer ``round(2(L-1)/3)``, mean-pooled over
  the prefix's non-special tokens, centred on the mean of random corpus prefixes), with
  each prefix's part of the shared suffix *left out of the pool*, so that surface overlap
  does not count as meaning (causal models: earlier positions never see it). The score is
  the mean pairwise cosine of the key's prefixes minus that of random sets of prefixes of
  the same size; label semantic when the key's mean pairwise cosine exceeds the 99th
  percentile of `N_RANDOM_SETS` random sets (a permutation test, p < 0.01) and the score
  is at least `SEMANTIC_MIN_SCORE` (0.2: significance alone labelled ~80% of a real
  model's keys semantic, as top prefixes share position and local context).
- Per prefix: shallow when it ends with the key's shared suffix (shallow keys); semantic
  when its mean cosine to the key's other prefixes exceeds the 95th percentile of a random
  prefix's mean cosine to a random set.
- Label per key: shallow, semantic, both or none; per layer the shares of keys and of
  trigger prefixes in each label (Figure 2); a one-line description per key.

Human labels (`ffkv.store.annotations`, from the explorer or `ffkv annotate`): `run` adds
the same figure from them and their agreement with the automatic ones.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

from ffkv.errors import FfkvError
from ffkv.experiments.common import RunContext, as_numpy, progress_bar
from ffkv.experiments.figures import COLORS, layer_axis, save_figure
from ffkv.parallel import gather_rows
from ffkv.store.annotations import LABELS, consensus, read_labels

NAME = "patterns"
SHALLOW_SHARE = 0.3
MAX_SUFFIX = 3
KEY_QUANTILE = 0.99
PREFIX_QUANTILE = 0.95
#: Besides significance, an effect size: mean pairwise cosine at least this far above random sets'.
SEMANTIC_MIN_SCORE = 0.2
N_RANDOM_PREFIXES = 400
N_RANDOM_SETS = 2000
EMBED_BYTES = 2**30  # above this, prefix embeddings are randomly projected to RANDOM_DIMS
RANDOM_DIMS = 256
TOPIC_WORDS = 3


# ------------------------------------------------------------------ shallow
def suffix_table(ctx: RunContext) -> pd.DataFrame:
    """One row per trigger entry with its last MAX_SUFFIX tokens (t1 = last; -1 where absent)."""
    trig = ctx.triggers()[["layer", "key", "rank", "example_id", "position", "coefficient"]].copy()
    lasts = np.full((len(trig), MAX_SUFFIX), -1, dtype=np.int64)
    for row, (e, p) in enumerate(zip(trig["example_id"].to_numpy(), trig["position"].to_numpy())):
        prefix = ctx.prefix(e, p)
        tail = prefix[-MAX_SUFFIX:][::-1]
        lasts[row, : len(tail)] = tail
    for n in range(MAX_SUFFIX):
        trig[f"t{n + 1}"] = lasts[:, n]
    return trig


def shallow_scores(entries: pd.DataFrame) -> pd.DataFrame:
    """Per key: share of prefixes sharing the most common last 1, 2, 3 tokens, and the shared suffix."""
    per_key = entries.groupby(["layer", "key"]).size().rename("n_triggers").to_frame()
    for n in range(1, MAX_SUFFIX + 1):
        cols = [f"t{i}" for i in range(1, n + 1)]
        valid = entries[(entries[cols] >= 0).all(axis=1)]
        counts = valid.groupby(["layer", "key", *cols]).size().rename("count").reset_index()
        # Most common suffix per key; ties by lowest token ids (deterministic).
        counts = counts.sort_values(["layer", "key", "count", *cols], ascending=[True, True, False] + [True] * n)
        best = counts.groupby(["layer", "key"]).head(1).set_index(["layer", "key"])
        per_key[f"shallow_score_{n}"] = best["count"].reindex(per_key.index).fillna(0) / per_key["n_triggers"]
        per_key[f"suffix_{n}"] = [tuple(int(best.at[i, c]) for c in cols[::-1]) if i in best.index else ()
                                  for i in per_key.index]
    shared = []
    for row in per_key.itertuples():
        chosen = ()
        for n in range(MAX_SUFFIX, 0, -1):
            if getattr(row, f"shallow_score_{n}") >= SHALLOW_SHARE:
                chosen = getattr(row, f"suffix_{n}")
                break
        if not chosen and getattr(row, "shallow_score_1") * row.n_triggers >= 2:
            chosen = row.suffix_1  # masked for the semantic score even below the shallow threshold
        shared.append(chosen)
    per_key["shared_suffix"] = shared
    per_key["shallow_score"] = per_key["shallow_score_1"]
    per_key["is_shallow"] = per_key["shallow_score"] >= SHALLOW_SHARE
    return per_key.drop(columns=[f"suffix_{n}" for n in range(1, MAX_SUFFIX + 1)])


def masked_length(prefix_tail: np.ndarray, suffix: tuple) -> int:
    """How many of the prefix's last tokens belong to the key's shared suffix (its longest common end)."""
    n = 0
    for a, b in zip(prefix_tail, reversed(suffix)):
        if a != b:
            break
        n += 1
    return n


# ----------------------------------------------------------------- semantic
def embed_layer(n_layers: int) -> int:
    return int(round(2 * (n_layers - 1) / 3))


@torch.no_grad()
def pooled_embeddings(ctx: RunContext, token_lists: list[np.ndarray], requests: list[tuple[int, int]],
                      layer: int, projection: torch.Tensor | None) -> np.ndarray:
    """Mean of resid_post[layer] over non-special positions 0..end of a token list, per request.

    requests: (index into token_lists, end position inclusive). NaN rows where nothing is pooled.
    Under torchrun each rank runs its share of the batches; every rank gets every request's row.
    """
    view = ctx.view
    special = torch.tensor(sorted(ctx.special_ids) or [-1], device=view.device)
    dims = projection.shape[1] if projection is not None else view.d_model
    out = np.full((len(requests), dims), np.nan, dtype=np.float32)
    by_row: dict[int, list[int]] = {}
    for i, (row, _) in enumerate(requests):
        by_row.setdefault(row, []).append(i)
    rows = [(i, token_lists[i]) for i in sorted(by_row)]
    state: dict = {}

    def sink(name, l, t):
        state["h"] = t.float()

    mine = ctx.batches(rows)
    done: list[int] = []  # the requests this rank pooled
    bar = progress_bar(ctx.progress, len(mine.rows), "pattern embeddings", "ex")
    with view.capture(("resid_post",), layers=[layer], sink=sink, stop_early=True):
        for idx, batch in mine:
            view.forward(batch.input_ids, batch.attention_mask)
            keep = (batch.attention_mask.bool() & ~torch.isin(batch.input_ids, special)).float()
            sums = torch.cumsum(state.pop("h") * keep[..., None], dim=1)
            counts = torch.cumsum(keep, dim=1)
            req = [i for r in idx for i in by_row[int(r)]]
            b = torch.as_tensor(np.searchsorted(idx, [requests[i][0] for i in req]), device=view.device)
            end = torch.as_tensor([requests[i][1] for i in req], device=view.device)
            ok = end >= 0
            e = end.clamp(min=0)
            cnt = counts[b, e]
            pooled = sums[b, e] / cnt.clamp(min=1)[:, None]
            if projection is not None:
                pooled = pooled @ projection
            pooled[~(ok & (cnt > 0))] = float("nan")
            out[req] = as_numpy(pooled)
            done += req
            bar.update(len(idx))
    bar.close()
    return gather_rows(out, done)


def random_prefixes(ctx: RunContext, n: int) -> list[np.ndarray]:
    """n seeded random prefixes (a random example, a random non-special end) of the run's corpus."""
    ids = pq.read_table(ctx.run.table("examples"), columns=["example_id"]).column(0).to_numpy()
    rng = np.random.default_rng([ctx.seed, 4])
    chosen = np.sort(rng.choice(ids, size=min(n, len(ids)), replace=False))
    table = pq.read_table(ctx.run.table("examples"), columns=["example_id", "token_ids"],
                          filters=[("example_id", "in", chosen.tolist())])
    special = ctx.special_ids
    out = []
    for tokens in table.column("token_ids").to_pylist():
        tokens = np.asarray(tokens, dtype=np.int64)
        ends = [i for i, t in enumerate(tokens) if int(t) not in special]
        if ends:
            out.append(tokens[: ends[int(rng.integers(len(ends)))] + 1])
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm > 0, norm, 1)


class RandomBaseline:
    """Cosine statistics of random prefixes: the null distribution of the semantic test."""

    def __init__(self, pool: np.ndarray, seed: int) -> None:
        self.pool = pool  # (R, D) unit vectors, centred
        self.rng = np.random.default_rng([seed, 5])
        self._cache: dict[int, tuple[float, float, float]] = {}

    def for_size(self, k: int) -> tuple[float, float, float]:
        """(mean, KEY_QUANTILE quantile) of a random k-set's mean pairwise cosine, and the
        PREFIX_QUANTILE quantile of one prefix's mean cosine to k-1 others."""
        if k not in self._cache:
            R = len(self.pool)
            k_ = min(k, R)
            sets, single = [], []
            for _ in range(N_RANDOM_SETS):
                pick = self.rng.choice(R, size=k_, replace=False)
                x = self.pool[pick]
                s = x.sum(0)
                sets.append((s @ s - k_) / (k_ * (k_ - 1)))
                single.append((x[0] @ s - 1) / (k_ - 1))
            self._cache[k] = (float(np.mean(sets)), float(np.quantile(sets, KEY_QUANTILE)),
                              float(np.quantile(single, PREFIX_QUANTILE)))
        return self._cache[k]


def semantic_scores(ctx: RunContext, entries: pd.DataFrame, per_key: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray, dict]:
    """Per key semantic score and label; per entry whether the prefix is semantic. Entries in (layer, key, rank) order."""
    view = ctx.view
    layer = embed_layer(view.n_layers)
    d = view.d_model
    projection = None
    if len(entries) * d * 4 > EMBED_BYTES and d > RANDOM_DIMS:
        g = torch.Generator().manual_seed(ctx.seed)
        projection = (torch.randn(d, RANDOM_DIMS, generator=g) / math.sqrt(RANDOM_DIMS)).to(view.device)
    examples = ctx.examples()
    ex_ids = np.unique(entries["example_id"].to_numpy())
    row_of = {int(e): i for i, e in enumerate(ex_ids)}
    randoms = random_prefixes(ctx, N_RANDOM_PREFIXES)
    token_lists = [examples[int(e)][0] for e in ex_ids] + randoms
    suffix = per_key["shared_suffix"].to_dict()  # a dict: a lookup per entry, where .loc costs ~0.1 ms
    requests = []
    for t in entries[["layer", "key", "example_id", "position", "t1", "t2", "t3"]].itertuples(index=False):
        n_mask = masked_length(np.array([t.t1, t.t2, t.t3]), suffix[(int(t.layer), int(t.key))])
        requests.append((row_of[int(t.example_id)], int(t.position) - n_mask))
    requests += [(len(ex_ids) + i, len(p) - 1) for i, p in enumerate(randoms)]
    emb = pooled_embeddings(ctx, token_lists, requests, layer, projection)
    pool, emb = emb[len(entries):], emb[: len(entries)]
    pool = pool[~np.isnan(pool).any(1)]
    if len(pool) < 3:
        raise FfkvError("the corpus is too small for the semantic score: fewer than 3 random prefixes")
    centre = pool.mean(0)
    baseline = RandomBaseline(_unit(pool - centre), ctx.seed)
    x = _unit(np.nan_to_num(emb - centre))
    valid = ~np.isnan(emb).any(1)
    x[~valid] = 0

    keys = entries[["layer", "key"]].to_numpy()
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(1)])
    sums = np.add.reduceat(x, starts, axis=0)
    counts = np.add.reduceat(valid.astype(np.int64), starts)
    within = np.where(counts > 1, ((sums * sums).sum(1) - counts) / np.maximum(counts * (counts - 1), 1), np.nan)
    seg = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(entries)]))
    k_entry = counts[seg]
    prefix_cos = np.where(valid & (k_entry > 1), ((x * sums[seg]).sum(1) - 1) / np.maximum(k_entry - 1, 1), np.nan)

    rows, prefix_semantic = [], np.zeros(len(entries), dtype=bool)
    for i, s in enumerate(starts):
        k = int(counts[i])
        if k < 2:
            rows.append((math.nan, math.nan, False))
            continue
        mean, key_q, prefix_q = baseline.for_size(k)
        rows.append((float(within[i] - mean), float(within[i]),
                     bool(within[i] > key_q and within[i] - mean >= SEMANTIC_MIN_SCORE)))
        end = starts[i + 1] if i + 1 < len(starts) else len(entries)
        prefix_semantic[s:end] = prefix_cos[s:end] > prefix_q
    index = pd.MultiIndex.from_arrays([keys[starts, 0], keys[starts, 1]], names=["layer", "key"])
    out = pd.DataFrame(rows, columns=["semantic_score", "mean_pairwise_cosine", "is_semantic"], index=index)
    out["n_embedded"] = counts
    info = {"embedding": f"resid_post of layer {layer} (0-based), mean over non-special prefix tokens, "
                         "shared-suffix tokens left out, centred on random prefixes",
            "embedding_dims": int(projection.shape[1]) if projection is not None else d,
            "random_prefixes": int(len(pool)), "key_quantile": KEY_QUANTILE, "prefix_quantile": PREFIX_QUANTILE,
            "semantic_min_score": SEMANTIC_MIN_SCORE}
    return out, prefix_semantic, info


# -------------------------------------------------------------- description
def corpus_document_frequency(ctx: RunContext, n: int = 2000) -> tuple[np.ndarray, int]:
    """Per token id, in how many of n random corpus examples it occurs."""
    ids = pq.read_table(ctx.run.table("examples"), columns=["example_id"]).column(0).to_numpy()
    rng = np.random.default_rng([ctx.seed, 6])
    chosen = rng.choice(ids, size=min(n, len(ids)), replace=False).tolist()
    table = pq.read_table(ctx.run.table("examples"), columns=["token_ids"], filters=[("example_id", "in", chosen)])
    df = np.zeros(ctx.view.vocab_size + 1, dtype=np.int64)
    for tokens in table.column(0).to_pylist():
        u = np.unique(np.asarray(tokens, dtype=np.int64))
        df[u[(u >= 0) & (u < len(df))]] += 1
    return df, max(1, table.num_rows)


def describe(ctx: RunContext, key_row, prefixes: list[np.ndarray], masked: list[int], doc_freq, n_docs) -> str:
    """One readable line: the shared ending and/or the topic words of a key's prefixes."""
    special = ctx.special_ids
    parts = []
    k = int(key_row.n_triggers)
    if key_row.is_shallow and key_row.shared_suffix:
        suffix = list(key_row.shared_suffix)
        share = getattr(key_row, f"shallow_score_{len(suffix)}")
        parts.append(f"ends with {_show(ctx, suffix)!s} ({round(share * k)}/{k})")
    topic = _topic_words(ctx, prefixes, masked, special, doc_freq, n_docs)
    if key_row.is_semantic and topic:
        parts.append("topic: " + ", ".join(topic))
    if not parts:
        last = list(key_row.shared_suffix[-1:]) if key_row.shared_suffix else []
        common = f"; most common ending {_show(ctx, last)} ({round(key_row.shallow_score_1 * k)}/{k})" if last else ""
        words = f"; frequent words: {', '.join(topic)}" if topic else ""
        parts.append(f"no clear pattern{common}{words}")
    return "; ".join(parts)


def _show(ctx: RunContext, ids: list[int]) -> str:
    try:
        text = ctx.tokenizer.decode([int(i) for i in ids])
    except Exception:  # noqa: BLE001
        text = "".join(ctx.tokens(ids))
    return repr(text.replace("\n", " "))


def _topic_words(ctx, prefixes, masked, special, doc_freq, n_docs) -> list[str]:
    counts: dict[int, int] = {}
    for p, m in zip(prefixes, masked):
        body = p[: len(p) - m] if m else p
        for t in set(int(t) for t in body):
            if t not in special:
                counts[t] = counts.get(t, 0) + 1
    scored = []
    for t, c in counts.items():
        if c < 2:
            continue
        text = ctx.token(t).strip()
        if not any(ch.isalnum() for ch in text):
            continue
        idf = math.log((n_docs + 1) / (1 + doc_freq[t] if t < len(doc_freq) else 1))
        scored.append((-(c / len(prefixes)) * idf, t, text))
    scored.sort()
    return [repr(text) for _, _, text in scored[:TOPIC_WORDS]]


# ------------------------------------------------------------------ compute
def label_of(shallow: bool, semantic: bool) -> str:
    return "both" if shallow and semantic else "shallow" if shallow else "semantic" if semantic else "none"


def compute(ctx: RunContext) -> dict[str, pd.DataFrame]:
    entries = suffix_table(ctx).sort_values(["layer", "key", "rank"]).reset_index(drop=True)
    per_key = shallow_scores(entries)
    semantic, prefix_semantic, info = semantic_scores(ctx, entries, per_key)
    per_key = per_key.join(semantic)
    per_key["is_semantic"] = per_key["is_semantic"].fillna(False).astype(bool)
    per_key["label"] = [label_of(a, b) for a, b in zip(per_key["is_shallow"], per_key["is_semantic"])]

    # Per prefix: ends with the shallow key's shared suffix; semantic by its own test.
    suffix = per_key["shared_suffix"].to_dict()
    tails = entries[["t1", "t2", "t3"]].to_numpy()
    shallow_key = per_key["is_shallow"].to_dict()
    masked, prefix_shallow = [], []
    for i, (l, k) in enumerate(zip(entries["layer"].tolist(), entries["key"].tolist())):
        s = suffix[(l, k)]
        n = masked_length(tails[i], s)
        masked.append(n)
        prefix_shallow.append(bool(shallow_key[(l, k)]) and len(s) > 0 and n == len(s))
    entries["prefix_label"] = [label_of(a, b) for a, b in zip(prefix_shallow, prefix_semantic)]

    doc_freq, n_docs = corpus_document_frequency(ctx)
    descriptions = []
    groups = entries.groupby(["layer", "key"], sort=False).indices
    masked = np.array(masked)
    for key_row in per_key.itertuples():
        rows = groups[key_row.Index]
        prefixes = [ctx.prefix(e, p) for e, p in zip(entries["example_id"].to_numpy()[rows], entries["position"].to_numpy()[rows])]
        descriptions.append(describe(ctx, key_row, prefixes, masked[rows].tolist(), doc_freq, n_docs))
    per_key["description"] = descriptions
    per_key["shared_suffix_text"] = [_show(ctx, list(s)) if s else "" for s in per_key["shared_suffix"]]
    per_key["shared_suffix"] = [list(s) for s in per_key["shared_suffix"]]
    keys = per_key.reset_index()
    keys = keys.astype({"layer": np.int16, "key": np.int32})
    keys["share_prefixes_shallow"] = entries.assign(v=np.array(prefix_shallow)).groupby(["layer", "key"])["v"].mean().to_numpy()
    keys["share_prefixes_semantic"] = entries.assign(v=prefix_semantic).groupby(["layer", "key"])["v"].mean().to_numpy()
    cols = ["layer", "key", "label", "description", "shallow_score", "shallow_score_2", "shallow_score_3",
            "shared_suffix", "shared_suffix_text", "semantic_score", "mean_pairwise_cosine", "is_shallow", "is_semantic",
            "share_prefixes_shallow", "share_prefixes_semantic", "n_triggers", "n_embedded"]
    keys = keys[cols]
    prefixes = entries[["layer", "key", "rank", "example_id", "position", "prefix_label"]].astype(
        {"layer": np.int16, "key": np.int32, "rank": np.int16, "position": np.int32})
    return {"keys": keys, "prefixes": prefixes, "per_layer": shares(keys, prefixes, ctx.view.n_layers), "info": info}


def shares(keys: pd.DataFrame, prefixes: pd.DataFrame | None, n_layers: int, label_column: str = "label") -> pd.DataFrame:
    """Per layer: share of keys (and of trigger prefixes) in each label."""
    out = pd.DataFrame({"layer": np.arange(n_layers)})
    k = keys.groupby("layer")[label_column].value_counts(normalize=True).unstack(fill_value=0.0)
    for label in LABELS:
        out[f"keys_{label}"] = k[label].reindex(out["layer"]).fillna(0.0).to_numpy() if label in k else 0.0
    if prefixes is not None:
        p = prefixes.groupby("layer")["prefix_label"].value_counts(normalize=True).unstack(fill_value=0.0)
        for label in LABELS:
            out[f"prefixes_{label}"] = p[label].reindex(out["layer"]).fillna(0.0).to_numpy() if label in p else 0.0
    out["n_keys"] = keys.groupby("layer").size().reindex(out["layer"]).fillna(0).astype(int).to_numpy()
    return out


def draw(ctx: RunContext, per_layer: pd.DataFrame, name: str = NAME, title: str = "automatic labels") -> None:
    L = ctx.view.n_layers
    panels = [("keys", "% keys")] + ([("prefixes", "% trigger prefixes")] if "prefixes_none" in per_layer else [])
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 3.4), constrained_layout=True, squeeze=False)
    x = per_layer["layer"].to_numpy()
    for ax, (prefix, ylabel) in zip(axes[0], panels):
        bottom = np.zeros(len(x))
        for label in ("shallow", "both", "semantic", "none"):
            v = 100 * per_layer[f"{prefix}_{label}"].to_numpy()
            ax.bar(x, v, bottom=bottom, color=COLORS[label], label=label)
            bottom += v
        ax.set_ylim(0, 100)
        ax.set_ylabel(ylabel)
        layer_axis(ax, L)
    axes[0][0].set_title(f"Key patterns per layer, {title} (paper Fig. 2)", loc="left")
    axes[0][-1].legend(frameon=False, fontsize=7, loc="upper right")
    save_figure(fig, ctx.run.path, name)


# ------------------------------------------------------------ human labels
def cohen_kappa(a: np.ndarray, b: np.ndarray) -> float:
    """Cohen's kappa of two label arrays."""
    if not len(a):
        return math.nan
    observed = float((a == b).mean())
    cats = sorted(set(a) | set(b))
    expected = sum(float((a == c).mean()) * float((b == c).mean()) for c in cats)
    return (observed - expected) / (1 - expected) if expected < 1 else 1.0


def human_agreement(ctx: RunContext, keys: pd.DataFrame) -> pd.DataFrame | None:
    """Per layer: human label shares and agreement with the automatic labels; None without labels."""
    human = consensus(read_labels(ctx.run.path))
    if human.empty:
        return None
    merged = human.merge(keys[["layer", "key", "label"]].astype({"layer": int, "key": int}),
                         on=["layer", "key"], how="inner")
    if merged.empty:
        return None
    per_layer = shares(merged.rename(columns={"label": "auto_label"}), None, ctx.view.n_layers, "human_label")
    agree = merged.assign(a=merged["human_label"] == merged["label"]).groupby("layer")["a"].mean()
    per_layer["agreement"] = agree.reindex(per_layer["layer"]).to_numpy()
    per_layer["kappa_all_layers"] = cohen_kappa(merged["human_label"].to_numpy(), merged["label"].to_numpy())
    return per_layer


def run(ctx: RunContext) -> dict:
    result = compute(ctx)
    meta = {"shallow_share": SHALLOW_SHARE, "max_suffix": MAX_SUFFIX, **result["info"], "top_t": ctx.top_k,
            "labels": "shallow: shallow_score >= shallow_share; semantic: permutation test on mean pairwise cosine"}
    ctx.write_table(NAME, result["per_layer"], **meta)
    ctx.write_table(f"{NAME}_keys", result["keys"], **meta)
    ctx.write_table(f"{NAME}_prefixes", result["prefixes"], **meta)
    draw(ctx, result["per_layer"])
    tables, figures = [NAME, f"{NAME}_keys", f"{NAME}_prefixes"], [NAME]
    human = human_agreement(ctx, result["keys"])
    if human is not None:
        ctx.write_table(f"{NAME}_human", human, **meta)
        draw(ctx, human, f"{NAME}_human", "human labels")
        tables.append(f"{NAME}_human")
        figures.append(f"{NAME}_human")
        result["human"] = human
    ctx.record(NAME, tables=tables, figures=figures, **meta)
    return result
