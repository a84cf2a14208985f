"""The semantic labeler (SPEC 4): exact null moments, what a prefix's body holds, and its calibration on
planted ground truth with ffkv-tiny (a test that fails when the cut-off is broken)."""

from __future__ import annotations

import numpy as np
import pytest

import ffkv
from ffkv.corpus import CorpusSpec, iter_examples
from ffkv.experiments import semantic
from ffkv.experiments.patterns import cohen_kappa, shared_suffixes
from ffkv.experiments.semantic import CONTEXT
from ffkv.models import load_model


def hand_space(V: int = 12, D: int = 6) -> semantic.ContentSpace:
    """Token t has the unit vector e_(t mod D); tokens 0-1 are not content."""
    vectors = np.zeros((V, D), dtype=np.float32)
    vectors[np.arange(V), np.arange(V) % D] = 1
    content = np.ones(V, dtype=bool)
    content[:2] = False
    vectors[~content] = 0
    return semantic.ContentSpace(vectors, content)


def test_body_leaves_out_the_end_stop_tokens_and_repeats():
    space = hand_space()
    prefixes = [np.array([0, 2, 3, 3, 1, 4]), np.array([0, 5, 4]), np.array([0, 4])]
    vectors, lengths, counts = space.bodies(prefixes, [1, 2, 1])
    # Prefix 0: body [0, 2, 3, 3, 1] -> content {2, 3}; the trigger token 4 is left out.
    np.testing.assert_allclose(vectors[0], (space.vectors[2] + space.vectors[3]) / 2)
    assert counts.tolist() == [2, 0, 0] and lengths.tolist() == [5, 1, 1]
    assert not vectors[1].any() and not vectors[2].any()  # [0] only: nothing to pool


def test_shared_suffixes_of_sets():
    prefixes = [np.r_[10 + 10 * i + np.arange(6), 7, 8] for i in range(6)]  # all end with the bigram (7, 8) only
    lone = [np.r_[10 + 10 * i + np.arange(6), 100 + i] for i in range(6)]  # no shared ending
    assert shared_suffixes([prefixes, lone]) == [(7, 8), ()]


def synthetic_pool(seed=0, n=4000, lengths=(1, 40)):
    """Random body vectors with a length-dependent mean direction (as real prefixes have); large bins, so
    that drawing a set from the pool without replacement is as good as independent draws."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice(lengths, size=n)
    vectors = rng.standard_normal((n, 8)) + 0.8 * (lengths >= 9)[:, None] * np.eye(8)[0]
    return vectors.astype(np.float32), lengths, np.ones(n, dtype=np.int64)


def test_null_moments_equal_brute_force():
    vectors, lengths, counts = synthetic_pool()
    null = semantic.NullMoments(vectors, lengths, counts)
    x = null.unit_vectors(vectors, lengths)
    bins = null.bins(lengths)
    rng = np.random.default_rng(1)
    # A set of 20 prefixes: 12 from the shortest bin, 8 from the longest.
    lo, hi = np.flatnonzero(bins == bins.min()), np.flatnonzero(bins == bins.max())
    draws = []
    for _ in range(20000):
        pick = np.r_[rng.choice(lo, 12, replace=False), rng.choice(hi, 8, replace=False)]
        s = x[pick].sum(0)
        draws.append((s @ s - 20) / (20 * 19))
    draws = np.array(draws)
    profile = np.zeros((1, len(null.centres)))
    profile[0, bins.min()], profile[0, bins.max()] = 12, 8
    mean, sd = null.moments(profile)
    assert mean[0] == pytest.approx(draws.mean(), abs=4 * draws.std() / np.sqrt(len(draws)))
    assert sd[0] == pytest.approx(draws.std(), rel=0.05)


def test_z_scores_per_segment():
    vectors, lengths, counts = synthetic_pool(lengths=(1, 3, 6, 40))
    null = semantic.NullMoments(vectors, lengths, counts)
    x = null.unit_vectors(vectors[:30], lengths[:30])
    x[10:20] = x[10]  # segment 1: ten identical prefixes
    got = semantic.z_scores(null, x, lengths[:30], np.array([0, 10, 20, 27]))
    assert got["S"][1] == pytest.approx(1.0)
    assert got["z"][1] > 10 and abs(got["z"][0]) < 4
    assert np.isnan(got["z"][3])  # 3 prefixes: fewer than MIN_PREFIXES
    brute = [np.mean([x[i] @ x[j] for j in range(10, 20) if j != i]) for i in range(10, 20)]
    np.testing.assert_allclose(got["row"][10:20], brute, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_calibration():
    loaded = load_model("ffkv-tiny")
    tok = loaded.tokenizer
    E = loaded.view.model.get_input_embeddings().weight.detach().float().numpy()
    spec = CorpusSpec(source=str(ffkv.embedded_corpus("train")), unit="line", shuffle_seed=1, max_examples=1500)
    docs = [np.asarray(e.token_ids, dtype=np.int64) for e in iter_examples(spec, tok)]
    counts = np.bincount(np.concatenate(docs), minlength=E.shape[0])
    is_word = np.array([any(c.isalnum() for c in s) for s in tok.token_strings(list(range(E.shape[0])))])
    space = semantic.ContentSpace.build(E, counts, sorted(tok.special_ids), is_word)
    null = semantic.build_null(docs, space, 1)
    cal = semantic.calibrate(docs, space, null, shared_suffixes, k=25, n_sets=80, seed=1)
    return cal, docs, space, null, tok


def acceptable(cal: semantic.Calibration) -> bool:
    """The labeler's contract: few false positives on random and suffix-only sets, most planted topics found."""
    return cal.fpr_random <= 0.05 and cal.fpr_suffix <= 0.10 and cal.recall >= 0.5


def test_calibration_on_planted_ground_truth(tiny_calibration):
    cal = tiny_calibration[0]
    assert cal.n_random == 80 and cal.n_topic >= 70 and cal.n_suffix >= 70
    assert cal.cutoff == semantic.SEMANTIC_Z
    assert acceptable(cal), cal.line()
    # A broken cut-off fails the same contract: at 0 half the random sets are "semantic", far too strict finds nothing.
    assert not acceptable(cal.at(0.0)) and cal.at(0.0).fpr_random > 0.2
    assert not acceptable(cal.at(12.0)) and cal.at(12.0).recall < 0.5


def test_a_shared_topical_suffix_is_not_semantic(tiny_calibration):
    cal, docs, space, null, tok = tiny_calibration
    rng = np.random.default_rng(3)
    ending = np.array(tok.encode(" the burnt offering of the altar"), dtype=np.int64)
    bodies = [docs[i][: int(rng.integers(3, len(docs[i])))] for i in rng.choice(len(docs), 25, replace=False)]
    prefixes = [np.r_[b, ending] for b in bodies]
    suffix = shared_suffixes([prefixes])[0]
    assert suffix == tuple(ending[-3:])  # the longest shared ending looked for: 3 tokens
    z = semantic.score_sets(space, null, [(prefixes, suffix)])["z"][0]
    assert z < semantic.SEMANTIC_Z  # the shared ending and the 2 tokens before it are left out: random bodies
    # Kept in, the shared ending alone would make the set "semantic" (a length-matched null, trigger left out).
    v, lengths, counts = space.bodies(prefixes, [1] * len(prefixes))
    kept = semantic.z_scores(null, null.unit_vectors(v, lengths), lengths, np.array([0]))["z"][0]
    assert kept > 3 * semantic.SEMANTIC_Z


def test_the_trigger_token_is_left_out(tiny_calibration):
    cal, docs, space, null, tok = tiny_calibration
    moses = tok.encode(" Moses")[-1]
    assert space.content[moses]
    rng = np.random.default_rng(4)
    bodies = [docs[i][: int(rng.integers(3, len(docs[i])))] for i in rng.choice(len(docs), 25, replace=False)]
    with_trigger = semantic.score_sets(space, null, [([np.r_[b, moses] for b in bodies], ())])
    # Scoring the prefixes without their trigger (and one fewer context token) gives the same bodies.
    v, _, _ = space.bodies([np.r_[b, moses] for b in bodies], [1 + CONTEXT] * 25)
    v1, _, _ = space.bodies(bodies, [CONTEXT] * 25)
    np.testing.assert_array_equal(v, v1)
    assert with_trigger["z"][0] < semantic.SEMANTIC_Z  # the shared trigger word does not make the set semantic


def test_cohen_kappa_by_hand():
    # 10 keys: agreement 3 + 4 = 7/10; human shares s .4 n .6, auto s .5 n .5 -> expected .4*.5 + .6*.5 = .5
    human = np.array(["shallow"] * 4 + ["none"] * 6)
    auto = np.array(["shallow"] * 3 + ["none"] + ["shallow"] * 2 + ["none"] * 4)
    assert cohen_kappa(human, auto) == pytest.approx((0.7 - 0.5) / (1 - 0.5))


def test_suffix_sampler_draws_from_exactly_the_corpus_prefixes_that_end_with_the_suffix():
    """Brute force: every (document, position) whose last len(suffix) tokens are the suffix (its first token at
    position 1 or later), in document then position order; the sampler's seeded draw picks from that list."""
    from ffkv.experiments.semantic import CONTEXT, MIN_PER_BIN, SUFFIX_POOL, suffix_sampler

    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 5, size=rng.integers(1, 30)) for _ in range(2000)]

    class Recording:  # a content space whose body vector is the prefix itself, read back exactly
        def bodies(self, prefixes, drops):
            assert drops == [len(suffix) + CONTEXT] * len(prefixes)
            drawn.append([tuple(int(t) for t in p) for p in prefixes])
            return np.ones((len(prefixes), 1), np.float32), None, np.ones(len(prefixes), dtype=np.int64)

    sample = suffix_sampler(docs, Recording(), seed=3)
    checked = 0
    for suffix in [(0,), (4,), (1, 2), (3, 3), (2, 0, 1), (4, 4, 4, 4)]:
        drawn = []
        hits = [(i, p) for i, d in enumerate(docs) for p in range(len(suffix), len(d))
                if tuple(int(t) for t in d[p - len(suffix) + 1: p + 1]) == suffix]
        got = sample(suffix)
        if len(hits) < MIN_PER_BIN:
            assert got is None and not drawn
            continue
        pick = np.random.default_rng([3, 11, *suffix]).choice(len(hits), size=min(SUFFIX_POOL, len(hits)),
                                                              replace=False)
        assert drawn == [[tuple(int(t) for t in docs[hits[j][0]][: hits[j][1] + 1]) for j in pick]]
        checked += 1
    assert checked >= 4
