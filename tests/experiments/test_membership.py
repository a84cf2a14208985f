"""Membership signal: the AUC and its DeLong interval against brute force over every pair, a planted
membership whose AUC is known, identical splits giving exactly 0.5, the split of every example recorded,
and the refusal when a model's training split is unknown."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ffkv import cli
from ffkv.errors import FfkvError
from ffkv.experiments import analyze
from ffkv.experiments.scoring import score_examples
from ffkv.presentation.findings import Z95
from ffkv.presentation.intervals import auc_difference_interval, auc_interval, paired_mean_interval
from ffkv.store.run import RunDir
from ffkv.models import loading
from support import tiny_cli
from support.experiment_runs import make_run


def brute_auc(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """AUC and DeLong interval from the m x n matrix of pair comparisons, no ranks."""
    psi = (x[:, None] > y[None, :]).astype(float) + 0.5 * (x[:, None] == y[None, :])
    auc = psi.mean()
    v10, v01 = psi.mean(1), psi.mean(0)
    se = np.sqrt(v10.var(ddof=1) / len(x) + v01.var(ddof=1) / len(y))
    return auc, max(0.0, auc - Z95 * se), min(1.0, auc + Z95 * se)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_and_delong_interval_match_pairwise_brute_force(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 12, size=37).astype(float) + 1.5  # ties inside and across the groups
    y = rng.integers(0, 12, size=53).astype(float)
    auc, low, high = auc_interval(x, y)
    b_auc, b_low, b_high = brute_auc(x, y)
    assert auc == pytest.approx(b_auc, abs=1e-12)
    assert (low, high) == (pytest.approx(b_low, abs=1e-12), pytest.approx(b_high, abs=1e-12))
    assert low < auc < high


@pytest.mark.parametrize("seed", [0, 1])
def test_paired_auc_difference_matches_pairwise_brute_force(seed):
    """The difference of two AUCs of the same examples and its paired DeLong interval, from the two m x n matrices of
    pair comparisons: Var = s²(V10_a - V10_b)/m + s²(V01_a - V01_b)/n; the same score twice differs by exactly 0."""
    rng = np.random.default_rng(seed)
    xa, ya = rng.integers(0, 9, size=41).astype(float) + 1.0, rng.integers(0, 9, size=29).astype(float)
    xb, yb = xa + rng.normal(0, 2, size=41), ya + rng.normal(0, 2, size=29)  # correlated with a: pairing matters
    psi = lambda x, y: (x[:, None] > y[None, :]) + 0.5 * (x[:, None] == y[None, :])  # noqa: E731
    pa_, pb_ = psi(xa, ya), psi(xb, yb)
    diff = pa_.mean() - pb_.mean()
    se = np.sqrt((pa_.mean(1) - pb_.mean(1)).var(ddof=1) / 41 + (pa_.mean(0) - pb_.mean(0)).var(ddof=1) / 29)
    got = auc_difference_interval(xa, ya, xb, yb)
    assert got == (pytest.approx(diff, abs=1e-12), pytest.approx(diff - Z95 * se, abs=1e-12),
                   pytest.approx(diff + Z95 * se, abs=1e-12))
    assert got[0] == pytest.approx(auc_interval(xa, ya)[0] - auc_interval(xb, yb)[0], abs=1e-12)
    assert auc_difference_interval(xa, ya, xa, ya) == (0.0, 0.0, 0.0)
    assert np.isnan(auc_difference_interval(xa, ya, xb[:-1], yb)[0])  # rows that do not pair


def test_auc_known_cases():
    assert auc_interval(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == (1.0, 1.0, 1.0)
    assert auc_interval(np.array([1.0, 2.0]), np.array([3.0, 4.0]))[0] == 0.0
    assert auc_interval(np.ones(5), np.ones(7))[0] == 0.5
    assert np.isnan(auc_interval(np.array([]), np.ones(3))[0])


def test_paired_mean_interval_by_hand():
    d = np.array([1.0, 2.0, 3.0, 6.0])
    mean, low, high = paired_mean_interval(d)
    half = Z95 * np.std(d, ddof=1) / 2.0
    assert (mean, low, high) == (3.0, pytest.approx(3.0 - half), pytest.approx(3.0 + half))


def test_scoring_nll_matches_the_model_logits(tmp_path):
    """The per-example mean NLL equals cross-entropy from the model's own forward pass."""
    _, loaded = make_run(tmp_path / "r", n=10)
    ids = [np.array(loaded.tokenizer.encode(t)) for t in ("the cat sat on", "a dog", "red mat far away x")]
    scores = score_examples(loaded, ids, coefficients=True)
    for row, t in enumerate(ids):
        with torch.no_grad():
            z = loaded.model(input_ids=torch.as_tensor(t)[None]).logits[0].float()
        expected = torch.nn.functional.cross_entropy(z[:-1], torch.as_tensor(t[1:])).item()
        assert scores.nll[row] == pytest.approx(expected, rel=1e-5)
        assert scores.n_predicted[row] == len(t) - 1
        with loaded.view.capture(("coefficients",)) as cap:
            loaded.view.forward(torch.as_tensor(t)[None])
        for layer in range(loaded.view.n_layers):
            m = cap["coefficients"][layer][0].abs()
            expected_stat = m.topk(16, dim=-1).values.mean(-1).mean().item()
            assert scores.top_coefficients[row, layer] == pytest.approx(expected_stat, rel=1e-5)


def _plant(loaded, token: int, scale: float = 1e4) -> None:
    """Layer 0, key 0 fires only where `token` is the input: its embedding is a huge multiple of one direction
    u, so the layer's normalized input there is ±u's normalization, and the key row reads that direction."""
    view = loaded.view
    with torch.no_grad():
        emb = loaded.model.get_input_embeddings().weight
        u = torch.zeros(view.d_model)
        u[0] = 1.0
        emb[token] = 1e4 * u
        ln = loaded.model.transformer.h[0].ln_2
        direction = torch.nn.functional.layer_norm(1e4 * u, (view.d_model,), ln.weight, ln.bias, ln.eps)
        view.keys(0)[0] = scale * direction / direction.norm() ** 2
        view.key_bias(0)[0] = -scale / 2


def test_planted_membership_gives_auc_one_and_identical_splits_give_one_half(tmp_path):
    run, loaded = make_run(tmp_path / "r", n=40)
    q = loaded.tokenizer.encode("q")[0]
    _plant(loaded, q)
    members = tmp_path / "members.txt"
    nonmembers = tmp_path / "nonmembers.txt"
    members.write_text("\n".join(f"the cat q sat {'ab' * (i % 5)}" for i in range(30)) + "\n")
    nonmembers.write_text("\n".join(f"the cat z sat {'ab' * (i % 5)}" for i in range(30)) + "\n")
    analyze(run, only="membership", loaded=loaded, progress=False,
            options={"membership": {"member_corpus": str(members), "nonmember_corpus": str(nonmembers), "n": 20}})
    table = RunDir(run).read_metric("membership")
    # The planted memory writes m = 1e4/2 at every 'q' and 0 (GELU of a large negative) elsewhere: every
    # member's layer-0 statistic exceeds every non-member's.
    assert table.loc[0, "auc"] == 1.0 and table.loc[0, "auc_ci_high"] == 1.0
    assert (table["n_member"] == 20).all() and (table["n_nonmember"] == 20).all()
    examples = RunDir(run).read_metric("membership_examples")
    assert len(examples) == 40 * loaded.view.n_layers
    examples = examples[examples["layer"] == 0]
    assert (examples["split"] == "member").sum() == 20 and (examples["split"] == "nonmember").sum() == 20
    assert all(("q" in t) == m for t, m in zip(examples["text"], examples["member"]))
    # The same text on both sides: the same seeded draw, so each example faces itself; only those n of the n²
    # pairs can differ from a tie (by float noise of a different padded batch): |AUC - 0.5| <= 1/(2n).
    analyze(run, only="membership", loaded=loaded, progress=False,
            options={"membership": {"member_corpus": str(members), "nonmember_corpus": str(members), "n": 20}})
    table = RunDir(run).read_metric("membership")
    assert (abs(table["auc"] - 0.5) <= 0.5 / 20 + 1e-12).all()
    assert (abs(table["loss_auc"] - 0.5) <= 0.5 / 20 + 1e-12).all()
    desc = RunDir(run).metric_description("membership")
    assert desc["n_examples"] == 40 and "DeLong" in desc["interval"]
    assert (RunDir(run).figures_dir / "membership.png").is_file()


def test_unknown_training_split_is_refused_when_asked_and_skipped_otherwise(tmp_path, monkeypatch, capsys):
    run, loaded = make_run(tmp_path / "r", n=20)
    with pytest.raises(FfkvError, match="--member-corpus"):
        analyze(run, only="values,membership", loaded=loaded, progress=False)
    assert not RunDir(run).has_metric("values")  # refused before anything ran
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    assert cli.main(["analyze", str(run), "--only", "membership", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ffkv: error: membership: ffkv does not know" in err and "--nonmember-corpus" in err
    with pytest.raises(FfkvError, match="both"):
        analyze(run, only="membership", loaded=loaded, progress=False,
                options={"membership": {"member_corpus": str(Path(run).parent / "corpus.txt")}})
    done = analyze(run, only=None, loaded=loaded, progress=False, n_eval=20)
    assert "does not know" in done["membership"]["skipped"]
    assert not RunDir(run).has_metric("membership")


def _detector(loaded, token: int, n_latents: int = 4, scale: float = 1e4):
    """A transcoder at layer 0 whose latent 0 fires (a = scale/2) exactly where `token` is the input, after `token`'s
    embedding is made a huge multiple of one direction u (as `_plant`, but the model's keys untouched); the other
    latents never fire (bias -1e6)."""
    from ffkv.dictionaries import Dictionary

    view = loaded.view
    with torch.no_grad():
        u = torch.zeros(view.d_model)
        u[0] = 1.0
        loaded.model.get_input_embeddings().weight[token] = 1e4 * u
        ln = loaded.model.transformer.h[0].ln_2
        direction = torch.nn.functional.layer_norm(1e4 * u, (view.d_model,), ln.weight, ln.bias, ln.eps)
    g = torch.Generator().manual_seed(0)
    encoder = torch.randn(n_latents, view.d_model, generator=g)
    encoder[0] = scale * direction / direction.norm() ** 2
    bias = torch.full((n_latents,), -1e6)
    bias[0] = -scale / 2
    return Dictionary(kind="transcoder", layer=0, encoder=encoder, encoder_bias=bias,
                      decoder=torch.randn(n_latents, view.d_model, generator=g), decoder_bias=torch.zeros(view.d_model),
                      activation="relu")


def test_latent_membership_reads_the_same_pass_and_finds_a_planted_detector(tmp_path):
    """A latent that fires only on 'q' gives the latents' AUC 1 when only the members hold 'q', and one half when
    both splits are the same text; the latent statistic is a brute-force encoding of the captured FF input; the
    neurons' statistic is bit for bit the same with the latents read beside it."""
    from ffkv.corpus import CorpusSpec
    from ffkv.dictionaries.npz_layout import save_npz
    from ffkv.indexing.indexer import IndexOptions, build_index
    from ffkv.memories.sets import Latents
    from support.experiment_runs import write_corpus
    from support.helpers import loaded_tiny

    loaded = loaded_tiny("gpt2")
    q = loaded.tokenizer.encode("q")[0]
    d = _detector(loaded, q)
    path = save_npz(d, tmp_path / "detector.npz")
    corpus = write_corpus(tmp_path / "corpus.txt", 40)
    run = tmp_path / "run"
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), run, IndexOptions(top_k=4, control_keys=8),
                progress=False, dictionary=path)
    members, nonmembers = tmp_path / "members.txt", tmp_path / "nonmembers.txt"
    members.write_text("\n".join(f"the cat q sat {'ab' * (i % 5)}" for i in range(30)) + "\n")
    nonmembers.write_text("\n".join(f"the cat z sat {'ab' * (i % 5)}" for i in range(30)) + "\n")

    ids = [np.array(loaded.tokenizer.encode(t)) for t in ("the cat q sat", "a dog z", "q q red mat far away")]
    latents = Latents(loaded.view, {0: d})
    with_latents = score_examples(loaded, ids, coefficients=True, latents=latents)
    alone = score_examples(loaded, ids, coefficients=True)
    assert np.array_equal(with_latents.top_coefficients, alone.top_coefficients) and not alone.latent_top_coefficients
    for row, t in enumerate(ids):
        with torch.no_grad(), loaded.view.capture(("ff_in",), layers=[0]) as cap:
            loaded.view.forward(torch.as_tensor(t)[None])
        a = torch.relu(cap["ff_in"][0][0] @ d.encoder.T + d.encoder_bias)  # (T, 4)
        assert with_latents.latent_top_coefficients[0][row] == pytest.approx(a.mean(-1).mean().item(), rel=1e-6)
    assert with_latents.latent_top_coefficients[0][1] == 0.0  # no 'q': the detector is silent

    def membership(member, nonmember):
        analyze(run, only="membership", loaded=loaded, progress=False,
                options={"membership": {"member_corpus": str(member), "nonmember_corpus": str(nonmember), "n": 20}})
        return RunDir(run).read_metric("membership_latents"), RunDir(run).read_metric("membership")

    table, neurons = membership(members, nonmembers)
    row = table.iloc[0]
    assert list(table["layer"]) == [0] and row.auc_latents == 1.0 and row.n_examples == 40
    assert row.auc_neurons == neurons.loc[0, "auc"]  # the neurons' own AUC of that layer, beside it
    assert row.auc_latents_minus_neurons == pytest.approx(row.auc_latents - row.auc_neurons, abs=1e-12)
    table, _ = membership(members, members)
    assert abs(table.iloc[0].auc_latents - 0.5) <= 0.5 / 20 + 1e-12 and table.iloc[0].stronger == "cannot say"


def test_which_kind_is_stronger_needs_one_side_of_one_half_and_an_interval_without_0():
    from ffkv.experiments.membership import stronger

    assert stronger(0.8, 0.6, 0.1, 0.3) == "latents"
    assert stronger(0.3, 0.4, -0.2, -0.05) == "latents"  # further below 0.5: more signal, the other way
    assert stronger(0.55, 0.7, -0.25, -0.05) == "neurons"
    assert stronger(0.8, 0.6, -0.01, 0.4) == "cannot say"  # the interval holds 0
    assert stronger(0.6, 0.45, 0.05, 0.25) == "cannot say"  # opposite sides of 0.5
