"""The semantic score of a key (docs/definitions.md): are its trigger prefixes closer in meaning than chance?

Not circular: a prefix is represented by the model's *input token embeddings* of its content
tokens, never by a residual stream (a key's trigger prefixes share the key's direction in the
residual by construction). The trigger token and the key's shared suffix are always left out, so
surface overlap at the end of the prefixes cannot count as meaning.

- **Content tokens**: tokens with a letter or digit that are neither special nor among the corpus's
  most frequent tokens (those that together make `STOP_MASS` of the corpus's tokens: "the", "and",
  ...). Each counts once per prefix.
- **Prefix vector**: the mean of the unit, centred input embeddings of the content tokens of the
  prefix's *body* (the prefix without its trigger token, the part of the shared suffix it ends with,
  and `CONTEXT` tokens before them), centred on the mean of random corpus bodies of its kind (below)
  and scaled to unit length.
- **Score**: S, the mean pairwise cosine of a key's prefix vectors. Its null distribution is that of
  random corpus prefixes of the same kinds: the same body length bin (where a prefix ends shapes which
  words it holds, e.g. names right after the start of a verse), or, for a prefix that ends with the
  key's shared suffix, random corpus prefixes that end with that suffix (what comes before a given
  ending is not random: "the children of" ...). The null mean and variance of S for the key's own
  mix of kinds come exactly from the moments of random bodies per kind (a U-statistic: `NullMoments`),
  so every key of every layer is scored without simulating random sets per key.
- **Label**: semantic when z = (S - E[S]) / sd(S) >= `SEMANTIC_Z`, a cut-off set by calibration on
  planted ground truth (`calibrate`): sets of random corpus prefixes (false positives), sets that
  share only a suffix (must stay below the same rate), and sets with a planted topic (recall).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: Tokens that together make this share of the corpus's tokens are stop tokens, not content.
STOP_MASS = 0.5
#: Body-length bins (tokens before the trigger/suffix): bin b holds lengths in [EDGES[b], EDGES[b+1]).
LENGTH_EDGES = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65)
#: Random corpus bodies drawn per length bin for the null (bins with fewer are merged downwards).
POOL_PER_BIN = 300
MIN_PER_BIN = 40
#: Token embeddings wider than this are randomly projected to it (cosines kept, Johnson-Lindenstrauss).
MAX_DIMS = 256
#: Fewer content-bearing prefixes than this: no semantic score.
MIN_PREFIXES = 5
#: Tokens left out before the trigger token and shared suffix, besides them: the local n-gram context
#: (calibration: leaving out 0, 1, 2 tokens gave 38%, 24%, 17% false positives on suffix-only sets at z >= 2.5
#: against a length-matched null alone).
CONTEXT = 2
#: Random corpus prefixes per shared suffix for the suffix-matched null.
SUFFIX_POOL = 200
#: The cut-off on z, from `calibrate` on ffkv-tiny's input embeddings and 3,000 seeded random verses of its
#: training corpus (CorpusSpec(embedded_corpus("train"), unit="line", shuffle_seed=0, max_examples=3000); sets
#: of 25 prefixes, 400 of each kind, seed 0; `build_null(docs, space, 0)`). False positives on random sets /
#: on sets sharing only a suffix, recall on planted co-occurrence topics, precision at equal numbers of the
#: three kinds:
#:   z >= 1.645: 8.5% / 14.7%, recall 92.0%, precision 79.9%
#:   z >= 2.5:   2.5% /  5.7%, recall 84.0%, precision 91.2%
#:   z >= 3:     1.5% /  2.1%, recall 79.2%, precision 95.7%   <- chosen: both false-positive rates under 5%
#:   z >= 4:     0.5% /  0.5%, recall 68.8%, precision 98.5%
#: (Against a length-matched null alone, without the suffix-matched kinds, suffix-only sets reached 9.8% at z >= 3.)
#: A second planted topic, passages: 25 prefixes of 25 of 50 consecutive training verses (random ends, 400 sets,
#: seed 5): recall 95.8% at z >= 2.5, 94.0% at z >= 3, 86.8% at z >= 4.
SEMANTIC_Z = 3.0
CALIBRATION_NOTE = ("z >= 3: 1.5% false positives on random sets (n=400), 2.1% on suffix-only sets (n=389), "
                    "recall 79.2% on planted co-occurrence topics (n=400), precision 95.7%")


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm > 0, norm, 1)


def length_bin(lengths: np.ndarray) -> np.ndarray:
    """The `LENGTH_EDGES` bin of each body length (lengths below 1 go to bin 0)."""
    return np.clip(np.searchsorted(LENGTH_EDGES, np.asarray(lengths), side="right") - 1, 0, len(LENGTH_EDGES) - 1)


@dataclass(frozen=True)
class ContentSpace:
    """Unit, centred input embeddings of the content tokens (zero rows for the other tokens).

    Attributes:
        vectors: (V, D) float32.
        content: (V,) bool, which tokens are content tokens.
    """

    vectors: np.ndarray
    content: np.ndarray

    @classmethod
    def build(cls, embeddings: np.ndarray, token_counts: np.ndarray, special: Sequence[int],
              is_word: np.ndarray, seed: int = 0) -> "ContentSpace":
        """From input embeddings (V, d), corpus token counts (V,), special ids and a has-a-letter-or-digit mask.

        Stop tokens: the most frequent tokens that together make `STOP_MASS` of the counted tokens.
        Tokens never seen in the counted corpus are kept as content (their frequency is unknown).
        """
        V = embeddings.shape[0]
        counts = np.zeros(V, dtype=np.float64)
        counts[: min(V, len(token_counts))] = np.asarray(token_counts, dtype=np.float64)[:V]
        order = np.argsort(-counts, kind="stable")
        total = counts.sum()
        n_stop = int(np.searchsorted(np.cumsum(counts[order]) / total, STOP_MASS) + 1) if total > 0 else 0
        content = np.asarray(is_word, dtype=bool)[:V].copy()
        content[order[:n_stop]] = False
        special = [int(s) for s in special if 0 <= int(s) < V]
        content[special] = False
        e = np.asarray(embeddings, dtype=np.float32)
        if e.shape[1] > MAX_DIMS:
            rng = np.random.default_rng([seed, 7])
            e = e @ (rng.standard_normal((e.shape[1], MAX_DIMS)).astype(np.float32) / math.sqrt(MAX_DIMS))
        weights = counts[content] + 1.0
        centre = (e[content] * weights[:, None]).sum(0) / weights.sum() if content.any() else 0.0
        vectors = _unit(e - centre).astype(np.float32)
        vectors[~content] = 0
        return cls(vectors, content)

    def bodies(self, prefixes: Sequence[np.ndarray], drops: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mean content vector of each prefix's body (the prefix without its last `drop` tokens, drop >= 1).

        Returns (vectors (n, D), body lengths (n,), content counts (n,)); rows with no content are zero.
        """
        n, V = len(prefixes), len(self.content)
        lengths = np.array([max(0, len(p) - max(1, int(d))) for p, d in zip(prefixes, drops)], dtype=np.int64)
        out = np.zeros((n, self.vectors.shape[1]), dtype=np.float32)
        if not n or not lengths.sum():
            return out, lengths, np.zeros(n, dtype=np.int64)
        flat = np.concatenate([np.asarray(p[:m], dtype=np.int64) for p, m in zip(prefixes, lengths)])
        rows = np.repeat(np.arange(n, dtype=np.int64), lengths)
        ok = (flat >= 0) & (flat < V)
        flat, rows = flat[ok], rows[ok]
        keep = self.content[flat]
        pairs = np.unique(rows[keep] * V + flat[keep])  # each content token once per prefix, rows ascending
        rows, tokens = pairs // V, pairs % V
        counts = np.bincount(rows, minlength=n)
        if len(pairs):
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
            out[rows[starts]] = np.add.reduceat(self.vectors[tokens], starts, axis=0) / counts[rows[starts], None]
        return out, lengths, counts


@dataclass(frozen=True)
class Category:
    """Random corpus bodies of one kind (a length bin, or the bodies of prefixes ending with one suffix).

    Attributes:
        centre: mean of the raw body vectors, removed from every vector of this kind before scaling to unit.
        n: how many unit vectors the moments below come from.
        mean: (D,) their mean. second: (D, D) their mean outer product.
    """

    centre: np.ndarray
    n: int
    mean: np.ndarray
    second: np.ndarray

    @classmethod
    def of(cls, vectors: np.ndarray) -> "Category":
        centre = vectors.mean(0)
        x = _unit(vectors - centre).astype(np.float64)
        return cls(centre, len(x), x.mean(0), x.T @ x / len(x))


def _matrices(cats: Sequence[Category]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Between kinds a, b, c: the mean E_ab and variance V_ab of the cosine of two independent unit
    vectors, and the covariance C_abc of two cosines that share a vector of kind b (unbiased for a == b)."""
    m = np.stack([c.mean for c in cats])
    n = np.array([c.n for c in cats], dtype=np.float64)
    second = np.stack([c.second for c in cats])
    E = m @ m.T
    flat = second.reshape(len(cats), -1)
    T = flat @ flat.T  # E[(x.y)^2] = tr(M_a M_b) (M symmetric)
    d = np.maximum(n * (n - 1), 1)
    E[np.diag_indices(len(cats))] = (n ** 2 * np.diag(E) - n) / d  # leave out the n self-pairs (x.x = 1)
    T[np.diag_indices(len(cats))] = (n ** 2 * np.diag(T) - n) / d
    V = np.maximum(T - E ** 2, 0)
    C = np.stack([m @ s @ m.T for s in second], axis=1) - E[:, :, None] * E[None, :, :]  # m_a M_b m_c - E_ab E_bc
    return E, V, C


def _moments(E: np.ndarray, V: np.ndarray, C: np.ndarray, bin_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, sd) of S, the mean pairwise cosine of a set drawn independently with these counts per kind."""
    n = np.asarray(bin_counts, dtype=np.float64)
    k = n.sum(1)
    pairs = np.maximum(k * (k - 1) / 2, 1)
    sum_e = (np.einsum("ka,ab,kb->k", n, E, n) - n @ np.diag(E)) / 2
    sum_v = (np.einsum("ka,ab,kb->k", n, V, n) - n @ np.diag(V)) / 2
    # Pairs of pairs sharing one prefix i (kind b): ordered (j, k), j != k, both != i; with n' = n - e_b the
    # count of kinds (a, c) is n'_a n'_c - [a == c] n'_a.
    full = np.einsum("ka,abc,kc->kb", n, C, n)
    same = np.einsum("ka,aba->kb", n, C)
    own = np.einsum("bbc,kc->kb", C, n) + np.einsum("ka,abb->kb", n, C)
    triple = np.einsum("bbb->b", C)[None, :]
    ordered = full - own + triple - (same - triple)
    var = (sum_v + (n * ordered).sum(1)) / pairs ** 2
    return sum_e / pairs, np.sqrt(np.maximum(var, 1e-12))


class NullMoments:
    """Null moments of S, the mean pairwise cosine of a key's prefix vectors, for prefixes drawn at random
    from the corpus with the same body lengths and, for a key with a shared suffix, with the same endings.

    Random corpus bodies, split into kinds (`Category`): one per body-length bin (bins with fewer than
    `MIN_PER_BIN` bodies are merged into the one below), and, per shared suffix asked for, the bodies of
    random corpus prefixes that end with that suffix (or its last 1 or 2 tokens; `SUFFIX_POOL` of each,
    where the corpus sample has at least `MIN_PER_BIN`). A key's prefix is of the suffix kind of the
    ending it shares, else of its length bin. Each vector is centred on its kind's mean and scaled to unit
    length; the exact mean and variance of S for the key's mix of kinds follow (a U-statistic).
    """

    def __init__(self, vectors: np.ndarray, lengths: np.ndarray, counts: np.ndarray,
                 suffix_bodies=None) -> None:
        has = counts > 0
        vectors, bins = vectors[has], length_bin(lengths[has])
        bin_map = np.arange(len(LENGTH_EDGES))
        for b in range(len(LENGTH_EDGES) - 1, 0, -1):
            if (bin_map[bins] == b).sum() < MIN_PER_BIN:
                bin_map[bin_map == b] = b - 1
        used = np.unique(bin_map[bins])
        if not len(used) or (bin_map[bins] == used[0]).sum() < 3:
            raise ValueError("too few random corpus prefixes with content tokens for the semantic null")
        index = {int(b): i for i, b in enumerate(used)}
        self.bin_map = np.array([index.get(int(b), 0) for b in bin_map])
        g = self.bin_map[bins]
        self.categories = [Category.of(vectors[g == i]) for i in range(len(used))]
        self.n_pool = int(len(vectors))
        self.base = _matrices(self.categories)
        #: suffix (tuple of token ids) -> its bodies' vectors (None where too rare); from `suffix_bodies(suffix)`.
        self.suffix_bodies = suffix_bodies
        self._suffix: dict[tuple, Category | None] = {}
        self._extended: dict[tuple, tuple] = {}

    @property
    def centres(self) -> np.ndarray:
        return np.stack([c.centre for c in self.categories])

    def bins(self, lengths: np.ndarray) -> np.ndarray:
        return self.bin_map[length_bin(lengths)]

    def unit_vectors(self, vectors: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Centre each body vector on its length bin's random mean and scale it to unit length."""
        return _unit(vectors - self.centres[self.bins(lengths)])

    def suffix_category(self, suffix: tuple) -> Category | None:
        if suffix not in self._suffix:
            v = self.suffix_bodies(suffix) if self.suffix_bodies is not None and suffix else None
            self._suffix[suffix] = Category.of(v) if v is not None and len(v) >= MIN_PER_BIN else None
        return self._suffix[suffix]

    def kinds(self, suffix: tuple, lengths: np.ndarray, masked: np.ndarray) -> tuple[list[Category], np.ndarray]:
        """The kinds of a key's prefixes (length bins, then the suffix kinds that exist), and each prefix's kind.

        masked: how many of each prefix's last tokens are the key's shared suffix (its last `masked` tokens).
        """
        cats = list(self.categories)
        kind = self.bins(lengths).copy()
        for m in range(1, len(suffix) + 1):
            cat = self.suffix_category(tuple(suffix[len(suffix) - m:]))
            if cat is not None and (masked == m).any():
                cats.append(cat)
                kind[masked == m] = len(cats) - 1
        return cats, kind

    def matrices(self, suffix: tuple, cats: list[Category]) -> tuple:
        if len(cats) == len(self.categories):
            return self.base
        key = (suffix, len(cats), tuple(id(c) for c in cats[len(self.categories):]))
        if key not in self._extended:
            self._extended[key] = _matrices(cats)
        return self._extended[key]

    def moments(self, bin_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sd) of S for sets of length-bin prefixes with these counts per bin ((K, B) -> (K,), (K,))."""
        return _moments(*self.base, bin_counts)


def set_statistics(x: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For consecutive segments of unit rows: each segment's mean pairwise cosine, and each row's mean
    cosine to the other rows of its segment (NaN for segments of fewer than 2 rows)."""
    n = len(x)
    if not n:
        return np.zeros(0), np.zeros(0)
    sums = np.add.reduceat(x, starts, axis=0)
    sizes = np.diff(np.r_[starts, n])
    within = np.where(sizes > 1, ((sums * sums).sum(1) - sizes) / np.maximum(sizes * (sizes - 1), 1), np.nan)
    seg = np.repeat(np.arange(len(starts)), sizes)
    row = np.where(sizes[seg] > 1, ((x * sums[seg]).sum(1) - 1) / np.maximum(sizes[seg] - 1, 1), np.nan)
    return within, row


def z_scores(null: NullMoments, x: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
    """Per segment of length-bin prefixes (unit vectors from `NullMoments.unit_vectors`): S, its null
    mean, z and the number of prefixes; per row its mean cosine to the others. (`score_sets` is the labeler.)"""
    within, row = set_statistics(x, starts)
    sizes = np.diff(np.r_[starts, len(x)])
    counts = np.zeros((len(starts), len(null.categories)))
    if len(x):
        np.add.at(counts, (np.repeat(np.arange(len(starts)), sizes), null.bins(lengths)), 1)
    mean, sd = null.moments(counts)
    z = np.where(sizes >= MIN_PREFIXES, (within - mean) / sd, np.nan)
    return {"S": within, "mean": mean, "z": z, "n": sizes, "row": row}


def masked_length(prefix_tail: np.ndarray, suffix: tuple) -> int:
    """How many of the prefix's last tokens belong to the key's shared suffix (its longest common end).

    prefix_tail: the prefix's last tokens, last first; suffix: in text order."""
    n = 0
    for a, b in zip(prefix_tail, reversed(suffix)):
        if a != b:
            break
        n += 1
    return n


def score_sets(space: ContentSpace, null: NullMoments, sets: Sequence[tuple[Sequence[np.ndarray], tuple]]
               ) -> dict[str, np.ndarray]:
    """The semantic score of prefix sets, each (its prefixes, its shared suffix; () for none).

    Each prefix's body leaves out its trigger token, the part of the shared suffix it ends with and
    `CONTEXT` tokens before them. Returns per set S (mean pairwise cosine), its null mean, z (NaN below
    `MIN_PREFIXES` content-bearing prefixes) and n (those prefixes); per prefix, in order, ``row``: its
    mean cosine to the set's other prefixes (NaN without content).
    """
    out = {name: np.full(len(sets), np.nan) for name in ("S", "mean", "z")}
    out["n"] = np.zeros(len(sets), dtype=np.int64)
    rows = []
    for i, (prefixes, suffix) in enumerate(sets):
        suffix = tuple(int(t) for t in suffix)
        masked = np.array([masked_length(np.asarray(p)[::-1][:len(suffix)], suffix) for p in prefixes], dtype=np.int64)
        vectors, lengths, counts = space.bodies(prefixes, (np.maximum(masked, 1) + CONTEXT).tolist())
        keep = counts > 0
        row = np.full(len(prefixes), np.nan)
        k = int(keep.sum())
        out["n"][i] = k
        if k >= 2:
            cats, kind = null.kinds(suffix, lengths[keep], masked[keep])
            centres = np.stack([c.centre for c in cats])
            x = _unit(vectors[keep] - centres[kind])
            within, per_row = set_statistics(x, np.array([0]))
            row[keep] = per_row
            out["S"][i] = within[0]
            mean, sd = _moments(*null.matrices(suffix, cats), np.bincount(kind, minlength=len(cats))[None, :])
            out["mean"][i] = mean[0]
            if k >= MIN_PREFIXES:
                out["z"][i] = (within[0] - mean[0]) / sd[0]
        rows.append(row)
    out["row"] = np.concatenate(rows) if rows else np.zeros(0)
    return out


def suffix_sampler(docs: Sequence[np.ndarray], space: ContentSpace, seed: int):
    """`suffix(tokens) -> body vectors` of up to `SUFFIX_POOL` random corpus prefixes ending with those tokens
    (None where the corpus sample has fewer than `MIN_PER_BIN`), bodies as `score_sets` cuts them."""
    # Every (document, position >= 1) in document order, then position order, grouped by the token there.
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]) if len(docs) else np.zeros(0, np.int64)
    doc_of = np.repeat(np.arange(len(docs), dtype=np.int64), lengths)
    pos_of = np.arange(len(flat), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    at = np.flatnonzero(pos_of >= 1)
    at = at[np.argsort(flat[at], kind="stable")]
    tokens, starts = np.unique(flat[at], return_index=True)
    where = dict(zip(tokens.tolist(), np.split(at, starts[1:]))) if len(at) else {}

    def bodies(suffix: tuple) -> np.ndarray | None:
        m = len(suffix)
        hits = where.get(int(suffix[-1]), np.zeros(0, np.int64))
        hits = hits[pos_of[hits] >= m]  # the suffix's first token at a position >= 1
        for back in range(1, m):
            hits = hits[flat[hits - back] == int(suffix[m - 1 - back])]
        if len(hits) < MIN_PER_BIN:
            return None
        rng = np.random.default_rng([seed, 11, *[int(t) for t in suffix]])
        pick = rng.choice(len(hits), size=min(SUFFIX_POOL, len(hits)), replace=False)
        prefixes = [docs[doc_of[hits[j]]][: pos_of[hits[j]] + 1] for j in pick]
        v, _, counts = space.bodies(prefixes, [m + CONTEXT] * len(prefixes))
        v = v[counts > 0]
        return v if len(v) >= MIN_PER_BIN else None

    return bodies


def normal_sf(z: np.ndarray) -> np.ndarray:
    """One-sided p-value of z under a standard normal."""
    return np.array([0.5 * math.erfc(v / math.sqrt(2)) if np.isfinite(v) else math.nan for v in np.ravel(z)])


# ------------------------------------------------------------ random prefixes
def random_bodies(docs: Sequence[np.ndarray], space: ContentSpace, seed: int,
                  per_bin: int = POOL_PER_BIN, drop: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random corpus prefixes, `per_bin` per body-length bin (as far as the corpus has them), embedded
    as bodies (trigger token left out): (vectors, body lengths, content counts)."""
    rng = np.random.default_rng([seed, 4])
    sizes = np.array([len(d) for d in docs])
    prefixes = []
    for b, lo in enumerate(LENGTH_EDGES):
        hi = LENGTH_EDGES[b + 1] if b + 1 < len(LENGTH_EDGES) else int(sizes.max(initial=0))
        long_enough = np.flatnonzero(sizes >= lo + drop)
        if not len(long_enough):
            break
        for d in rng.choice(long_enough, size=per_bin):
            length = int(rng.integers(lo, max(lo, min(hi - 1, sizes[d] - drop)) + 1))
            prefixes.append(np.asarray(docs[d][: length + drop]))
    return space.bodies(prefixes, [drop] * len(prefixes))


def build_null(docs: Sequence[np.ndarray], space: ContentSpace, seed: int) -> NullMoments:
    """The null of `score_sets` from a corpus sample: length bins and, on demand, shared suffixes."""
    return NullMoments(*random_bodies(docs, space, seed, drop=1 + CONTEXT),
                       suffix_bodies=suffix_sampler(docs, space, seed))


# -------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Calibration:
    """The labeler on planted ground truth (`calibrate`): shares of sets labelled semantic.

    Attributes:
        fpr_random: random corpus prefix sets labelled semantic (false positives). Each share is NaN where
            the corpus is too small to build that kind of set.
        fpr_suffix: sets sharing only a planted suffix labelled semantic (false positives).
        recall: sets with a planted topic labelled semantic.
        precision: planted-topic sets among all sets labelled semantic, at equal numbers of planted-topic,
            random and suffix-only sets.
        n_random, n_suffix, n_topic: sets of each kind (those with at least `MIN_PREFIXES` scored prefixes).
        cutoff: the z cut-off applied.
        z_random, z_suffix, z_topic: the z of every set, to see the margins.
    """

    fpr_random: float
    fpr_suffix: float
    recall: float
    precision: float
    n_random: int
    n_suffix: int
    n_topic: int
    cutoff: float
    z_random: np.ndarray
    z_suffix: np.ndarray
    z_topic: np.ndarray

    def at(self, cutoff: float) -> "Calibration":
        """The same sets scored with another cut-off."""
        return _summarise(self.z_random, self.z_suffix, self.z_topic, cutoff)

    def line(self) -> str:
        return (f"z >= {self.cutoff:g}: false positives {100 * self.fpr_random:.1f}% of random sets "
                f"(n={self.n_random}), {100 * self.fpr_suffix:.1f}% of suffix-only sets (n={self.n_suffix}); "
                f"recall {100 * self.recall:.1f}% of planted-topic sets (n={self.n_topic}); "
                f"precision {100 * self.precision:.1f}%")


def _summarise(z_random, z_suffix, z_topic, cutoff) -> Calibration:
    def share(z):
        return float((z >= cutoff).mean()) if len(z) else math.nan
    fr, fs, rc = share(z_random), share(z_suffix), share(z_topic)
    positives = rc + (0 if math.isnan(fr) else fr) + (0 if math.isnan(fs) else fs)
    return Calibration(fr, fs, rc, rc / positives if positives > 0 else math.nan, len(z_random), len(z_suffix),
                       len(z_topic), cutoff, z_random, z_suffix, z_topic)


def cooccurrence_topics(docs: Sequence[np.ndarray], space: ContentSpace, n_topics: int, seed: int,
                        size: int = 8, min_docs: int = 5, min_together: int = 3,
                        max_tokens: int = 3000) -> list[list[int]]:
    """Topics built from the corpus alone: a seed content token and the content tokens of highest NPMI
    with it (document co-occurrence, at least `min_together` documents together), `size` tokens each."""
    rng = np.random.default_rng([seed, 8])
    present = [np.unique(d[space.content[np.clip(d, 0, len(space.content) - 1)] & (d >= 0) & (d < len(space.content))])
               for d in docs]
    df = np.zeros(len(space.content), dtype=np.int64)
    for p in present:
        df[p] += 1
    vocab = np.flatnonzero(df >= min_docs)
    vocab = vocab[np.argsort(-df[vocab], kind="stable")][:max_tokens]
    col = np.full(len(space.content), -1)
    col[vocab] = np.arange(len(vocab))
    X = np.zeros((len(docs), len(vocab)), dtype=np.float32)
    for i, p in enumerate(present):
        c = col[p]
        X[i, c[c >= 0]] = 1
    together = X.T @ X
    n = len(docs)
    pw = np.diag(together) / n
    pj = np.maximum(together / n, 1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        npmi = np.log(pj / np.outer(pw, pw)) / -np.log(pj)
    npmi[together < min_together] = -1
    np.fill_diagonal(npmi, -1)
    topics = []
    for s in rng.permutation(len(vocab)):
        partners = np.argsort(-npmi[s], kind="stable")[: size - 1]
        if (npmi[s, partners] > 0).sum() < size - 1:
            continue
        topics.append([int(vocab[s])] + [int(vocab[p]) for p in partners])
        if len(topics) == n_topics:
            break
    return topics


def calibrate(docs: Sequence[np.ndarray], space: ContentSpace, null: NullMoments, shared_suffixes, k: int = 25,
              n_sets: int = 400, seed: int = 0, cutoff: float = SEMANTIC_Z) -> Calibration:
    """The labeler on planted ground truth from a corpus (token lists, each starting where a prefix may start).

    - random sets: k prefixes of k random documents, each ending at a random position (no topic);
    - suffix-only sets: k prefixes of different documents that all end with one token (a frequent
      content or stop token), otherwise random: surface form only, no topic;
    - planted-topic sets: k prefixes, each from a document holding a word of one co-occurrence topic
      (`cooccurrence_topics`; the words taken in turn, so no one word is shared by all), ending at a
      random position after that word.

    `shared_suffixes(sets)` gives each set's shared suffix as the labeler finds it for a key (`score_sets`
    leaves it out). Random draws use `seed`, and differ from those of the null.
    """
    rng = np.random.default_rng([seed, 9])
    docs = [np.asarray(d, dtype=np.int64) for d in docs if len(d) >= 3]

    def z_of(sets: list[list[np.ndarray]]) -> np.ndarray:
        if not sets:
            return np.zeros(0)
        z = score_sets(space, null, list(zip(sets, shared_suffixes(sets))))["z"]
        return z[np.isfinite(z)]

    def random_prefix(d: np.ndarray, after: int = 0) -> np.ndarray:
        return d[: int(rng.integers(after + 1, len(d))) + 1]

    random_sets = [[random_prefix(docs[i]) for i in rng.choice(len(docs), size=k, replace=False)]
                   for _ in range(n_sets if len(docs) >= k else 0)]
    # Suffix-only: the end token is drawn by its frequency among prefix ends with >= 2k occurrences.
    where: dict[int, list[tuple[int, int]]] = {}
    for i, d in enumerate(docs):
        for p in range(1, len(d)):
            where.setdefault(int(d[p]), []).append((i, p))
    ends = [t for t, occ in where.items() if len({i for i, _ in occ}) >= 2 * k]
    weights = np.array([len(where[t]) for t in ends], dtype=np.float64)
    suffix_sets = []
    for t in rng.choice(ends, size=n_sets, p=weights / weights.sum()) if ends else []:
        by_doc = {}
        for i, p in where[int(t)]:
            by_doc.setdefault(i, p)
        chosen = rng.choice(sorted(by_doc), size=k, replace=False)
        suffix_sets.append([docs[i][: by_doc[i] + 1] for i in chosen])
    def first_in_doc(w: int) -> dict[int, int]:
        first: dict[int, int] = {}
        for i, p in where.get(w, []):
            if p < len(docs[i]) - 1:
                first.setdefault(i, p)
        return first

    topics = cooccurrence_topics(docs, space, n_sets, seed)
    topic_sets = []
    for t in range(n_sets if topics else 0):
        words = topics[t % len(topics)]
        holders = {w: list(first_in_doc(w).items()) for w in words}
        prefixes, used = [], set()
        for j in range(k * 4):
            w = words[j % len(words)]
            options = [(i, q) for i, q in holders[w] if i not in used]
            if not options:
                continue
            i, q = options[int(rng.integers(len(options)))]
            used.add(i)
            prefixes.append(random_prefix(docs[i], q))
            if len(prefixes) == k:
                break
        if len(prefixes) == k:
            topic_sets.append(prefixes)
    return _summarise(z_of(random_sets), z_of(suffix_sets), z_of(topic_sets), cutoff)
