"""Patterns in the keys (docs/definitions.md; paper Section 3.2, Figure 2, Appendix A).

For every key, from its top-t trigger prefixes:

- **Shallow score**: the share of prefixes ending with the most common last token
  (also reported for the last bigram and trigram). The key's *shared suffix* is the
  longest last n-gram (n <= 3) shared by at least `SHALLOW_SHARE` of its prefixes.
  Label shallow when the shallow score >= `SHALLOW_SHARE` (30%).
- **Semantic score** (`ffkv.experiments.semantic`): not from any residual stream, which is circular
  (a key's trigger prefixes share the key's direction there by construction). Each prefix is the mean
  of the model's *input embeddings* of its content tokens (no stop tokens, no special tokens), with the
  trigger token, the key's shared suffix and `CONTEXT` tokens before them left out; the score is the
  mean pairwise cosine of the key's prefixes minus its mean over random corpus prefixes of the same
  body lengths and endings, and z divides it by the null's standard deviation (exact moments of the
  U-statistic).
  Label semantic when z >= `semantic.SEMANTIC_Z`, a cut-off calibrated on planted topics, planted
  suffixes and random sets (`semantic.calibrate`; `run` repeats the calibration on the run's corpus
  and states it with the tables).
- Per prefix: shallow when it ends with the key's shared suffix (shallow keys); semantic when its key
  is semantic and its mean cosine to the key's other prefixes is above the null mean.
- Label per key: shallow, semantic, both or none; per layer the shares of keys and of
  trigger prefixes in each label (Figure 2), and a control: the share of sets of trigger prefixes of
  different keys labelled semantic (`mixed_key_control`); a one-line description per key.

Human labels (`ffkv.store.annotations`, from the explorer or `ffkv annotate`): `run` adds
the same figure from them and their agreement with the automatic ones (per layer, and Cohen's kappa).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from ffkv.errors import FfkvError
from ffkv.experiments import semantic
from ffkv.experiments.common import (RunContext, as_numpy, control_with_interval, excess_verdict, progress_bar,
                                     share_with_interval)
from ffkv.experiments.dead import dead_keys, largest_coefficients
from ffkv.experiments.figures import COLORS, kinds_beside, layer_axis, legend_outside
from ffkv.experiments.heldout import active_threshold
from ffkv.experiments.registry import Encoder, Experiment, Figures, Finding, Result
from ffkv.experiments.semantic import CONTEXT, masked_length
from ffkv.models.token_display import sequence_strings
from ffkv.presentation.findings import (MIN_SEMANTIC_RECALL, diff, layer_ends, n_of, pct, rule_frame, share_ci,
                                        verdict_row, verdict_rows, wilson_interval)
from ffkv.store.annotations import LABELS, consensus, read_labels

NAME = "patterns"
SHALLOW_SHARE = 0.3
MAX_SUFFIX = 3
#: Examples of the run's corpus read for token counts, random prefixes and the calibration.
CORPUS_SAMPLE = 3000
#: Sets of each kind in the calibration that `run` does on the run's own corpus.
CALIBRATION_SETS = 100
#: Per layer, sets of trigger prefixes of different keys scored as a control (`mixed_key_control`).
MIXED_SETS = 100
KEY_CHUNK = 2048
TOPIC_WORDS = 3


# ------------------------------------------------------------------ shallow
def suffix_table(ctx: RunContext, control: bool = False, source: str = "neurons") -> pd.DataFrame:
    """One row per trigger entry (of the model's keys, or of the random control memories; `source` ``latents``:
    of the dictionary's latents) with its last MAX_SUFFIX tokens (t1 = last; -1 where absent)."""
    trig = ctx.triggers(1, control, source)[["layer", "key", "rank", "example_id", "position", "coefficient"]].copy()
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
        aligned = best[cols[::-1]].reindex(per_key.index)  # a key with no valid suffix: NaN
        present = aligned.notna().all(axis=1).to_numpy()
        per_key[f"suffix_{n}"] = [tuple(int(v) for v in row) if ok else ()
                                  for row, ok in zip(aligned.to_numpy(), present)]
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


# ----------------------------------------------------------------- semantic
def corpus_sample(ctx: RunContext, n: int = CORPUS_SAMPLE) -> list[np.ndarray]:
    """The token ids of n seeded random examples of the run's corpus (token counts, random prefixes, calibration)."""
    def read() -> list[np.ndarray]:
        ids = pq.read_table(ctx.run.table("examples"), columns=["example_id"]).column(0).to_numpy()
        rng = np.random.default_rng([ctx.seed, 6])
        chosen = np.sort(rng.choice(ids, size=min(n, len(ids)), replace=False))
        table = pq.read_table(ctx.run.table("examples"), columns=["token_ids"],
                              filters=[("example_id", "in", chosen.tolist())])
        return [np.asarray(t, dtype=np.int64) for t in table.column(0).to_pylist()]
    return ctx.once(("corpus_sample", n), read)


def input_embeddings(ctx: RunContext) -> np.ndarray:
    """The model's input token embeddings (its output embedding E where it exposes no input embedding)."""
    get = getattr(ctx.view.model, "get_input_embeddings", None)
    module = get() if callable(get) else None
    weight = getattr(module, "weight", None) if module is not None else None
    if weight is None or weight.ndim != 2:
        weight = ctx.view.unembedding
    return as_numpy(weight.float())


def content_space(ctx: RunContext) -> semantic.ContentSpace:
    docs = corpus_sample(ctx)
    emb = input_embeddings(ctx)
    counts = np.bincount(np.concatenate(docs + [np.zeros(0, np.int64)]).clip(0, len(emb) - 1), minlength=len(emb))
    is_word = np.array([any(ch.isalnum() for ch in ctx.token(t)) for t in range(len(emb))])
    return semantic.ContentSpace.build(emb, counts, sorted(ctx.special_ids), is_word, ctx.seed)


def shared_suffixes(sets: list[list[np.ndarray]]) -> list[tuple]:
    """The shared suffix `shallow_scores` finds for each set of prefixes, as if each were one key's."""
    tails = [np.asarray(p)[-MAX_SUFFIX:][::-1] for prefixes in sets for p in prefixes]
    last = np.full((len(tails), MAX_SUFFIX), -1, dtype=np.int64)
    for i, t in enumerate(tails):
        last[i, : len(t)] = t
    entries = pd.DataFrame({"layer": 0, "key": np.repeat(np.arange(len(sets)), [len(p) for p in sets]),
                            **{f"t{n + 1}": last[:, n] for n in range(MAX_SUFFIX)}})
    found = shallow_scores(entries)["shared_suffix"]
    return [tuple(found.get((0, i), ())) for i in range(len(sets))]


def semantic_null(ctx: RunContext) -> tuple[semantic.ContentSpace, semantic.NullMoments]:
    """The content space and the null of the run's corpus sample (built once per analysis)."""
    def build():
        space = content_space(ctx)
        try:
            return space, semantic.build_null(corpus_sample(ctx), space, ctx.seed)
        except ValueError as exc:
            raise FfkvError(f"the corpus is too small for the semantic score: {exc}") from None
    return ctx.once("semantic_null", build)


def semantic_scores(ctx: RunContext, entries: pd.DataFrame, per_key: pd.DataFrame, label: str = "semantic scores"
                    ) -> tuple[pd.DataFrame, np.ndarray]:
    """Per key semantic score and z (`ffkv.experiments.semantic`); per entry whether the prefix is closer to
    its key's other prefixes than the null mean (it is semantic when its key is). Entries in (layer, key, rank)
    order. Keys are scored in chunks: memory does not grow with the keys."""
    space, null = semantic_null(ctx)
    docs = corpus_sample(ctx)
    suffix = per_key["shared_suffix"].to_dict()
    layers, keys_, ex_ids, pos = (entries[c].to_numpy() for c in ("layer", "key", "example_id", "position"))
    starts_all = np.flatnonzero(np.r_[True, (layers[1:] != layers[:-1]) | (keys_[1:] != keys_[:-1])])
    bounds = np.r_[starts_all, len(entries)]
    columns = {c: np.full(len(starts_all), np.nan) for c in ("S", "mean", "z")}
    n_embedded = np.zeros(len(starts_all), dtype=np.int64)
    prefix_cos = np.full(len(entries), np.nan)
    bar = progress_bar(ctx.progress, len(starts_all), label, "key")
    for c0 in range(0, len(starts_all), KEY_CHUNK):
        c1 = min(c0 + KEY_CHUNK, len(starts_all))
        sets = [([ctx.prefix(e, p) for e, p in zip(ex_ids[bounds[i]:bounds[i + 1]], pos[bounds[i]:bounds[i + 1]])],
                 suffix[(int(layers[bounds[i]]), int(keys_[bounds[i]]))]) for i in range(c0, c1)]
        got = semantic.score_sets(space, null, sets)
        for name in columns:
            columns[name][c0:c1] = got[name]
        n_embedded[c0:c1] = got["n"]
        prefix_cos[bounds[c0]:bounds[c1]] = got["row"]
        bar.update(c1 - c0)
    bar.close()
    z = columns["z"]
    index = pd.MultiIndex.from_arrays([layers[starts_all], keys_[starts_all]], names=["layer", "key"])
    out = pd.DataFrame({"semantic_score": columns["S"] - columns["mean"], "mean_pairwise_cosine": columns["S"],
                        "semantic_z": z, "semantic_p": semantic.normal_sf(z), "n_embedded": n_embedded}, index=index)
    key_of_row = np.repeat(np.arange(len(starts_all)), np.diff(bounds))
    prefix_coherent = np.nan_to_num(prefix_cos, nan=-np.inf) > columns["mean"][key_of_row]
    return out, prefix_coherent


def calibration(ctx: RunContext) -> semantic.Calibration:
    """The semantic labeler on planted ground truth from this run's corpus (`semantic.calibrate`)."""
    def compute() -> semantic.Calibration:
        space, null = semantic_null(ctx)
        return semantic.calibrate(corpus_sample(ctx), space, null, shared_suffixes,
                                  k=max(semantic.MIN_PREFIXES, min(ctx.top_k, 25)), n_sets=CALIBRATION_SETS,
                                  seed=ctx.seed)
    return ctx.once("semantic_calibration", compute)


def semantic_info(ctx: RunContext) -> dict:
    """How the semantic score was computed, for the tables' descriptions."""
    _, null = semantic_null(ctx)
    return {"embedding": "the model's input embeddings of each prefix's content tokens (stop tokens: the most "
                         f"frequent tokens making {semantic.STOP_MASS:.0%} of the corpus), mean-pooled; trigger "
                         f"token, shared suffix and {CONTEXT} tokens before them left out; null: random corpus "
                         "prefixes with the same body lengths and endings",
            "semantic_z": semantic.SEMANTIC_Z, "random_prefixes": int(null.n_pool),
            "calibration": f"on this run's corpus: {calibration(ctx).line()}"}


#: Share of a layer's random control memories that may pass the semantic label (docs/definitions.md, Controls).
CONTROL_PASS = 0.05


def control_cutoffs(control: pd.DataFrame | None, n_layers: int) -> np.ndarray:
    """(L,) per layer the z a key must exceed besides `semantic.SEMANTIC_Z`: the (1 - `CONTROL_PASS`) quantile of
    the z of the layer's live random control memories (the higher order statistic, so that at most
    `CONTROL_PASS` of them exceed it); -inf without a control (the label then rests on the corpus null alone)."""
    cut = np.full(n_layers, -np.inf)
    if control is None:
        return cut
    for layer, g in control[~control["dead"]].groupby("layer"):
        z = np.nan_to_num(g["semantic_z"].to_numpy(float), nan=-np.inf)
        if len(z):
            cut[int(layer)] = float(np.quantile(z, 1 - CONTROL_PASS, method="higher"))
    return cut


def semantic_label(z: np.ndarray, cutoff: np.ndarray) -> np.ndarray:
    """Semantic: z >= `semantic.SEMANTIC_Z` (beyond random corpus prefixes) and z > the layer's control cut-off
    (beyond random key directions of the same layer); NaN z (too few content prefixes) never is."""
    z = np.nan_to_num(np.asarray(z, dtype=float), nan=-np.inf)
    return (z >= semantic.SEMANTIC_Z) & (z > np.asarray(cutoff, dtype=float))


def mixed_key_control(ctx: RunContext, entries: pd.DataFrame, layers: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the share of `MIXED_SETS` control sets labelled semantic, and the number of sets scored.

    A control set holds one random trigger prefix of each of k different keys of the layer (k = the
    calibration's set size): real trigger prefixes, with their positions and endings, but no key in
    common, so the share is a false-positive rate on this model's own data. NaN where a layer has fewer
    than k keys."""
    space, null = semantic_null(ctx)
    k = max(semantic.MIN_PREFIXES, min(ctx.top_k, 25))
    rng = np.random.default_rng([ctx.seed, 12])
    layer_of, key_of = entries["layer"].to_numpy(), entries["key"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (layer_of[1:] != layer_of[:-1]) | (key_of[1:] != key_of[:-1])])
    ends = np.r_[starts[1:], len(entries)]
    share, n_sets = np.full(len(layers), np.nan), np.zeros(len(layers), dtype=np.int64)
    ex_ids, pos = entries["example_id"].to_numpy(), entries["position"].to_numpy()
    for j, layer in enumerate(layers):
        mine = np.flatnonzero(layer_of[starts] == layer)
        if len(mine) < k:
            continue
        sets = []
        for _ in range(MIXED_SETS):
            chosen = rng.choice(mine, size=k, replace=False)
            rows = starts[chosen] + (rng.random(k) * (ends[chosen] - starts[chosen])).astype(np.int64)
            sets.append([ctx.prefix(ex_ids[r], pos[r]) for r in rows])
        z = semantic.score_sets(space, null, list(zip(sets, shared_suffixes(sets))))["z"]
        z = z[np.isfinite(z)]
        n_sets[j] = len(z)
        share[j] = float((z >= semantic.SEMANTIC_Z).mean()) if len(z) else np.nan
    return share, n_sets


# -------------------------------------------------------------- description
def corpus_document_frequency(ctx: RunContext) -> tuple[np.ndarray, int]:
    """Per token id, in how many examples of the corpus sample (`corpus_sample`) it occurs."""
    docs = corpus_sample(ctx)
    df = np.zeros(ctx.view.vocab_size + 1, dtype=np.int64)
    for tokens in docs:
        u = np.unique(tokens)
        df[u[(u >= 0) & (u < len(df))]] += 1
    return df, max(1, len(docs))


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
    try:  # as the explorer reads tokens: a word start keeps its space, whatever the tokenizer's marker
        text = "".join(sequence_strings(ctx.tokenizer, [int(i) for i in ids]))
    except Exception:  # noqa: BLE001
        text = "".join(ctx.tokens(ids))
    return repr(text.replace("\n", " "))


def _topic_words(ctx, prefixes, masked, special, doc_freq, n_docs) -> list[str]:
    if not len(prefixes):
        return []
    # Each token once per prefix body, counted over the prefixes (the same counts as a set per prefix): the distinct
    # (prefix, token) pairs of all the bodies at once.
    bodies = [np.asarray(p[: len(p) - m] if m else p, dtype=np.int64) for p, m in zip(prefixes, masked)]
    tokens = np.concatenate(bodies)
    which = np.repeat(np.arange(len(bodies), dtype=np.int64), [len(b) for b in bodies])
    width = int(tokens.max(initial=0)) + 1
    ids, numbers = np.unique(np.unique(which * width + tokens) % width, return_counts=True)
    words = ctx.once("topic words", dict)  # token id -> its stripped text, "" when it has no letter or digit
    scored = []
    for t, c in zip(ids.tolist(), numbers.tolist()):
        if c < 2 or t in special:
            continue
        text = words.get(t)
        if text is None:
            text = ctx.token(t).strip()
            text = words[t] = text if any(ch.isalnum() for ch in text) else ""
        if not text:
            continue
        idf = math.log((n_docs + 1) / (1 + doc_freq[t] if t < len(doc_freq) else 1))
        scored.append((-(c / len(prefixes)) * idf, t, text))
    scored.sort()
    return [repr(text) for _, _, text in scored[:TOPIC_WORDS]]


# ------------------------------------------------------------------ compute
#: The label of a key that no position of the indexed corpus activates (`ffkv.experiments.dead`).
DEAD = "dead"
#: A latent that fired in too few examples for a label (`latent_pattern_tables`).
RARE = "rare"


def label_of(shallow: bool, semantic: bool) -> str:
    return "both" if shallow and semantic else "shallow" if shallow else "semantic" if semantic else "none"


def key_labels(ctx: RunContext, control: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, np.ndarray]:
    """Shallow and semantic scores of every key (or random control memory), with its dead flag
    (`ffkv.experiments.dead`). Returns (per key, entries in (layer, key, rank) order, per entry whether the prefix
    is coherent with its key's others); labels come later (`label_keys`), once the control's cut-offs are known."""
    entries = suffix_table(ctx, control).sort_values(["layer", "key", "rank"]).reset_index(drop=True)
    per_key = shallow_scores(entries)
    scores, coherent = semantic_scores(ctx, entries, per_key,
                                       "semantic scores, random control" if control else "semantic scores")
    per_key = per_key.join(scores)
    dead = dead_keys(ctx, control)
    index = per_key.index
    per_key["dead"] = dead[index.get_level_values("layer").to_numpy(int), index.get_level_values("key").to_numpy(int)]
    return per_key, entries, coherent


def label_keys(per_key: pd.DataFrame, cutoff: np.ndarray) -> pd.DataFrame:
    """Labels: dead (never active over the indexed corpus), else shallow, semantic, both or none."""
    layer = per_key.index.get_level_values("layer").to_numpy(int)
    per_key = per_key.copy()
    per_key["semantic_cutoff"] = cutoff[layer]
    per_key["is_semantic"] = semantic_label(per_key["semantic_z"].to_numpy(float), cutoff[layer]) & ~per_key["dead"]
    per_key["is_shallow"] = per_key["is_shallow"].astype(bool) & ~per_key["dead"]
    per_key["label"] = [DEAD if d else label_of(a, b)
                        for a, b, d in zip(per_key["is_shallow"], per_key["is_semantic"], per_key["dead"])]
    return per_key


def pattern_tables(ctx: RunContext) -> dict[str, pd.DataFrame]:
    """Figure 2: every key labelled from its trigger prefixes (per key, per prefix, per layer, the control)."""
    per_key, entries, coherent = key_labels(ctx)
    L = ctx.view.n_layers
    control = None
    if ctx.has_control:
        c_key, _, _ = key_labels(ctx, control=True)
        control = c_key
    cutoff = control_cutoffs(None if control is None else control.reset_index(), L)
    per_key = label_keys(per_key, cutoff)
    if control is not None:
        control = label_keys(control, cutoff).reset_index()
        control["source_key"] = ctx.control_sources()[control["layer"].to_numpy(int), control["key"].to_numpy(int)]

    # Per prefix: ends with the shallow key's shared suffix; semantic when its key is and it is coherent with the rest.
    suffix = per_key["shared_suffix"].to_dict()
    tails = entries[["t1", "t2", "t3"]].to_numpy()
    shallow_key, semantic_key = per_key["is_shallow"].to_dict(), per_key["is_semantic"].to_dict()
    masked, prefix_shallow, prefix_semantic = [], [], []
    for i, (l, k) in enumerate(zip(entries["layer"].tolist(), entries["key"].tolist())):
        s = suffix[(l, k)]
        n = masked_length(tails[i], s)
        masked.append(n)
        prefix_shallow.append(bool(shallow_key[(l, k)]) and len(s) > 0 and n == len(s))
        prefix_semantic.append(bool(semantic_key[(l, k)]) and bool(coherent[i]))
    dead_entry = per_key["dead"].reindex(pd.MultiIndex.from_arrays([entries["layer"], entries["key"]])).to_numpy(bool)
    entries["prefix_label"] = [DEAD if d else label_of(a, b)
                               for a, b, d in zip(prefix_shallow, prefix_semantic, dead_entry)]

    doc_freq, n_docs = corpus_document_frequency(ctx)
    descriptions = []
    groups = entries.groupby(["layer", "key"], sort=False).indices
    masked = np.array(masked)
    largest = largest_coefficients(ctx)
    for key_row in per_key.itertuples():
        if key_row.dead:
            l, k = key_row.Index
            descriptions.append(f"never active over the indexed corpus (largest |m| {largest[l, k]:.3g}, "
                                f"at or below the active rule's {active_threshold(ctx)[l]:.3g})")
            continue
        rows = groups[key_row.Index]
        prefixes = [ctx.prefix(e, p) for e, p in zip(entries["example_id"].to_numpy()[rows], entries["position"].to_numpy()[rows])]
        descriptions.append(describe(ctx, key_row, prefixes, masked[rows].tolist(), doc_freq, n_docs))
    per_key["description"] = descriptions
    per_key["shared_suffix_text"] = [_show(ctx, list(s)) if s else "" for s in per_key["shared_suffix"]]
    per_key["shared_suffix"] = [list(s) for s in per_key["shared_suffix"]]
    keys = per_key.reset_index()
    keys = keys.astype({"layer": np.int16, "key": np.int32})
    keys["share_prefixes_shallow"] = entries.assign(v=np.array(prefix_shallow)).groupby(["layer", "key"])["v"].mean().to_numpy()
    keys["share_prefixes_semantic"] = entries.assign(v=np.array(prefix_semantic)).groupby(["layer", "key"])["v"].mean().to_numpy()
    cols = ["layer", "key", "label", "description", "shallow_score", "shallow_score_2", "shallow_score_3",
            "shared_suffix", "shared_suffix_text", "semantic_score", "mean_pairwise_cosine", "semantic_z", "semantic_p",
            "semantic_cutoff", "is_shallow", "is_semantic", "dead",
            "share_prefixes_shallow", "share_prefixes_semantic", "n_triggers", "n_embedded"]
    keys = keys[cols]
    prefixes = entries[["layer", "key", "rank", "example_id", "position", "prefix_label"]].astype(
        {"layer": np.int16, "key": np.int32, "rank": np.int16, "position": np.int32})
    per_layer = shares(keys, prefixes, L)
    per_layer["semantic_cutoff"] = cutoff
    cal = calibration(ctx)
    per_layer["semantic_recall"] = [float(np.mean(semantic_label(cal.z_topic, np.full(len(cal.z_topic), c))))
                                    if len(cal.z_topic) else np.nan for c in cutoff]
    per_layer["semantic_false_positives"] = [float(np.mean(semantic_label(cal.z_random, np.full(len(cal.z_random), c))))
                                             if len(cal.z_random) else np.nan for c in cutoff]
    if control is not None:
        per_layer = per_layer.merge(control_shares(keys, control, L), on="layer")
    per_layer["semantic_control"], per_layer["n_control_sets"] = mixed_key_control(ctx, entries, per_layer["layer"])
    result = {"keys": keys, "prefixes": prefixes, "per_layer": per_layer, "info": semantic_info(ctx)}
    if control is not None:
        result["control"] = control[["layer", "key", "source_key", "label", "shallow_score", "semantic_z",
                                     "semantic_cutoff", "is_shallow", "is_semantic", "dead"]].astype(
            {"layer": np.int16, "key": np.int32, "source_key": np.int32})
    return result


#: The labels that name a pattern: the measure on which the latents are set beside the neurons.
PATTERN_LABELS = ("shallow", "semantic", "both")


def latent_pattern_tables(ctx: RunContext, neuron_keys: pd.DataFrame, neuron_control: pd.DataFrame | None
                          ) -> dict[str, pd.DataFrame]:
    """Figure 2 for the latents of the dictionary the run was indexed with, labelled by the neurons' rules from
    their own trigger prefixes; the semantic cut-off of a layer is its control latents' (as random key directions
    are the neurons'). A latent that never fired has no trigger and is labelled dead; one that fired in fewer than
    min(`semantic.MIN_PREFIXES`, top-k) examples is labelled rare (too few prefixes for a shallow or semantic score:
    one prefix always "shares" its last token), and both are left out of the shares. Per layer the latents'
    shares beside their control's, and the measure set beside the neurons of the same layer: the share with a
    pattern (shallow, semantic or both) of each kind, each minus its own random-direction control, and the
    latents' excess minus the neurons' (95% interval: the MOVER combination of the two Newcombe intervals)."""
    latents = ctx.memories("latents")
    L = ctx.view.n_layers

    def scored(control: bool) -> pd.DataFrame:
        entries = suffix_table(ctx, control, "latents").sort_values(["layer", "key", "rank"]).reset_index(drop=True)
        per_key = shallow_scores(entries)
        label = "semantic scores, control latents" if control else "semantic scores, latents"
        if len(entries):  # none fired at all (every one dead): nothing to score
            per_key = per_key.join(semantic_scores(ctx, entries, per_key, label)[0])
        else:
            per_key = per_key.assign(semantic_z=np.nan)
        fired = per_key.index
        sizes = ({layer: len(src) for layer, src in ctx.latent_control_sources().items()} if control
                 else {layer: latents.size(layer) for layer in latents.layers})
        every = pd.MultiIndex.from_tuples([(layer, key) for layer, n in sizes.items() for key in range(n)],
                                          names=["layer", "key"])
        per_key = per_key.reindex(every)
        per_key["dead"] = ~every.isin(fired)
        per_key["n_triggers"] = per_key["n_triggers"].fillna(0).astype(int)
        per_key["is_shallow"] = per_key["is_shallow"].fillna(False).astype(bool)
        return per_key

    minimum = min(semantic.MIN_PREFIXES, ctx.top_k)
    columns = ["layer", "key", "label", "shallow_score", "semantic_z", "semantic_cutoff", "is_shallow", "is_semantic",
               "dead", "rare", "n_triggers"]

    def labelled(per_key: pd.DataFrame, cutoff: np.ndarray) -> pd.DataFrame:
        # A latent that fired in fewer than `minimum` examples has too few prefixes for a label (one prefix always
        # "shares" its last token): labelled rare and left out of the shares, as a dead one is.
        rare = (~per_key["dead"] & (per_key["n_triggers"] < minimum)).to_numpy()
        out = label_keys(per_key.assign(dead=per_key["dead"] | rare), cutoff).assign(dead=per_key["dead"], rare=rare)
        out.loc[rare, "label"] = RARE
        return out.reset_index()[columns].astype({"layer": np.int16, "key": np.int32})

    keys = scored(False)
    control = scored(True) if ctx.has_latent_control else None
    cutoff = control_cutoffs(None if control is None else control.reset_index().assign(
        dead=lambda t: t["dead"] | (t["n_triggers"] < minimum)), L)
    keys = labelled(keys, cutoff)
    judged = keys[~keys["rare"]]
    per_layer = shares(judged, None, L)
    per_layer["n_rare"] = keys.groupby("layer")["rare"].sum().reindex(per_layer["layer"]).fillna(0).astype(int).to_numpy()
    if control is not None:
        control = labelled(control, cutoff)
        control_judged = control[~control["rare"]]
        per_layer = per_layer.merge(control_shares(judged, control_judged, L), on="layer")
    else:
        control_judged = None
    per_layer = per_layer[per_layer["layer"].isin(latents.layers)].reset_index(drop=True)
    per_layer["semantic_cutoff"] = cutoff[per_layer["layer"].to_numpy(int)]
    rows = [_pattern_beside(layer, judged, control_judged, neuron_keys, neuron_control) for layer in per_layer["layer"]]
    return {"per_layer": per_layer.merge(pd.DataFrame(rows), on="layer"), "keys": keys}


def _pattern_beside(layer: int, keys: pd.DataFrame, control: pd.DataFrame | None, neuron_keys: pd.DataFrame,
                    neuron_control: pd.DataFrame | None) -> dict:
    """One layer: the share of live memories with a pattern for latents and neurons, each minus its own control,
    and the latents' excess minus the neurons' (MOVER: the two differences' intervals combined as Newcombe's are)."""
    def live(t: pd.DataFrame | None) -> np.ndarray:
        if t is None:
            return np.zeros(0, dtype=bool)
        g = t[(t["layer"] == layer) & ~t["dead"].astype(bool)]
        return np.isin(g["label"].to_numpy(), PATTERN_LABELS)

    row: dict = {"layer": int(layer)}
    for kind, mine, theirs in (("latents", live(keys), live(control)),
                               ("neurons", live(neuron_keys), live(neuron_control))):
        row.update(share_with_interval(mine, f"any_pattern_{kind}"))
        row[f"n_live_{kind}"] = int(len(mine))
        got = control_with_interval(mine, theirs, f"any_pattern_{kind}") if len(theirs) else {}
        row.update({f"any_pattern_{kind}_control": got.get(f"any_pattern_{kind}_control", np.nan),
                    f"any_pattern_{kind}_minus_control": got.get(f"any_pattern_{kind}_minus_control", np.nan),
                    f"any_pattern_{kind}_minus_control_ci_low": got.get(f"any_pattern_{kind}_minus_control_ci_low",
                                                                        np.nan),
                    f"any_pattern_{kind}_minus_control_ci_high": got.get(
                        f"any_pattern_{kind}_minus_control_ci_high", np.nan),
                    f"n_control_{kind}": int(len(theirs))})
    d1, l1, u1 = (row[f"any_pattern_latents_minus_control{s}"] for s in ("", "_ci_low", "_ci_high"))
    d2, l2, u2 = (row[f"any_pattern_neurons_minus_control{s}"] for s in ("", "_ci_low", "_ci_high"))
    d = d1 - d2
    row.update({"excess_latents_minus_neurons": d,
                "excess_latents_minus_neurons_ci_low": d - float(np.sqrt((d1 - l1) ** 2 + (u2 - d2) ** 2)),
                "excess_latents_minus_neurons_ci_high": d + float(np.sqrt((u1 - d1) ** 2 + (d2 - l2) ** 2))})
    return row


def control_shares(keys: pd.DataFrame, control: pd.DataFrame, n_layers: int) -> pd.DataFrame:
    """Per layer and label, the share of the random control memories with it beside the keys' share
    (`control_with_interval`: Newcombe's interval of the difference), live keys and memories only."""
    rows = []
    for layer in range(n_layers):
        k = keys[(keys["layer"] == layer) & ~keys["dead"]]["label"].to_numpy()
        c = control[(control["layer"] == layer) & ~control["dead"]]["label"].to_numpy()
        row = {"layer": layer, "n_control_keys": len(c),
               "n_control_dead": int(((control["layer"] == layer) & control["dead"]).sum())}
        for label in LABELS:
            got = control_with_interval(k == label, c == label, f"keys_{label}")
            row.update(got)
        # A key with a semantic pattern (semantic or both), the quantity the semantic label is calibrated on.
        row.update(control_with_interval(np.isin(k, ("semantic", "both")), np.isin(c, ("semantic", "both")),
                                         "keys_any_semantic"))
        row.update(control_with_interval(np.isin(k, ("shallow", "both")), np.isin(c, ("shallow", "both")),
                                         "keys_any_shallow"))
        rows.append(row)
    return pd.DataFrame(rows)


def shares(keys: pd.DataFrame, prefixes: pd.DataFrame | None, n_layers: int, label_column: str = "label") -> pd.DataFrame:
    """Per layer: share of the live keys (with its 95% Wilson interval over them) and of their trigger prefixes
    in each label; dead keys (label ``dead``) are left out and counted in ``n_dead``."""
    out = pd.DataFrame({"layer": np.arange(n_layers)})
    dead = keys.groupby("layer")[label_column].apply(lambda v: int((v == DEAD).sum()))
    out["n_dead"] = dead.reindex(out["layer"]).fillna(0).astype(int).to_numpy()
    keys = keys[keys[label_column] != DEAD]
    if prefixes is not None:
        prefixes = prefixes[prefixes["prefix_label"] != DEAD]
    k = keys.groupby("layer")[label_column].value_counts(normalize=True).unstack(fill_value=0.0)
    for label in LABELS:
        out[f"keys_{label}"] = k[label].reindex(out["layer"]).fillna(0.0).to_numpy() if label in k else 0.0
    if prefixes is not None:
        p = prefixes.groupby("layer")["prefix_label"].value_counts(normalize=True).unstack(fill_value=0.0)
        for label in LABELS:
            out[f"prefixes_{label}"] = p[label].reindex(out["layer"]).fillna(0.0).to_numpy() if label in p else 0.0
    out["n_keys"] = keys.groupby("layer").size().reindex(out["layer"]).fillna(0).astype(int).to_numpy()
    for label in LABELS:  # keys are the independent units; prefixes cluster within keys, so they get none
        low, high = wilson_interval(out[f"keys_{label}"] * out["n_keys"], out["n_keys"])
        out[f"keys_{label}_ci_low"], out[f"keys_{label}_ci_high"] = low, high
    return out


def draw(result: Result) -> Figures:
    """Figure 2 for the automatic labels (patterns) and, where the run holds human labels, for them
    (patterns_human)."""
    figures = {NAME: draw_labels(result.tables[NAME], result.n_layers)}
    if f"{NAME}_human" in result.tables:
        figures[f"{NAME}_human"] = draw_labels(result.tables[f"{NAME}_human"], result.n_layers, "human labels")
    if f"{NAME}_latents" in result.tables:
        figures[f"{NAME}_latents"] = kinds_beside(
            result.tables[f"{NAME}_latents"],
            (("neurons", "any_pattern_neurons", "any_pattern_neurons_control", None),
             ("latents", "any_pattern_latents", "any_pattern_latents_control", None)),
            "% live memories with a pattern\n(shallow, semantic or both)",
            "Neurons vs. the dictionary's latents (Fig. 2's labels), each beside its random directions")
    return figures


def draw_labels(per_layer: pd.DataFrame, L: int, title: str = "automatic labels"):
    """Figure 2 of one labelling: the label shares of live keys (and of trigger prefixes) per layer, beside the
    random key directions' where the table has them."""
    panels = [("keys", "% live keys")] + ([("prefixes", "% trigger prefixes")] if "prefixes_none" in per_layer else [])
    controlled = "keys_any_semantic_control" in per_layer
    import matplotlib.pyplot as plt

    # At most two panels in a row: the report and the explorer show a figure in one column and
    # `figures.legible` scales a wider figure's text up by its width, so three panels in a row collapse. With
    # both bar panels, the control gets a row of its own (a subfigure) below them.
    rows = 2 if len(panels) + controlled > 2 else 1
    fig = plt.figure(figsize=(4.6 * min(2, len(panels) + controlled), 3.8 * rows), layout="constrained")
    top, below = fig.subfigures(2, 1) if rows == 2 else (fig, fig)
    row = top.subplots(1, len(panels) + (controlled and rows == 1), squeeze=False)[0]
    axes = [list(row[:len(panels)])]
    x = per_layer["layer"].to_numpy()
    if controlled:  # each key-side share beside the random key directions of the same layer
        ax = row[-1] if rows == 1 else below.subplots()
        for kind, color in (("shallow", COLORS["shallow"]), ("semantic", COLORS["semantic"])):
            column = f"keys_any_{kind}"
            keys_share = 100 * (per_layer[f"keys_{kind}"] + per_layer["keys_both"]).to_numpy(float)
            ax.plot(x, keys_share, "o-", color=color, label=f"keys with a {kind} pattern")
            ax.plot(x, 100 * per_layer[f"{column}_control"], "--", marker="_", ms=10, color=color,
                    label=f"random key directions, {kind}")
            ax.fill_between(x, 100 * per_layer[f"{column}_control_ci_low"], 100 * per_layer[f"{column}_control_ci_high"],
                            color=color, alpha=0.15, lw=0)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% live keys / random directions")
        ax.set_title("Against random key directions", loc="left")
        layer_axis(ax, L)
        ax.legend(fontsize=7, frameon=False, loc="best")  # clear of the lines, wherever they run
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
    legend_outside(axes[0][0], ncol=4)  # the label colours of the bars
    return fig


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


def compute(ctx: RunContext, options=None) -> Result:
    """metrics/patterns (per layer), patterns_keys, patterns_prefixes, and patterns_control and patterns_human
    where the run holds a control and human labels."""
    found = pattern_tables(ctx)
    meta = {"shallow_share": SHALLOW_SHARE, "max_suffix": MAX_SUFFIX, **found["info"], "top_t": ctx.top_k,
            "labels": (f"dead: never active over the indexed corpus (left out of the shares; n_dead); shallow: "
                       f"shallow_score >= {SHALLOW_SHARE:g}; semantic: z >= {semantic.SEMANTIC_Z:g} (beyond random "
                       "corpus prefixes: z = (mean pairwise cosine of the prefixes' content-token embeddings - its "
                       "mean over random length-matched corpus prefixes) / its sd, calibrated on ffkv-tiny: "
                       f"{semantic.CALIBRATION_NOTE}) and z above semantic_cutoff, the {1 - CONTROL_PASS:.0%} "
                       "quantile of the z of the layer's random key directions (beyond what any linear read-out "
                       "of the residual gives: at most 5% of random directions pass)"),
            "control": (f"{ctx.manifest.control_keys} random key directions per layer (ffkv.memories.controls), "
                        "labelled by the same rule; *_minus_control: Newcombe's 95% interval of the difference"
                        if ctx.has_control else "none: the run holds no random-key control (index again); the "
                        "semantic label rests on the corpus null alone")}
    result = Result(ctx.view.n_layers, record=dict(meta))
    result.add(NAME, found["per_layer"], **meta)
    result.add(f"{NAME}_keys", found["keys"], **meta)
    result.add(f"{NAME}_prefixes", found["prefixes"], **meta)
    if "control" in found:
        result.add(f"{NAME}_control", found["control"], **meta)
    human = human_agreement(ctx, found["keys"])
    if human is not None:
        result.add(f"{NAME}_human", human, **meta)
    latents, unread = ctx.latents_for(f"{NAME}_latents")  # labelled by the same rules, beside the layer's neurons
    if unread:
        result.meta[NAME] = {**meta, "warnings": [*meta.get("warnings", []), *unread]}
    if latents is not None:
        latent = latent_pattern_tables(ctx, found["keys"], found.get("control"))
        meta_lat = {**meta, "memories": "the latents of the dictionary the run was indexed with (key: encoder "
                    "row; `ffkv.memories.sets.Latents`), only the layers it covers; dead: never fired; rare: fired in "
                    f"fewer than min({semantic.MIN_PREFIXES}, top-k) examples, too few to label",
                    "control": ("the control latents of each layer (ffkv.memories.latent_keys), labelled by the "
                                "same rule; their z sets the layer's semantic cut-off" if ctx.has_latent_control
                                else "none: the run holds no control latents"),
                    "beside_neurons": "any_pattern_*: share of live memories labelled shallow, semantic or "
                                      "both; *_minus_control: Newcombe's 95% interval; excess_latents_minus_"
                                      "neurons: the latents' excess over their control minus the neurons' "
                                      "(MOVER 95% interval)"}
        result.add(f"{NAME}_latents", latent["per_layer"], **meta_lat)
        result.add(f"{NAME}_latents_keys", latent["keys"], **meta_lat)
    return result


# ------------------------------------------------ patterns: the paper's findings, its reading and fidelity rules
#: Table or figure name -> the paper's finding shown beside it (exact names: `ffkv.experiments.registry`).
FINDINGS: dict[str, Finding] = {
    "patterns": Finding("Figure 2", (
        "Almost every key has a few clear patterns covering most of its top trigger examples; lower layers "
        "hold mostly shallow patterns (shared last word or n-gram), upper layers mostly semantic ones.")),
    "patterns_human": Finding("Figure 2", (
        "Experts labelled 10 random keys per layer: shallow patterns dominate the lower layers, semantic "
        "patterns the upper layers.")),
}
# The other tables and figures of the study stand beside the finding they belong to.
FINDINGS.update({
    "patterns_keys": FINDINGS["patterns"],
    "patterns_prefixes": FINDINGS["patterns"],
    "patterns_control": FINDINGS["patterns"],
})
FINDINGS["patterns_latents"] = Finding("Beyond the paper, beside Figure 2", (
    "The same labels for the latents of a sparse dictionary of the layer, each kind against its own random "
    "directions: do the latents' trigger examples share a pattern beyond their control more often than the "
    "neurons' do?"))
FINDINGS["patterns_latents_keys"] = FINDINGS["patterns_latents"]


def reading(name: str, table: pd.DataFrame) -> str | None:
    """Figure 2 on this model: the shallow and semantic shares of live keys in the first and last layers
    (n, 95% intervals), beside the random key directions; None for its other tables. Layers count from 1."""
    t, first, last, n_first, n_last = layer_ends(table)
    if name == "patterns" and "keys_shallow" in t:
        n = "n_keys" if "n_keys" in t else None

        def shares(row) -> str:
            return (f"{share_ci(row.keys_shallow + row.keys_both, row[n] if n else None)} of keys have a shallow "
                    f"pattern ({pct(row.keys_shallow)} shallow only, {pct(row.keys_both)} both) and "
                    f"{pct(row.keys_semantic + row.keys_both)} a semantic one ({pct(row.keys_semantic)} semantic "
                    f"only)")
        out = f"In this model, in {n_first}, {shares(first)}; in {n_last}, {shares(last)}"
        if "keys_any_semantic_control" in t:
            out += (f". Random key directions of the same layers: a shallow pattern in "
                    f"{pct(first.keys_any_shallow_control)} and {pct(last.keys_any_shallow_control)}, a semantic one "
                    f"in {pct(first.keys_any_semantic_control)} and {pct(last.keys_any_semantic_control)} (the "
                    "semantic label admits at most 5% of them by construction)")
        if "n_dead" in t and int(t["n_dead"].sum()):
            out += f"; {int(t['n_dead'].sum()):,} dead keys are left out"
        return out + "."
    if name == "patterns_latents" and "excess_latents_minus_neurons" in t:
        return " ".join(_latents_text(row) for row in t.itertuples(index=False))
    return None


def _latents_text(row) -> str:
    """One layer of patterns_latents in words: each kind's share with a pattern, beside its own random directions,
    and which kind stands higher against its control (`excess_verdict`), where the interval of the difference
    excludes 0."""
    def kind(name: str) -> str:
        share = share_ci(getattr(row, f"any_pattern_{name}"), getattr(row, f"n_live_{name}"))
        control = getattr(row, f"any_pattern_{name}_control")
        return f"{name} {share}" + (f" against {pct(control)} of their random directions"
                                    if np.isfinite(control) else " (no control)")
    low, high = row.excess_latents_minus_neurons_ci_low, row.excess_latents_minus_neurons_ci_high
    fewest = min(row.n_control_latents, row.n_control_neurons, row.n_live_latents, row.n_live_neurons)
    verdict = excess_verdict(low, high, fewest, judged="labelled")
    excess = (f"; excess over control, latents minus neurons {100 * row.excess_latents_minus_neurons:+.1f} points "
              f"[{100 * low:+.1f}, {100 * high:+.1f}]: {verdict}" if np.isfinite(row.excess_latents_minus_neurons)
              else "")
    return (f"Layer {int(row.layer) + 1}, memories with a pattern: {kind('latents')}; {kind('neurons')}"
            f"{excess}; {int(row.n_dead):,} latents never fired and {int(row.n_rare):,} fired too rarely for a "
            "label.")


def fidelity_rows(name: str, t: pd.DataFrame, projections: Mapping[str, str], label: str = "") -> list[dict]:
    """Figure 2's row of metrics/fidelity.parquet: the shallow share falls and the semantic share rises
    from layer 1 to the top layer, each above its random key directions (`ffkv.presentation.findings.verdict_row`)."""
    rows: list[dict] = []
    tt, L, first, last = rule_frame(t)
    if name == "patterns" and {"keys_shallow", "keys_semantic", "keys_both"} <= set(t.columns):
        sh = tt["keys_shallow"] + tt["keys_both"]
        se = tt["keys_semantic"] + tt["keys_both"]
        controlled = "keys_any_semantic_minus_control" in tt
        rule = ("the shallow share of live keys is larger in layer 1 than in the top layer, and the semantic share "
                "larger in the top layer than in layer 1")
        ok = bool(sh.iloc[0] > sh.iloc[-1] and se.iloc[-1] > se.iloc[0])
        chance, blocked = "", None
        if controlled:
            rule += (", and layer 1's shallow share and the top layer's semantic share each lie above their random "
                     "key directions' (95% interval of the difference above 0)")
            ok = ok and float(last["keys_any_semantic_minus_control_ci_low"]) > 0
            if "keys_any_shallow_minus_control_ci_low" in tt:
                ok = ok and float(first["keys_any_shallow_minus_control_ci_low"]) > 0
            chance = (f"random key directions: shallow {pct(first.keys_any_shallow_control)} (layer 1), semantic "
                      f"{pct(last.keys_any_semantic_control)} (layer {L}); layer 1's shallow share minus theirs "
                      f"{diff(first, 'keys_any_shallow', 'control')}, top layer's semantic share minus theirs "
                      f"{diff(last, 'keys_any_semantic', 'control')}")
        else:
            blocked = "no verdict: the run holds no random-key control (index again with ffkv's current version)"
        recall = float(last["semantic_recall"]) if "semantic_recall" in tt else math.nan
        if blocked is None and np.isfinite(recall) and recall < MIN_SEMANTIC_RECALL:
            blocked = (f"no verdict: on this corpus the semantic labeler finds only {pct(recall)} of planted topics "
                       f"at the top layer's cut-off (its calibration); a 'no' would say little")
        dead = f"; dead keys left out: {int(tt['n_dead'].sum()):,}" if "n_dead" in tt else ""
        rows.append(verdict_row(
            "patterns", "Figure 2",
            f"shallow keys (labelled shallow or both) {pct(sh.iloc[0])} (layer 1) -> {pct(sh.iloc[-1])} "
            f"(layer {L}); semantic "
            f"(semantic or both) {pct(se.iloc[0])} -> {pct(se.iloc[-1])}{dead}", rule, ok,
            n_of(tt, "n_keys"), chance, "live keys", blocked))
    return verdict_rows(rows, {k: f.finding for k, f in FINDINGS.items()}, name, projections.get(name, ""), label)



EXPERIMENT = Experiment(
    name=NAME, title="Patterns in the keys (paper Section 3.2)", section="paper Section 3.2, Figure 2", order=1,
    compute=compute, draw=draw,
    held_out=True,  # for the active rule's scale, which decides its dead keys (`ffkv.experiments.dead`)
    encoder=Encoder(True, "Figure 2", "computed on the trigger's left context x_1..x_j (shallow suffix, semantic "
                    "score); the encoder also reads the tokens after j, which these scores do not describe"),
    latents=("patterns_latents, patterns_latents_keys: Figure 2's labels for the latents' trigger prefixes, the "
             "share with a pattern of each kind minus its own random directions, and the difference"),
    findings=FINDINGS, fidelity_tables=(NAME,), fidelity=fidelity_rows, reading=reading, module=__name__)
