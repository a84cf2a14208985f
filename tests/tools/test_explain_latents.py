"""`ffkv explain --latents` and `ffkv score` on a sparse dictionary's latents, against the loopback server's known
rule (support.chat_server) on a run indexed with a hand-built transcoder (support.explain_runs.planted_dictionary):

- a latent that fires on one character alone gets that character in its explanation and a score near 1, and a
  shuffled explanation scores far lower; the latents are summarised beside the neurons per dictionary layer;
- every latent score equals the correlation computed here from a brute-force a_j (the dictionary's encoder applied
  by hand to each held-out text's FF input), and the activations `score` reads equal that brute force for the
  latents and control latents, ReLU and TopK alike;
- the neurons' explanations and scores are byte for byte the same with latents explained beside them;
- a run without a dictionary, or without latent explanations, behaves as before, and asking it for latents is one
  clear error naming what to do.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.errors import FfkvError
from ffkv.experiments.explanations import LATENTS, NEURON_KINDS
from ffkv.memories.address import LatentRef
from ffkv.store.run import RunDir
from ffkv.tools.explain import WINDOW, explain, held_out_ranks, window
from ffkv.tools.llm_backends import ServerBackend
from ffkv.tools.score import score
from support.chat_server import ChatServer
from support.explain_runs import CHAR, N_LATENTS, PLANTED, PLANTED_LATENT

NEURONS = [(0, PLANTED), (0, 1), (0, 2), (0, 3)]
LATENT_REFS = [LatentRef(0, j, "transcoder") for j in (PLANTED_LATENT, 0, 1, 2)]
quiet = dict(progress=False, say=lambda line: None)


def _backend(server, name: str = "rule") -> ServerBackend:
    return ServerBackend(server.url, name, concurrency=4, timeout=10.0, retries=1, backoff=0.01)


def _brute_latents(loaded, encoder: torch.Tensor, bias: torch.Tensor, ids) -> np.ndarray:
    """relu(e_j·x + b_j) at every token of one example alone (no padding): x the FF input of layer 0."""
    view = loaded.view
    with torch.no_grad(), view.capture(("ff_in",), layers=[0]) as cap:
        view.forward(torch.tensor([list(ids)]), torch.ones(1, len(ids), dtype=torch.long))
    x = cap["ff_in"][0][0].float()
    return torch.relu(x @ encoder.float().T + bias.float()).numpy()


def _parquet_bytes(frame: pd.DataFrame) -> bytes:
    out = io.BytesIO()
    frame.reset_index(drop=True).to_parquet(out)
    return out.getvalue()


def test_a_latent_firing_on_one_character_is_explained_by_it_and_scores_near_1(fresh_latents):
    run, loaded = fresh_latents
    with ChatServer() as server:
        backend = _backend(server)
        explain(run, backend, memories=NEURONS, controls=2, loaded=loaded, **quiet)
        rows = explain(run, backend, memories=LATENT_REFS, controls=3, loaded=loaded, **quiet)
        table, by_layer = score(run, backend, loaded=loaded, **quiet)
    # the neurons in both directions and 2 controls; the latents in one direction and 3 control latents
    assert list(rows["kind"].value_counts().sort_index().items()) == [("control", 4), ("latent", 4),
                                                                      ("latent_control", 3), ("memory", 8)]
    latents = rows[rows["kind"].isin(["latent", "latent_control"])]
    assert (latents["direction"] == 1).all() and (latents["layer"] == 0).all()
    shown = loaded.tokenizer.decode(loaded.tokenizer.encode(CHAR))
    planted = rows[(rows["kind"] == "latent") & (rows["key"] == PLANTED_LATENT)].iloc[0]
    assert planted["explanation"] == f"Fires on the character '{shown}'."

    mine = table[(table["kind"] == "latent") & (table["key"] == PLANTED_LATENT)].set_index("baseline")
    assert mine.at["own", "score"] > 0.99
    assert f"'{shown}'" not in mine.at["shuffled", "explanation"] and mine.at["shuffled", "score"] < 0.3
    assert mine.at["shuffled", "explanation_key"] in {0, 1, 2}  # another latent's explanation, never a neuron's
    assert set(table.loc[table["kind"] == "latent_control", "baseline"]) == {"own"}

    # the neurons' per-layer table reads the neurons alone; the latents' sets both kinds side by side
    assert list(by_layer["n_score"]) == [8] and list(by_layer["n_control"]) == [4]
    beside = RunDir(run).read_metric(LATENTS).iloc[0]
    assert (beside["layer"], beside["dictionary"]) == (0, "transcoder")
    assert (beside["n_score_latents"], beside["n_control_latents"], beside["n_score_neurons"]) == (4, 3, 8)
    own = table[(table["kind"] == "latent") & (table["baseline"] == "own")]["score"]
    assert beside["score_latents"] == pytest.approx(own.mean(), abs=1e-12)
    assert beside["score_neurons"] == pytest.approx(by_layer.at[0, "score"], abs=1e-12)
    excess = (own.to_numpy() - table[(table["kind"] == "latent") & (table["baseline"] == "shuffled")]
              .sort_values("key")["score"].to_numpy()).mean() - by_layer.at[0, "score_minus_shuffled"]
    assert beside["excess_latents_minus_neurons"] == pytest.approx(excess, abs=1e-12)
    assert beside["excess_latents_minus_neurons_ci_low"] < beside["excess_latents_minus_neurons"] \
        < beside["excess_latents_minus_neurons_ci_high"]


def test_latent_scores_equal_a_brute_force_from_the_dictionarys_encoder(fresh_latents):
    from support.explain_runs import planted_dictionary

    run, loaded = fresh_latents
    with ChatServer() as server:
        backend = _backend(server)
        rows = explain(run, backend, memories=LATENT_REFS, controls=3, loaded=loaded, **quiet)
        table, _ = score(run, backend, loaded=loaded, top_examples=5, random_examples=0, **quiet)
    d = planted_dictionary(loaded)  # the one indexed, built again
    from ffkv.experiments.common import RunContext
    from ffkv.store.run import RunDir as Dir

    rd = Dir(run)
    ctx = RunContext(rd, rd.require_complete(), loaded, progress=False)
    controls = ctx.latent_keys().controls[0]
    assert np.array_equal(controls.source.numpy(), ctx.latent_control_sources()[0])
    examples = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    explanations = {(r.kind, r.key): r.explanation for r in rows.itertuples()}
    checked = 0
    for r in table[table["kind"].isin(["latent", "latent_control"])].itertuples():
        control = r.kind == "latent_control"
        triggers = RunDir(run).read_triggers(control=control, source="latents")
        held = triggers[(triggers["layer"] == 0) & (triggers["key"] == r.key)
                        & triggers["rank"].isin(held_out_ranks(10, 5))].sort_values("rank")
        encoder, bias = (controls.encoder, controls.encoder_bias) if control else (d.encoder, d.encoder_bias)
        char = explanations[(r.kind, r.explanation_key)].split("'")[1]
        true, predicted = [], []
        for e, p in zip(held["example_id"], held["position"]):
            ids = list(examples.at[int(e), "token_ids"])
            start, end = window(len(ids), int(p), WINDOW)
            true += list(_brute_latents(loaded, encoder, bias, ids)[start:end, r.key])
            predicted += [9.5 if loaded.tokenizer.decode([t]) == char else 0.5 for t in ids[start:end]]
        assert r.n_tokens == len(true) > 0
        expected = float(np.corrcoef(predicted, true)[0, 1]) if np.ptp(predicted) and np.ptp(true) else \
            (float("nan") if not np.ptp(true) else 0.0)
        assert r.score == pytest.approx(expected, abs=1e-4, nan_ok=True), r
        checked += 1
    assert checked == 2 * len(LATENT_REFS) + 3  # own and shuffled for each latent; own for each control latent


@pytest.mark.parametrize("activation", ["relu", "topk"])
def test_the_activations_score_reads_equal_a_brute_force(planted_latents, activation):
    """`token_latent_activations`, on texts of several lengths in one padded batch, equals the dictionary's
    activation applied by hand to each text alone, for its latents and its control latents (a TopK dictionary's
    kept sparse: the k largest pre-activations, a control latent where it beats the k-th)."""
    from ffkv.dictionaries import Dictionary
    from ffkv.memories.latent_keys import LatentKeys
    from ffkv.tools.activations import token_latent_activations
    from support.explain_runs import planted_dictionary
    from support.runs import corpus_lines

    _, loaded = planted_latents
    d = planted_dictionary(loaded)
    if activation == "topk":
        d = Dictionary(kind="transcoder", layer=0, encoder=d.encoder, encoder_bias=d.encoder_bias, decoder=d.decoder,
                       decoder_bias=d.decoder_bias, activation="topk", k=3)
    keys = LatentKeys({0: d}, 5, seed=7, device="cpu")
    texts = [loaded.tokenizer.encode(line) for line in corpus_lines(7)]
    chosen = [PLANTED_LATENT, 0, 7, 11]
    got = token_latent_activations(loaded, keys, 0, chosen, texts, batch_size=4)
    got_control = token_latent_activations(loaded, keys, 0, [4, 1], texts, control=True, batch_size=4)
    c = keys.controls[0]
    for ids, mine, theirs in zip(texts, got, got_control):
        with torch.no_grad(), loaded.view.capture(("ff_in",), layers=[0]) as cap:
            loaded.view.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        x = cap["ff_in"][0][0].float()
        raw = x @ d.encoder.float().T + d.encoder_bias.float()
        raw_c = x @ c.encoder.float().T + c.encoder_bias.float()
        if activation == "relu":
            want, want_c = torch.relu(raw).numpy(), torch.relu(raw_c).numpy()
        else:
            kth = raw.topk(3, dim=-1).values[:, -1:]
            want = torch.where(raw >= kth, torch.relu(raw), 0).numpy()
            want_c = torch.where(raw_c > kth, torch.relu(raw_c), 0).numpy()
        assert mine.shape == (len(ids), len(chosen)) and theirs.shape == (len(ids), 2)
        np.testing.assert_allclose(mine, want[:, chosen], atol=1e-4)
        np.testing.assert_allclose(theirs, want_c[:, [4, 1]], atol=1e-4)
    assert max(float(a[:, 0].max()) for a in got) > 5  # the planted latent fires in these texts


def test_the_neurons_rows_are_byte_identical_with_latents_beside_them(fresh_latents):
    run, loaded = fresh_latents
    rd = RunDir(run)
    with ChatServer() as server:
        backend = _backend(server)
        explain(run, backend, memories=NEURONS, controls=2, loaded=loaded, **quiet)
        _, by_layer = score(run, backend, loaded=loaded, **quiet)
        assert not rd.has_metric(LATENTS)  # no latent explained: nothing new
        before = {name: rd.read_metric(name) for name in ("explanations", "explanation_scores")}
        n = len(server.requests)
        explain(run, backend, latents=True, sample=5, controls=3, loaded=loaded, **quiet)
        n_latent_requests = 5 + 3
        _, by_layer_after = score(run, backend, loaded=loaded, **quiet)
        sent = server.requests[n + n_latent_requests:]
    assert rd.has_metric(LATENTS)
    after = {name: rd.read_metric(name) for name in ("explanations", "explanation_scores")}
    for name, table in before.items():
        neurons = after[name][after[name]["kind"].isin(NEURON_KINDS)]
        assert len(after[name]) > len(table) and len(neurons) == len(table)
        assert _parquet_bytes(neurons) == _parquet_bytes(table), name
    assert _parquet_bytes(by_layer_after) == _parquet_bytes(by_layer)
    # the second score asked only for the latents' simulations: every neuron simulation was stored
    latent_rows = after["explanation_scores"][~after["explanation_scores"]["kind"].isin(NEURON_KINDS)]
    assert 0 < len(sent) <= int(latent_rows["n_texts"].sum())


def test_a_sample_of_latents_is_seeded_and_drawn_per_dictionary_layer(fresh_latents):
    from ffkv.experiments.common import open_run, RunContext
    from ffkv.tools.explain import choose_targets

    run, loaded = fresh_latents
    run_dir, manifest, _ = open_run(run, loaded)
    ctx = RunContext(run_dir, manifest, loaded, progress=False)
    first = choose_targets(ctx, sample=4, controls=2, seed=3, latents=True)
    assert first == choose_targets(ctx, sample=4, controls=2, seed=3, latents=True)
    assert [t.kind for t in first] == ["latent"] * 4 + ["latent_control"] * 2
    assert all(t.layer == 0 and t.direction == 1 and 0 <= t.key < N_LATENTS for t in first[:4])
    assert choose_targets(ctx, sample=4, seed=4, latents=True) != first[:4]
    every = choose_targets(ctx, sample=100, latents=True)
    assert sorted(t.key for t in every) == list(range(N_LATENTS))  # every latent fired over the corpus


@pytest.mark.parametrize("options, says", [
    (dict(latents=True, direction="negative"), "a latent has one direction"),
    (dict(latents=True, layers=[1]), "layer 2 has no dictionary: latents exist at t1"),
    (dict(memories=[LatentRef(0, 99, "transcoder")]), "latent 99 does not exist: t1 has latents 0..11"),
    (dict(memories=[LatentRef(0, 1, "sae")]), "layer 1's dictionary is a transcoder, not a sae"),
    (dict(latents=True, memories=[(0, 1)]), "give one of them"),
])
def test_asking_for_latents_that_are_not_there_is_one_clear_error(planted_latents, options, says):
    run, loaded = planted_latents
    backend = ServerBackend("http://127.0.0.1:9/v1", "m")
    with pytest.raises(FfkvError, match=says):
        explain(run, backend, loaded=loaded, **options, **quiet)


def test_a_run_without_a_dictionary_refuses_latents_and_is_scored_as_before(fresh, capsys):
    from support.cli_runs import error_line, run as cli_run
    from support.explain_runs import install

    run, loaded = fresh
    backend = ServerBackend("http://127.0.0.1:9/v1", "m")
    for options in (dict(latents=True), dict(memories=[LatentRef(0, 1, "transcoder")])):
        with pytest.raises(FfkvError, match="was indexed without a dictionary: it has no latents to explain "
                                            r"\(index it with `ffkv index --dictionary PATH`"):
            explain(run, backend, loaded=loaded, **options, **quiet)
    install()
    code, _, err = cli_run(capsys, "explain", run, "--explainer", "openai:http://127.0.0.1:9/v1#m", "--latents",
                           "--no-progress")
    assert code == 2 and "without a dictionary" in error_line(err)
    with ChatServer() as server:
        explain(run, _backend(server), memories=NEURONS[:2], loaded=loaded, **quiet)
        score(run, _backend(server), loaded=loaded, **quiet)
    assert not RunDir(run).has_metric(LATENTS)


def test_the_commands_explain_and_score_latents_and_print_them_beside_the_neurons(fresh_latents, capsys):
    from support.cli_runs import run as cli_run
    from support.explain_runs import install

    install()
    run, _ = fresh_latents
    with ChatServer() as server:
        spec = f"openai:{server.url}#rule"
        code, out, err = cli_run(capsys, "explain", run, "--explainer", spec, "--memories", "1:5,1:1",
                                 "--no-progress")
        assert code == 0, err
        code, out, err = cli_run(capsys, "explain", run, "--explainer", spec, "--latents", "--sample", "3",
                                 "--controls", "2", "--no-progress")
        assert code == 0, err
        assert "explain: 5 requests" in err and "explanations written: 9 rows" in out
        code, out, err = cli_run(capsys, "explain", run, "--explainer", spec, "--memories", f"t1:{PLANTED_LATENT}",
                                 "--no-progress")
        assert code == 0, err
        code, out, err = cli_run(capsys, "score", run, "--simulator", spec, "--no-progress")
    assert code == 0, err
    assert "layer 1: score" in out and "layer 1 latents (transcoder): score" in out
    assert "latents minus neurons" in out and "explanation_scores_latents.parquet" in out
    kinds = RunDir(run).read_metric("explanations")["kind"]
    assert kinds.value_counts().to_dict() == {"memory": 4, "latent": 4, "latent_control": 2}
    code, _, err = cli_run(capsys, "explain", run, "--explainer", spec, "--memories", "x1:2", "--no-progress")
    assert code == 2 and "tL:J / sL:J for a latent" in err


def test_the_report_and_latents_beside_show_the_latents_scores(fresh_latents):
    """`analyze --only explanation_scores,latents_beside` on real scores: the section's latent figure and table in
    the report, and one "explanation_score" row per dictionary layer in latents_beside (no verdict on 4 latents)."""
    from ffkv.experiments import analyze
    from ffkv.report import write_report

    run, loaded = fresh_latents
    with ChatServer() as server:
        backend = _backend(server)
        explain(run, backend, memories=NEURONS, controls=2, loaded=loaded, **quiet)
        explain(run, backend, memories=LATENT_REFS, controls=3, loaded=loaded, **quiet)
        score(run, backend, loaded=loaded, **quiet)
    analyze(run, only=["explanation_scores", "latents_beside"], loaded=loaded, progress=False, n_eval=20)
    beside = pd.read_parquet(run / "metrics" / "latents_beside.parquet")
    row = beside[beside["measure"] == "explanation_score"]
    assert list(row["layer"]) == [0] and row["study"].iloc[0] == "explanation_scores_latents"
    scores = RunDir(run).read_metric(LATENTS).iloc[0]
    assert row["latents"].iloc[0] == scores["score_latents"] and row["n_latents"].iloc[0] == 4
    assert row["neurons"].iloc[0] == scores["score_neurons"] and row["n_neurons"].iloc[0] == 8
    assert row["difference"].iloc[0] == scores["excess_latents_minus_neurons"]
    assert row["verdict"].iloc[0].startswith("no verdict")
    assert (run / "figures" / "explanation_scores_latents.png").is_file()
    html = write_report(run).read_text()
    assert "explanation_scores_latents" in html and "control latents" in html and "score latents" in html
