"""The census (SPEC section 9) on hand-built models whose answer is known, and against brute force.

Planted model: a small ReLU GPT-2 (width 64) whose layer 0 sees exactly wte[x] + wpe[j] (its
attention writes nothing). Tokens are random in dimensions 0-55 (the embedding is tied: these rows
are E too), every other token orthogonal to E[T], E[A] and E[B] (T 'a', A 'Q', B 'Z'); dimension 62 carries the
position (+1 at positions 0-2, -1 after). Keys of layer 0, after the block's LayerNorm:

    key 0: bias -10, no weights                -> never active: dead
    key 1: reads dimension 62                   -> active at positions 0-2 whatever the token: positional
    key 2: reads E[T]'s direction, bias -0.5    -> active exactly where the token is T: a detector,
           value -E[T]                              whose value pushes T down: an eraser
    key 3: value -(E[A] + E[B])                 -> suppression (two tokens, A 'Q' and B 'Z', pushed down)
    key 4: value E[A]                           -> prediction

Random values of the other layers, on the same unembedding, calibrate the thresholds: they are classed
neither, and no random key is an eraser.

The signed case reuses the gated model of test_signed_memories (constant coefficients): a key firing
with m < 0 writes -v_i, and its value type is read from -v_i.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from support.experiment_runs import make_run
from support.helpers import loaded_tiny
from ffkv.experiments import analyze
from ffkv.experiments import census
from ffkv.memories.active import active_fraction
from ffkv.memories.projection import logits
from ffkv.store.run import RunDir

import transformers as tf
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from support.helpers import CharTokenizer
from support.tiny_models import VOCAB

#: The planted GPT-2: residual width, token dimensions (0..TOKEN_DIMS-1), the position dimension.
D_PLANTED, TOKEN_DIMS, POSITION_DIM = 64, 56, 62


def planted_gpt2() -> tuple[LoadedModel, dict]:
    config = tf.GPT2Config(n_embd=D_PLANTED, n_layer=3, n_head=2, n_inner=40, n_positions=64, vocab_size=VOCAB,
                           bos_token_id=1, eos_token_id=2, activation_function="relu")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config).eval()
    tok = CharTokenizer()
    T, A, B = tok.encode("a")[0], tok.encode("Q")[0], tok.encode("Z")[0]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight  # tied: wte is E too
        wte.zero_()
        wte[:, :TOKEN_DIMS] = torch.randn(VOCAB, TOKEN_DIMS, generator=g) * 0.02
        for planted in (T, A, B):  # each orthogonal to every other token and to the all-ones vector (LN keeps it)
            wte[planted, :TOKEN_DIMS] -= wte[planted, :TOKEN_DIMS].mean()
            unit = wte[planted] / wte[planted].norm()
            others = torch.arange(VOCAB) != planted
            wte[others] -= (wte[others] @ unit)[:, None] * unit[None, :]
        k = wte[T] / wte[T].norm()
        wpe.zero_()
        wpe[:3, POSITION_DIM] = 1.0
        wpe[3:, POSITION_DIM] = -1.0
        block = model.transformer.h[0]
        block.attn.c_proj.weight.zero_()
        block.attn.c_proj.bias.zero_()
        view = MemoryView(model)
        K, b, V = view.keys(0), view.key_bias(0), view.values(0)
        for i in range(5):
            K[i].zero_()
            b[i] = 0.0
            V[i].zero_()
        b[0] = -10.0
        K[1, POSITION_DIM] = 1.0
        K[2], b[2] = k, -0.5
        E = view.unembedding
        V[2] = -E[T]
        V[3] = -(E[A] + E[B])
        V[4] = E[A]
    model.requires_grad_(False)
    loaded = LoadedModel(model, tok, MemoryView(model), "tiny-gpt2-planted", "float32", "cpu")
    return loaded, {"T": T, "A": A, "B": B}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    loaded, tokens = planted_gpt2()
    run, loaded = make_run(tmp_path_factory.mktemp("census"), "gpt2", n=160, loaded=loaded)
    analyze(run, only="census", loaded=loaded, n_eval=60, progress=False)
    return RunDir(run), loaded, tokens


def test_the_planted_model_is_relu():
    loaded, _ = planted_gpt2()
    assert active_fraction(loaded.view) == 0.0  # active is m > 0: the paper's rule


def test_each_planted_key_is_found_and_classed(planted):
    run, loaded, tokens = planted
    keys = run.read_metric("census")
    k = keys[keys["layer"] == 0].set_index("key")
    assert k.loc[0, "dead"] and k.loc[0, "class"] == "dead" and k.loc[0, "activation_frequency"] == 0
    assert k.loc[1, "class"] == "positional" and k.loc[1, "position_eta2"] >= 0.9
    assert k.loc[1, "rule_f1"] < census.DETECTOR_F1
    # The detector: exactly the positions whose token is T.
    assert k.loc[2, "class"] == "detector" and k.loc[2, "rule_n"] == 1 and k.loc[2, "rule_id"] == tokens["T"]
    assert k.loc[2, "rule_precision"] == 1.0 and k.loc[2, "rule_recall"] == 1.0 and k.loc[2, "rule_f1"] == 1.0
    assert k.loc[2, "rule"] == repr(loaded.tokenizer.token_strings([tokens["T"]])[0])
    assert k.loc[2, "eraser"] and k.loc[2, "trigger_z"] <= census.ERASER_Z and k.loc[2, "rule_sign"] == 1
    assert k.loc[2, "position_eta2"] < census.POSITIONAL_ETA2
    assert k.loc[3, "value_type"] == "suppression" and k.loc[3, "skew"] <= -census.SKEW_MIN
    assert k.loc[4, "value_type"] == "prediction" and k.loc[4, "skew"] >= census.SKEW_MIN
    # Calibration: the random keys of the model (GPT-2's init) are none of these; only planted keys erase.
    random_keys = keys[~((keys["layer"] == 0) & (keys["key"] < 5))]
    assert (random_keys["value_type"] == "neither").mean() >= 0.95
    assert not random_keys["eraser"].any()
    # Per layer: the planted layer's counts, with n and a Wilson interval.
    layers = run.read_metric("census_layers").set_index("layer")
    n = int(layers.loc[0, "n_keys"])
    assert layers.loc[0, "share_dead"] == pytest.approx((k["dead"]).sum() / n)
    assert layers.loc[0, "share_dead_ci_low"] <= layers.loc[0, "share_dead"] <= layers.loc[0, "share_dead_ci_high"]
    typical = run.read_metric("census_typical")
    first = typical[(typical["layer"] == 0) & (typical["category"] == "eraser")]
    assert first["key"].tolist()[:1] == [2]
    meta = run.metric_description("census")
    assert set(meta["thresholds"]) >= {"dead", "detector", "positional", "prediction", "suppression", "eraser"}
    assert meta["value_type_null_rate"]["prediction"] <= 0.05 and meta["value_type_null_rate"]["suppression"] <= 0.05
    assert (run.path / "figures" / "census.png").is_file() and (run.path / "figures" / "census_values.png").is_file()


def test_a_negative_firing_key_is_read_with_its_sign(tmp_path):
    """Gated model, constant coefficients (test_signed_memories): layer 1 key 1 fires with m = -2 and
    v = e2 - 2·e3, so it writes -v = -e2 + 2·e3 (token 3 pushed up: a prediction), though v as stored is a
    suppression; key 0 fires with m = +3 and v = e0 - 2·e1: a suppression."""
    from experiments.test_signed_memories import planted_model

    run, loaded = make_run(tmp_path, "llama", n=60, loaded=planted_model())
    analyze(run, only="census", loaded=loaded, n_eval=20, progress=False)
    k = RunDir(run).read_metric("census").set_index(["layer", "key"])
    assert k.loc[(1, 1), "firing_sign"] == -1 and k.loc[(1, 1), "negative_frequency"] == 1.0
    assert k.loc[(1, 1), "value_type"] == "prediction"
    assert k.loc[(1, 0), "firing_sign"] == 1 and k.loc[(1, 0), "value_type"] == "suppression"
    assert not k.loc[(1, 1), "two_way"]
    # Constant coefficients: position explains nothing.
    assert k.loc[(1, 0), "position_eta2"] == 0.0


# ------------------------------------------------------------------ brute force
def all_coefficients(loaded, held) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per example: token ids, and per layer (T, d_m) coefficients over every position (the brute force)."""
    view = loaded.view
    out = []
    for e in held.examples:
        ids = torch.as_tensor(np.asarray(e.token_ids), dtype=torch.long)[None]
        with view.capture(("coefficients",)) as cap:
            view.forward(ids, torch.ones_like(ids))
        out.append([cap["coefficients"][l][0].double().numpy() for l in range(view.n_layers)])
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_census_statistics_equal_brute_force(tmp_path, family):
    run, loaded = make_run(tmp_path, family, n=80)
    analyze(run, only="census", loaded=loaded, n_eval=40, progress=False)
    keys = RunDir(run).read_metric("census")
    from ffkv.experiments.common import RunContext, eval_spec, open_run

    _, manifest, _ = open_run(run, loaded)
    ctx = RunContext(RunDir(run), manifest, loaded, eval_spec=eval_spec(manifest, None, None, 40, 0), progress=False)
    held = ctx.held_out()
    view, V = loaded.view, loaded.view.vocab_size
    coeffs = all_coefficients(loaded, held)
    # Dead is decided over the whole indexed corpus: every position of every indexed example, run alone.
    indexed = [type("E", (), {"token_ids": t})() for t in pd.read_parquet(RunDir(run).table("examples"))["token_ids"]]
    corpus = all_coefficients(loaded, type("H", (), {"examples": indexed})())
    tau = active_fraction(view)
    for layer in range(view.n_layers):
        m = np.concatenate([c[layer] for c in coeffs])  # (N, d_m)
        N, d_m = m.shape
        pos = np.concatenate([np.arange(len(c[layer])) for c in coeffs])
        tokens = [np.asarray(e.token_ids) for e in held.examples]
        # s_l: the RMS of the coefficients at each example's analysed position, massive positions (RMS above 20 x
        # the median position's) left out.
        at = np.stack([c[layer][j] for c, j in zip(coeffs, held.positions)])
        rms = np.sqrt((at ** 2).mean(1))
        kept = rms[rms <= 20 * np.median(rms)]
        thr = tau * math.sqrt((kept ** 2).mean()) if tau else 0.0
        act = np.abs(m) > thr
        special_ids = list(getattr(loaded.tokenizer, "special_ids", ()) or ())
        everywhere = np.concatenate([c[layer][~np.isin(np.asarray(e.token_ids), special_ids)]
                                     for c, e in zip(corpus, indexed)])
        # Strong: where the prefix competes for trigger examples (no special token), against the largest |m| there.
        special = list(getattr(loaded.tokenizer, "special_ids", ()) or ())
        competes = np.concatenate([~np.isin(np.asarray(e.token_ids), special) for e in held.examples])
        assert competes.all() if family == "gpt2" else not competes.all()  # the llama examples start with BOS
        strong = act & competes[:, None] & (np.abs(m) >= census.STRONG_SHARE * np.abs(m[competes]).max(0))
        got = keys[keys["layer"] == layer].set_index("key")
        np.testing.assert_allclose(got["activation_frequency"], act.mean(0), atol=1e-6)
        np.testing.assert_allclose(got["strong_frequency"], strong.mean(0), atol=1e-6)
        assert 0 < strong.mean() < act.mean()  # the rules below are tested against a set that is neither
        np.testing.assert_allclose(got["negative_frequency"], (act & (m < 0)).mean(0), atol=1e-6)
        assert (got["dead"].to_numpy() == ~(np.abs(everywhere) > thr).any(0)).all()
        # Adjusted eta² by groups of position.
        G = sorted(set(pos))
        total = ((m - m.mean(0)) ** 2).sum(0)
        within = sum(((m[pos == g] - m[pos == g].mean(0)) ** 2).sum(0) for g in G)
        eps2 = np.clip(1 - (within / (N - len(G))) / (total / (N - 1)), 0, 1)
        np.testing.assert_allclose(got["position_eta2"], eps2, atol=1e-4)
        # Every unigram and bigram rule, exactly.
        rules = {1: np.concatenate(tokens), 2: np.concatenate([np.r_[-1, t[:-1] * V + t[1:]] for t in tokens])}
        for key in range(d_m):
            a = strong[:, key]
            best, best_n, best_id = 0.0, 0, -1
            for n in (1, 2):
                r = rules[n]
                for rid in np.unique(r[r >= 0]):
                    on = r == rid
                    f1 = 2 * (on & a).sum() / (on.sum() + a.sum())
                    if f1 > best + 1e-12:
                        best, best_n, best_id = f1, n, rid
            row = got.loc[key]
            if best >= 2 / (census.CANDIDATES + 1):  # the summary's guarantee: found exactly
                assert row["rule_f1"] == pytest.approx(best, abs=1e-6), (layer, key)
            on = rules[int(row["rule_n"])] == int(row["rule_id"]) if row["rule_n"] else None
            if on is not None:  # whatever rule was reported, its numbers are exact
                assert row["rule_precision"] == pytest.approx((on & a).sum() / on.sum(), abs=1e-6)
                assert row["rule_recall"] == pytest.approx((on & a).sum() / max(a.sum(), 1), abs=1e-6)
                assert row["rule_hits"] == (on & a).sum()
        # Skew and kurtosis of the written vector's logits.
        sign = np.where(got["firing_sign"].to_numpy() < 0, -1.0, 1.0)
        z = logits(view, torch.as_tensor(sign[:, None], dtype=torch.float32) * view.values(layer), "identity")
        z = z.double().numpy()
        c = z - z.mean(1, keepdims=True)
        var = (c ** 2).mean(1)
        np.testing.assert_allclose(got["skew"], (c ** 3).mean(1) / var ** 1.5, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(got["kurtosis"], (c ** 4).mean(1) / var ** 2 - 3, rtol=1e-3, atol=1e-3)
        # The rule's last token in what the key writes where the rule holds (its own sign there).
        rsign = np.where(got["rule_sign"].to_numpy() < 0, -1.0, 1.0)
        zr = logits(view, torch.as_tensor(rsign[:, None], dtype=torch.float32) * view.values(layer), "identity")
        zr = zr.double().numpy()
        has = got["rule_n"].to_numpy() > 0
        last = got["rule_id"].to_numpy() % V
        expected = (zr[np.arange(d_m), last] - zr.mean(1)) / zr.std(1)
        np.testing.assert_allclose(got["trigger_z"].to_numpy()[has], expected[has], rtol=1e-3, atol=1e-3)


def test_position_share_is_calibrated_on_noise_and_planted_positions():
    """Coefficients that ignore position score about 0 (the adjusted eta² removes the small-sample bias that
    plain eta², (G-1)/(n-1), would have), coefficients set by position score about 1."""
    rng = np.random.default_rng(0)
    n, d_m = 400, 500
    pos = torch.as_tensor(rng.integers(0, 40, n))
    acc = census.CensusAccumulator(1, d_m, 10, [0.0])
    noise = torch.as_tensor(rng.normal(size=(n, d_m)))
    noise[:, 0] = torch.where(pos < 3, 2.0, 0.0) + 0.1 * noise[:, 0]  # key 0: fires at positions 0-2
    acc.feed("scale", 0, noise, pos, {})
    eta2 = acc.key_table(0)["position_eta2"].to_numpy()
    assert eta2[0] >= 0.9
    assert np.quantile(eta2[1:], 0.99) < 0.2 and (eta2[1:] >= census.POSITIONAL_ETA2).sum() == 0


def test_a_key_active_everywhere_is_a_detector_of_where_it_fires_strongly():
    """As gated keys are: key 0 is active at every position (about 0.3), and fires at 2 exactly where the token
    is 7. Against activity, the token rule's F1 is 2·P·R/(P + R) with R = P(7) = 0.1: far below the threshold;
    against strong activations (at least half the largest |m_i|) it is 1. Key 1 fires everywhere at one level:
    strong wherever active, so no rule of ten tokens reaches it. Key 2 fires strongly at the only 4 positions of
    token 10: its rule is perfect but an anecdote (fewer than DETECTOR_MIN_HITS), not a detector."""
    rng = np.random.default_rng(0)
    n, vocab = 2000, 11
    tokens = torch.as_tensor(rng.integers(0, vocab - 1, n))
    tokens[[5, 50, 500, 1500]] = 10
    m = torch.as_tensor(rng.normal(size=(n, 3)))
    m[:, 0] = 0.3 + 0.05 * m[:, 0] + 2.0 * (tokens == 7)
    m[:, 1] = -1.0
    m[:, 2] = 0.3 + 0.05 * m[:, 2] + 2.0 * (tokens == 10)
    acc = census.CensusAccumulator(1, 3, vocab, [0.1 * float(m.square().mean().sqrt())])  # tau·s_l, s_l = RMS
    pos = torch.arange(n) % 40
    for step in ("scale", "summarise", "count"):
        for part in torch.arange(n).split(500):  # batch by batch, as the passes feed it
            acc.feed(step, 0, m[part], pos[part], {} if step == "scale" else {1: tokens[part]})
    k = acc.key_table(0)
    on = (tokens == 7).numpy()
    assert k.loc[0, "activation_frequency"] == 1.0
    assert 2 * on.mean() / (1 + on.mean()) < census.DETECTOR_F1  # the F1 the token would get against activity
    assert k.loc[0, "strong_frequency"] == pytest.approx(on.mean())
    assert k.loc[0, "rule_n"] == 1 and k.loc[0, "rule_id"] == 7 and k.loc[0, "rule_f1"] == 1.0
    assert k.loc[1, "strong_frequency"] == 1.0 and k.loc[1, "rule_f1"] < census.DETECTOR_F1
    assert k.loc[1, "rule_sign"] == -1
    assert k.loc[2, "rule_id"] == 10 and k.loc[2, "rule_f1"] == 1.0 and k.loc[2, "rule_hits"] == 4
    k["skew"] = k["kurtosis"] = k["trigger_z"] = 0.0
    assert census.classify(k)["class"].tolist() == ["detector", "other", "other"]


def test_the_summary_keeps_every_frequent_rule():
    """Misra-Gries merge, batch by batch, against exact counts: a rule with more than n/(k+1) hits is kept, and
    no kept count exceeds the true count or falls more than n/(k+1) below it."""
    rng = np.random.default_rng(0)
    k, d_m = 4, 3
    ids = torch.full((d_m, k), -1, dtype=torch.long)
    counts = torch.zeros(d_m, k, dtype=torch.float64)
    truth = np.zeros((d_m, 50))
    for _ in range(30):
        rules = torch.as_tensor(rng.choice(50, size=40, p=np.r_[[0.3, 0.2], np.full(48, 0.5 / 48)]))
        active = torch.as_tensor(rng.random((40, d_m)) < [0.9, 0.5, 0.1])
        unique, (hit,), _ = census._batch_counts(rules, [active])
        for row in range(d_m):
            np.add.at(truth[row], rules.numpy(), active[:, row].numpy())
        ids, counts = census.merge_summary(ids, counts, unique, hit, k)
    for row in range(d_m):
        n = truth[row].sum()
        kept = {int(i): float(c) for i, c in zip(ids[row], counts[row]) if i >= 0}
        for rule in np.flatnonzero(truth[row] > n / (k + 1)):
            assert int(rule) in kept
        for rule, c in kept.items():
            assert truth[row, rule] - n / (k + 1) - 1e-9 <= c <= truth[row, rule] + 1e-9


def test_float32_comparisons_are_the_float64_ones():
    """The active and strong rules read float32 coefficients as float64 would: thresholds between two float32
    values, on one, at 0, and coefficients just either side of each."""
    rng = np.random.default_rng(0)
    t64 = np.r_[0.0, 0.1, 1 / 3, 1.0, 0.5 * np.float32(0.7), rng.random(200)]
    f32 = t64.astype(np.float32)
    near = np.concatenate([f32, np.nextafter(f32, np.float32(np.inf)), np.nextafter(f32, np.float32(0)),
                           rng.random(200).astype(np.float32), np.float32([0, np.inf])])
    a = torch.as_tensor(near)[:, None].expand(-1, len(t64))
    for j, t in enumerate(t64):
        assert torch.equal(census._above(a[:, j], float(t)), a[:, j].double() > float(t))
    h = torch.as_tensor(t64)
    assert torch.equal(census._at_least(a, h), a.double() >= h)


def _merge_reference(ids, counts, unique, batch, k):
    """merge_summary as first written: the (d_m, k + U) id matrix built whole."""
    batch = batch.double().clone()
    where, there = census._lookup(unique, ids)
    counts = counts + torch.where(there, batch.gather(1, where), torch.zeros_like(counts))
    rows, slots = torch.nonzero(there, as_tuple=True)
    batch[rows, where[rows, slots]] = 0
    all_ids = torch.cat([ids, unique[None, :].expand(ids.shape[0], -1)], dim=1)
    all_counts = torch.cat([counts, batch], dim=1)
    all_counts = torch.where(all_ids >= 0, all_counts, torch.zeros_like(all_counts))
    top, index = torch.topk(all_counts, k + 1, dim=1)
    kept = top[:, :k] - top[:, k:k + 1]
    new_ids = all_ids.gather(1, index[:, :k])
    alive = kept > 0
    return torch.where(alive, new_ids, torch.full_like(new_ids, -1)), torch.where(alive, kept, torch.zeros_like(kept))


def test_the_summary_and_counts_are_those_of_the_dense_float64_sums():
    """Rule counts from the strong entries alone equal the dense float64 sums, and the merge keeps the same ids in
    the same slots as the whole-matrix merge, ties included (integer counts tie often)."""
    rng = np.random.default_rng(1)
    k, d_m = 4, 40
    ids = torch.full((d_m, k), -1, dtype=torch.long)
    counts = torch.zeros(d_m, k, dtype=torch.float64)
    ref_ids, ref_counts = ids.clone(), counts.clone()
    for _ in range(40):
        rules = torch.as_tensor(rng.integers(-1, 12, size=60))
        strong = torch.as_tensor(rng.random((60, d_m)) < 0.2)
        unique, (hit,), support = census._batch_counts(rules, [strong])
        valid = rules >= 0
        dense = torch.zeros(d_m, len(unique), dtype=torch.float64)
        dense.index_add_(1, torch.searchsorted(unique, rules[valid]), strong[valid].T.double())
        assert torch.equal(hit.double(), dense) and torch.equal(unique, torch.unique(rules[valid]))
        assert torch.equal(support, torch.bincount(torch.searchsorted(unique, rules[valid])).double())
        ids, counts = census.merge_summary(ids, counts, unique, hit, k)
        ref_ids, ref_counts = _merge_reference(ref_ids, ref_counts, unique, dense, k)
        assert torch.equal(ids, ref_ids) and torch.equal(counts, ref_counts)
