"""`ffkv explain` and `ffkv score` against a real chat-completions server on loopback (support.chat_server).

The server explains and simulates by a known rule on a tiny model with one planted memory (support.explain_runs):
the planted memory's right explanation must score near 1, a shuffled one near 0, and every score must equal
the correlation the test computes itself, from its own forward pass, between the rule's prediction and the
memory's coefficients. A dropped connection, a slow answer and a malformed answer each give one clear error and
lose no finished explanation; a kill -9 in the middle of `explain`, then a resume, re-sends nothing stored.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.errors import FfkvError
from ffkv.store.run import RunDir
from ffkv.tools.explain import WINDOW, explain, held_out_ranks, window
from ffkv.tools.journal import Journal
from ffkv.tools.llm_backends import LLMError, ServerBackend
from ffkv.tools.score import score
from support.chat_server import ChatServer
from support.explain_runs import CHAR, PLANTED

MEMORIES = [(0, PLANTED), (0, 1), (0, 2), (0, 3)]
TESTS = Path(__file__).resolve().parents[1]


def _explained(run, loaded, server, **options):
    backend = ServerBackend(server.url, "rule", concurrency=options.pop("concurrency", 4),
                            timeout=options.pop("timeout", 10.0), retries=options.pop("retries", 1), backoff=0.01)
    return explain(run, backend, memories=MEMORIES, loaded=loaded, progress=False, say=lambda line: None,
                   **options), backend


def _brute_coefficients(loaded, layer: int, key: int, ids) -> np.ndarray:
    """m of one memory at every token of one example: a plain forward pass with the FF's own hook point."""
    view = loaded.view
    with torch.no_grad(), view.capture(("coefficients",), layers=[layer]) as cap:
        view.forward(torch.tensor([list(ids)]), torch.ones(1, len(ids), dtype=torch.long))
    return cap["coefficients"][layer][0, :, key].numpy()


def test_the_planted_memorys_right_explanation_scores_near_1_and_a_shuffled_one_near_0(fresh):
    run, loaded = fresh
    with ChatServer() as server:
        rows, backend = _explained(run, loaded, server, controls=3)
        n_explain = len(server.requests)
        table, layers = score(run, backend, loaded=loaded, progress=False, say=lambda line: None)
    # Each memory of a signed model in both directions, and 3 control memories per layer, each asked once.
    assert len(rows) == n_explain == 2 * (len(MEMORIES) + 3)
    assert set(rows["kind"]) == {"memory", "control"} and set(rows["direction"]) == {1, -1}
    planted_row = rows[(rows["kind"] == "memory") & (rows["key"] == PLANTED) & (rows["direction"] == 1)].iloc[0]
    shown = loaded.tokenizer.decode(loaded.tokenizer.encode(CHAR))  # the character tokenizer folds the alphabet
    assert planted_row["explanation"] == f"Fires on the character '{shown}'."
    assert planted_row["prompt_tokens"] > 0 and len(planted_row["prompt_sha256"]) == 64
    assert planted_row["explainer"].startswith("openai:http://127.0.0.1:")

    own = table[(table["kind"] == "memory") & (table["key"] == PLANTED) & (table["direction"] == 1)]
    right = own[own["baseline"] == "own"].iloc[0]
    wrong = own[own["baseline"] == "shuffled"].iloc[0]
    assert right["score"] > 0.99
    assert f"'{shown}'" not in wrong["explanation"] and abs(wrong["score"]) < 0.2
    assert bool(right["expected"])  # read from the log-probabilities
    assert set(table["baseline"]) == {"own", "shuffled"}
    by_layer = layers.set_index("layer").loc[0]
    assert by_layer["n_score"] == 2 * len(MEMORIES) and by_layer["n_control"] >= 1
    assert by_layer["score_minus_shuffled"] > 0


def test_scores_equal_a_brute_force_correlation(fresh):
    run, loaded = fresh
    with ChatServer() as server:
        rows, backend = _explained(run, loaded, server)
        table, _ = score(run, backend, loaded=loaded, progress=False, say=lambda line: None, top_examples=5,
                         random_examples=0)
    examples = pd.read_parquet(run / "examples.parquet").set_index("example_id")
    triggers = RunDir(run).read_triggers("both")
    explanations = {(r.key, r.direction): r.explanation for r in rows.itertuples()}
    checked = 0
    for r in table.itertuples():
        held = triggers[(triggers["layer"] == 0) & (triggers["key"] == r.key) & (triggers["direction"] == r.direction)
                        & triggers["rank"].isin(held_out_ranks(10, 5))].sort_values("rank")
        char = explanations[(r.explanation_key, r.direction)].split("'")[1]
        true, predicted = [], []
        for e, p in zip(held["example_id"], held["position"]):
            ids = list(examples.at[int(e), "token_ids"])
            start, end = window(len(ids), int(p), WINDOW)
            true += list(r.direction * _brute_coefficients(loaded, 0, r.key, ids)[start:end])
            predicted += [9.5 if loaded.tokenizer.decode([t]) == char else 0.5 for t in ids[start:end]]
        expected = 0.0 if np.ptp(predicted) == 0 else float(np.corrcoef(predicted, true)[0, 1])
        assert r.n_tokens == len(true)
        assert r.score == pytest.approx(expected, abs=1e-4), r
        checked += 1
    assert checked == 2 * 2 * len(MEMORIES)  # own and shuffled, both directions


def test_a_server_without_logprobs_gives_the_written_digits(fresh):
    run, loaded = fresh
    with ChatServer(with_logprobs=False) as server:
        _, backend = _explained(run, loaded, server)
        table, _ = score(run, backend, loaded=loaded, progress=False, say=lambda line: None)
    sims = pd.read_parquet(run / "journal" / "explanation_simulations.parquet")
    assert set(np.concatenate(sims["values"].to_numpy())) <= {0.0, 10.0}
    assert not table["expected"].any()
    right = table[(table["key"] == PLANTED) & (table["direction"] == 1) & (table["baseline"] == "own")].iloc[0]
    assert right["score"] > 0.99


@pytest.mark.parametrize("mode, says", [("drop", "could not be reached"), ("slow", "no answer within"),
                                        ("malformed", "malformed answer"), ("garbage", "not JSON")])
def test_a_failing_server_gives_one_clear_error_and_keeps_what_was_finished(fresh, mode, says):
    run, loaded = fresh
    with ChatServer(mode=mode, fail_from=4, delay=3.0) as server:
        with pytest.raises(LLMError, match=says) as caught:
            _explained(run, loaded, server, concurrency=1, timeout=0.5, retries=1)
    assert server.url.rsplit("/", 1)[0] in str(caught.value) and "\n" not in str(caught.value)
    kept = RunDir(run).read_metric("explanations")
    assert len(kept) == 3  # the three answered before the server failed, written atomically
    assert not list((run / "journal" / "explanations").glob("*.parquet"))  # folded into the table
    with ChatServer() as server:
        rows, _ = _explained(run, loaded, server)
        assert len(server.requests) == 2 * len(MEMORIES) - 3  # only what was missing
    assert len(rows) == 2 * len(MEMORIES)


def test_an_unreachable_server_is_one_line(fresh):
    run, loaded = fresh
    with ChatServer() as server:
        url = server.url
    backend = ServerBackend(url, "m", retries=0, timeout=2.0)
    with pytest.raises(LLMError, match="could not be reached after 1 tries"):
        explain(run, backend, memories=MEMORIES[:1], loaded=loaded, progress=False, say=lambda line: None)


def test_explain_again_sends_nothing_and_keeps_the_table(fresh):
    run, loaded = fresh
    lines = []
    with ChatServer() as server:
        first, backend = _explained(run, loaded, server)
        n = len(server.requests)
        second = explain(run, backend, memories=MEMORIES, loaded=loaded, progress=False, say=lines.append)
        assert len(server.requests) == n
    assert lines[0].startswith("explain: 0 requests") and f"{len(first)} of {len(first)} already stored" in lines[0]
    assert len(lines) == 1  # nothing replaced, nothing said of it
    pd.testing.assert_frame_equal(first, second)


def test_kill_9_in_the_middle_of_explain_then_resume_resends_nothing_stored(fresh, tmp_path):
    run, loaded = fresh
    memories = ",".join(f"{layer + 1}:{key}" for layer, key in MEMORIES)
    with ChatServer(pause=0.3) as server:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        child = subprocess.Popen([sys.executable, "-m", "support.explain_runs", "explain", str(run), "--explainer",
                                  f"openai:{server.url}#rule", "--memories", memories, "--controls", "2",
                                  "--concurrency", "1", "--no-progress"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
        deadline = time.time() + 600  # a fresh process imports torch and builds the model first
        while len(server.requests) < 7 and time.time() < deadline and child.poll() is None:
            time.sleep(0.02)
        assert len(server.requests) >= 7
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert child.returncode == -signal.SIGKILL, child.stderr.read().decode()
        journal = Journal(RunDir(run), "explanations", metric=True, step="explain", key="row")
        stored = journal.done()
        assert 4 <= len(stored) < 12  # some chunks kept (every 4 rows), not all done
        before = len(server.requests)
        rows = explain(run, ServerBackend(server.url, "rule", concurrency=2), memories=MEMORIES, controls=2,
                       loaded=loaded, progress=False, say=lambda line: None)
        resent = {r["messages"][1]["content"] for r in server.requests[before:]}
    sent_hashes = set(rows[rows["prompt_sha256"].isin(stored["prompt_sha256"])]["prompt_sha256"])
    assert len(server.requests) - before == 12 - len(stored)
    assert len(rows) == 12 and len(sent_hashes) == len(stored)
    assert len(resent) == 12 - len(stored)


def test_score_needs_explanations_and_explain_checks_its_memories(fresh):
    run, loaded = fresh
    backend = ServerBackend("http://127.0.0.1:9/v1", "m")
    with pytest.raises(FfkvError, match="run `ffkv explain"):
        score(run, backend, loaded=loaded, progress=False)
    with pytest.raises(FfkvError, match="memory 1:99999 does not exist"):
        explain(run, backend, memories=[(0, 99999)], loaded=loaded, progress=False)


def test_the_key_is_sent_and_never_written(fresh, monkeypatch):
    run, loaded = fresh
    monkeypatch.setenv("FFKV_LLM_API_KEY", "sk-secret-test-key")
    seen = []
    with ChatServer() as server:
        import http.server

        real = http.server.BaseHTTPRequestHandler.parse_request

        def spy(self):
            ok = real(self)
            seen.append(self.headers.get("Authorization"))
            return ok
        monkeypatch.setattr(http.server.BaseHTTPRequestHandler, "parse_request", spy)
        _explained(run, loaded, server)
    assert seen and all(h == "Bearer sk-secret-test-key" for h in seen)
    for path in Path(run).rglob("*"):
        if path.is_file():
            assert b"sk-secret-test-key" not in path.read_bytes(), path


def test_the_commands_print_the_plan_the_scores_and_one_line_errors(fresh, capsys):
    from ffkv import cli
    from support.explain_runs import install

    install()
    run, _ = fresh
    with ChatServer() as server:
        backend = f"openai:{server.url}#rule"
        assert cli.main(["explain", str(run), "--explainer", backend, "--memories", "1:5,1:1,2:3", "--controls", "1",
                         "--no-progress"]) == 0
        assert cli.main(["score", str(run), "--simulator", backend, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    # 3 memories and 1 control memory in each of the 2 layers they are in, both directions
    assert "explain: 10 requests to openai:" in err and "explanations written: 10 rows" in out
    assert "layer 1: score" in out and "layer 2: score" in out and "shuffled" in out and "control" in out
    assert cli.main(["explain", str(run), "--explainer", "openai:http://127.0.0.1:9/v1#m", "--retries", "0",
                     "--memories", "1:7", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ffkv: error: the server http://127.0.0.1:9/v1 could not be reached after 1 tries")
    assert cli.main(["explain", str(run), "--explainer", "gpt4", "--no-progress"]) == 2
    assert "unknown backend 'gpt4'" in capsys.readouterr().err


def test_scoring_layer_by_layer_keeps_the_other_layers_scores(fresh):
    """`score --layers 1`, then `--layers 2`: the table holds both layers, as one call over both writes it;
    a layer scored with another held-out mix is dropped with a line, not mixed in silently."""
    run, loaded = fresh
    memories = [(0, PLANTED), (0, 1), (1, 2), (1, 3)]
    with ChatServer() as server:
        backend = ServerBackend(server.url, "rule", concurrency=4, timeout=10.0, retries=1, backoff=0.01)
        explain(run, backend, memories=memories, loaded=loaded, progress=False, say=lambda line: None)
        said = []
        quiet = dict(loaded=loaded, progress=False, say=said.append)
        score(run, backend, layers=[0], **quiet)
        table, by_layer = score(run, backend, layers=[1], **quiet)
        whole, whole_by_layer = score(run, backend, **quiet)
        assert not any("dropped" in line for line in said)
        columns = ["kind", "layer", "key", "direction", "baseline", "explanation_key", "score"]
        assert sorted(table["layer"].unique()) == [0, 1]
        pd.testing.assert_frame_equal(table[columns].reset_index(drop=True), whole[columns].reset_index(drop=True))
        pd.testing.assert_frame_equal(by_layer, whole_by_layer)
        table, _ = score(run, backend, layers=[1], top_examples=1, **quiet)
    assert sorted(table["layer"].unique()) == [1]
    assert any("layers 1 were computed with another held_out; they are dropped" in line for line in said)


def test_a_changed_prompt_replaces_the_memorys_explanation_and_each_memory_is_scored_once(fresh, monkeypatch):
    """When a memory's prompt changes (another ffkv or run), `explain` asks again for it alone and keeps only the new
    explanation: one per memory, direction and explainer, so `score` counts each memory once."""
    import ffkv.tools.explain as explain_module

    run, loaded = fresh
    lines = []
    with ChatServer() as server:
        first, backend = _explained(run, loaded, server)
        n = len(server.requests)
        plain = explain_module.explain_messages

        def changed(ctx, target, shown):
            messages = plain(ctx, target, shown)
            if target.key == PLANTED:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + " "}
            return messages
        monkeypatch.setattr(explain_module, "explain_messages", changed)
        second = explain(run, backend, memories=MEMORIES, loaded=loaded, progress=False, say=lines.append)
        assert len(server.requests) == n + 2  # the planted memory, both directions
        monkeypatch.setattr(explain_module, "explain_messages", plain)
        table, layers = score(run, backend, loaded=loaded, progress=False, say=lambda line: None)
    assert lines[0].startswith("explain: 2 requests") and lines[-1].startswith("explain: 2 earlier explanations replaced")
    assert len(second) == len(first) and not second.duplicated(["kind", "layer", "key", "direction"]).any()
    renewed = second[second["key"] == PLANTED]
    assert set(renewed["prompt_sha256"]).isdisjoint(first["prompt_sha256"])
    rest = ~second["key"].eq(PLANTED)
    assert list(second[rest]["prompt_sha256"]) == list(first[~first["key"].eq(PLANTED)]["prompt_sha256"])
    own = table[table["baseline"] == "own"]
    assert len(own) == len(second) and not own.duplicated(["kind", "layer", "key", "direction"]).any()
    assert layers.loc[0, "n_score"] == 2 * len(MEMORIES)


def test_a_table_with_two_explanations_of_one_memory_is_refused_by_its_readers(fresh):
    """An explanations table with two rows for one memory, direction and explainer (an older ffkv's, or one
    made by hand) would count that memory twice: `score` and the explorer's reader name it as damaged."""
    from ffkv.errors import DamagedRun
    from ffkv.experiments.explanations import memory_explanations

    run, loaded = fresh
    with ChatServer() as server:
        rows, backend = _explained(run, loaded, server)
    rd = RunDir(run)
    again = rows.iloc[[0]].assign(prompt_sha256="0" * 64, row=lambda r: r["row"].str.split("|").str[0] + "|" + "0" * 64)
    rd.write_metric("explanations", pd.concat([rows, again], ignore_index=True), rd.metric_description("explanations"),
                    step="explain")
    r = rows.iloc[0]
    named = f"memory {int(r['layer']) + 1}:{int(r['key'])}, direction {int(r['direction']):+d}"
    with pytest.raises(DamagedRun, match="explanations.parquet holds more than one explanation of 1 memory by one "
                                         f"explainer .*{re.escape(named)}"):
        score(run, backend, loaded=loaded, progress=False, say=lambda line: None)
    with pytest.raises(DamagedRun, match="run the same `ffkv explain"):
        memory_explanations(rd)


def test_two_explainers_are_scored_side_by_side_never_pooled(fresh):
    """Two explainers' explanations of the same memories: one per-layer row each, whose mean and n are that
    explainer's own rows' alone."""
    run, loaded = fresh
    with ChatServer() as server:
        _explained(run, loaded, server)
        other = ServerBackend(server.url, "rule-2", concurrency=4, timeout=10.0, retries=1, backoff=0.01)
        explain(run, other, memories=MEMORIES, loaded=loaded, progress=False, say=lambda line: None)
        table, layers = score(run, other, loaded=loaded, progress=False, say=lambda line: None)
    assert sorted(layers["explainer"]) == sorted(table["explainer"].unique()) and len(layers) == 2
    for r in layers.itertuples():
        own = table[(table["explainer"] == r.explainer) & (table["kind"] == "memory") & (table["baseline"] == "own")]
        assert r.n_score == len(own) == 2 * len(MEMORIES)
        assert r.score == pytest.approx(own["score"].mean(), abs=1e-12)
    from ffkv.experiments.explanations import BY_LAYER, reading

    said = reading(BY_LAYER, layers)  # the report's reading: each explainer's own means
    assert all(f"By {e}, over 1 layers and {2 * len(MEMORIES)} explanations" in said for e in layers["explainer"])


def test_stored_scores_of_a_layer_whose_explanation_was_replaced_are_dropped(fresh, monkeypatch):
    """`score --layers 2` keeps layer 1's stored scores only while they score layer 1's explanations as they are
    now: once `explain` replaced one, they are dropped with a line, never shown beside the new explanation."""
    import ffkv.tools.explain as explain_module

    run, loaded = fresh
    memories = [(0, PLANTED), (0, 1), (1, 2), (1, 3)]
    said = []
    quiet = dict(loaded=loaded, progress=False, say=said.append)
    with ChatServer() as server:
        backend = ServerBackend(server.url, "rule", concurrency=4, timeout=10.0, retries=1, backoff=0.01)
        explain(run, backend, memories=memories, **quiet)
        score(run, backend, **quiet)
        score(run, backend, layers=[1], **quiet)
        assert not any("dropped" in line for line in said)  # nothing changed: layer 1's scores are kept
        plain = explain_module.explain_messages

        def changed(ctx, target, shown):
            messages = plain(ctx, target, shown)
            if target.layer == 0 and target.key == 1:  # the server's rule now names 'z': another explanation
                messages[-1] = {**messages[-1], "content": "z[[10]]\n" + messages[-1]["content"]}
            return messages
        monkeypatch.setattr(explain_module, "explain_messages", changed)
        explain(run, backend, memories=memories, **quiet)
        assert any(line.startswith("explain: 2 earlier explanations replaced") for line in said)
        table, by_layer = score(run, backend, layers=[1], **quiet)
        assert any(line.startswith("score: the explanations of layers 1 have changed") for line in said)
        assert sorted(table["layer"].unique()) == [1] and list(by_layer["layer"]) == [1]
        table, _ = score(run, backend, layers=[0], **quiet)
    assert sorted(table["layer"].unique()) == [0, 1]  # layer 2's are still its explanations' scores
