"""`latents_beside`: every latent measure beside the neurons' in one table with one verdict rule (checked on
hand-built rows), and the dictionary's fidelity against exact answers (a dictionary that is the layer itself
reconstructs it perfectly; a random one against a brute force written here); on a real run, the table reads what
the studies wrote, and a run without a dictionary gets nothing."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.dictionaries import Dictionary, save_npz
from ffkv.experiments import analyze, latents_beside
from ffkv.experiments.common import MIN_N
from ffkv.experiments.latents_beside import MEASURES, rows_of, verdict
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.memories.sets import Latents
from support.helpers import loaded_tiny
from support.runs import corpus_lines, sharpen


def test_the_verdict_rule():
    assert verdict(MIN_N, MIN_N, 0.01, 0.2) == "latents higher"
    assert verdict(500, 900, -0.3, -0.01) == "neurons higher"
    assert verdict(500, 900, -0.01, 0.2).startswith("cannot say")
    assert verdict(MIN_N - 1, 900, 0.01, 0.2).startswith("no verdict")
    assert verdict(500, MIN_N - 1, 0.01, 0.2).startswith("no verdict")
    assert verdict(500, 900, math.nan, math.nan).startswith("no verdict")
    assert verdict(500, 900, 0.01, 0.2, 256, 256) == "latents higher"
    # an excess over 5 control latents: the n beside the shares are enough, the null's is not, and it says so
    assert verdict(500, 900, 0.01, 0.2, 5, 256) == f"no verdict (fewer than {MIN_N} in a null)"
    assert verdict(50, 900, 0.01, 0.2, 5, 256) == f"no verdict (fewer than {MIN_N} judged)"


def test_the_tables_are_typed_even_when_empty():
    """An empty table of untyped columns would be written as columns of nulls, which a reader (the explorer's
    overview) cannot tell from a damaged one."""
    import pyarrow as pa

    for schema in (latents_beside.SCHEMA, latents_beside.FIDELITY_SCHEMA):
        written = pa.Table.from_pandas(latents_beside.typed([], schema), preserve_index=False).schema
        assert written.names == schema.names
        for f in schema:
            have = written.field(f.name).type
            assert (pa.types.is_string(have) or pa.types.is_large_string(have)) if pa.types.is_string(f.type) \
                else have == f.type, f.name


def test_an_excess_over_a_null_of_few_gets_no_verdict():
    """SmolLM2's layer 15: 2,835 latents judged but 5 control latents alive: no verdict on the excess."""
    patterns = next(m for m in MEASURES if m.column == "any_pattern")
    row = {"layer": 14, "any_pattern_latents": 0.76, "n_live_latents": 2835, "any_pattern_latents_control": 0.0,
           "any_pattern_neurons": 0.33, "n_live_neurons": 1536, "any_pattern_neurons_control": 0.36,
           "excess_latents_minus_neurons": 0.8, "excess_latents_minus_neurons_ci_low": 0.36,
           "excess_latents_minus_neurons_ci_high": 0.86, "n_control_latents": 5, "n_control_neurons": 256}
    got = rows_of(patterns, pd.DataFrame([row]), 1536)[0]
    assert got["verdict"].startswith("no verdict") and got["difference_ci_low"] == 0.36
    got = rows_of(patterns, pd.DataFrame([{**row, "n_control_latents": 256}]), 1536)[0]
    assert got["verdict"] == "latents higher"


def test_rows_read_each_part_from_its_column_and_the_neurons_null_from_their_table():
    vocab = next(m for m in MEASURES if m.column == "partition_class")
    table = pd.DataFrame({"layer": [1, 2], "partition_share": [0.3, 0.02], "partition_share_ci_low": [0.25, 0.0],
                          "partition_share_ci_high": [0.35, 0.05], "n_keys": [400, 40],
                          "partition_share_control": [0.01, 0.01], "partition_share_neurons": [0.1, 0.01],
                          "partition_share_neurons_ci_low": [0.08, 0.0], "partition_share_neurons_ci_high": [0.12, 0.03],
                          "partition_share_minus_neurons": [0.2, 0.01], "partition_share_minus_neurons_ci_low": [0.14, -0.03],
                          "partition_share_minus_neurons_ci_high": [0.26, 0.05]})
    neurons = pd.DataFrame({"layer": [1, 2], "partition_share_control": [0.05, 0.06]})
    rows = pd.DataFrame(rows_of(vocab, table, d_m=256, neurons=neurons))
    assert list(rows.columns) == latents_beside.COLUMNS
    first, second = rows.iloc[0], rows.iloc[1]
    assert (first.latents, first.latents_ci_low, first.n_latents, first.latents_null) == (0.3, 0.25, 400, 0.01)
    assert (first.neurons, first.neurons_ci_high, first.n_neurons, first.neurons_null) == (0.1, 0.12, 256, 0.05)
    assert (first.difference, first.verdict) == (0.2, "latents higher")
    assert second.neurons_null == 0.06 and second.verdict.startswith("no verdict")  # 40 latents judged
    assert rows_of(vocab, table.drop(columns=["partition_share_minus_neurons"]), 256) == []  # not this measure


def _copy_of_layer(view, layer: int) -> Dictionary:
    """A transcoder that is a ReLU model's FF layer itself: encoder = keys, decoder = values, bias = value bias."""
    return Dictionary(kind="transcoder", layer=layer, encoder=view.keys(layer).detach().clone(),
                      encoder_bias=view.key_bias(layer).detach().clone(), decoder=view.values(layer).detach().clone(),
                      decoder_bias=view.value_bias(layer).detach().clone(), activation="relu")


class _Context:
    """What `dictionary_fidelity` reads of a `RunContext`: the model and held-out examples."""

    def __init__(self, loaded, examples):
        from types import SimpleNamespace

        self.loaded, self.view, self.tokenizer = loaded, loaded.view, loaded.tokenizer
        self._held = SimpleNamespace(examples=examples)

    def held_out(self):
        return self._held


def _examples(loaded, n=12):
    from types import SimpleNamespace

    return [SimpleNamespace(token_ids=np.asarray(loaded.tokenizer.encode(line))) for line in corpus_lines(n)]


def test_a_dictionary_that_is_its_layer_has_fvu_0_and_recovers_the_whole_loss():
    loaded = sharpen(loaded_tiny("opt"))
    ctx = _Context(loaded, _examples(loaded))
    table = latents_beside.dictionary_fidelity(ctx, Latents(loaded.view, {1: _copy_of_layer(loaded.view, 1)}))
    row = table.iloc[0]
    assert row.layer == 1 and row.fvu < 1e-10
    assert row.loss_spliced == pytest.approx(row.loss_original, abs=1e-5)
    assert row.loss_mean_ablated != row.loss_original and row.loss_recovered == pytest.approx(1.0, abs=1e-4)


def test_fidelity_of_a_random_dictionary_matches_a_brute_force():
    """FVU and dead latents recomputed here over the same real tokens, one example at a time (no padding)."""
    loaded = sharpen(loaded_tiny("gpt2"))
    view, layer, n = loaded.view, 2, 16
    g = torch.Generator().manual_seed(3)
    d = Dictionary(kind="sae", layer=layer, encoder=torch.randn(n, view.d_model, generator=g),
                   encoder_bias=torch.where(torch.arange(n) < 10, 0.0, -1e3), decoder=torch.randn(n, view.d_model, generator=g),
                   decoder_bias=torch.zeros(view.d_model), activation="relu", input_bias=torch.zeros(view.d_model))
    examples = _examples(loaded)
    row = latents_beside.dictionary_fidelity(_Context(loaded, examples), Latents(view, {layer: d})).iloc[0]
    outs, fired = [], torch.zeros(n, dtype=torch.bool)
    for e in examples:
        ids = torch.tensor([e.token_ids])
        with torch.no_grad(), view.capture(("ff_out",), layers=[layer]) as cap:
            view.forward(ids)
        out = cap["ff_out"][layer].reshape(len(e.token_ids), -1)
        a = torch.relu(out @ d.encoder.T + d.encoder_bias)
        outs.append((out.double(), (a @ d.decoder).double()))
        fired |= (a > 0).any(0)
    x = torch.cat([o for o, _ in outs])
    err = torch.cat([o - r for o, r in outs])
    want = float(err.square().sum() / (x - x.mean(0)).square().sum())
    assert row.eval_tokens == len(x) and row.fvu == pytest.approx(want, rel=1e-4)
    assert row.dead_latents == int((~fired).sum()) and 6 <= row.dead_latents < n  # the six with a bias of -1000, and more


def test_on_a_run_the_table_reads_the_studies_and_a_run_without_latents_skips_it(tmp_path):
    loaded = sharpen(loaded_tiny("opt"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines(60)) + "\n")
    path = save_npz(_copy_of_layer(loaded.view, 1), tmp_path / "copy.npz")
    spec = CorpusSpec(source=str(corpus), unit="line")
    build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=3, control_keys=16), progress=False,
                dictionary=path)
    done = analyze(tmp_path / "run", only=["values", "vocabulary_classes", "latents_beside"], loaded=loaded,
                   progress=False, n_eval=20)
    assert not done["latents_beside"].get("skipped")
    table = pd.read_parquet(tmp_path / "run" / "metrics" / "latents_beside.parquet")
    assert set(table.study) == {"values_latents", "vocabulary_classes_latents"} and (table.layer == 1).all()
    values = pd.read_parquet(tmp_path / "run" / "metrics" / "values_latents.parquet").iloc[0]
    row = table[table.measure == "agreement_rate"].iloc[0]
    assert row.latents == values["agreement_rate"] and row.difference == values["agreement_rate_minus_neurons"]
    fidelity = pd.read_parquet(tmp_path / "run" / "metrics" / "latents_beside_dictionary.parquet").iloc[0]
    assert fidelity.fvu < 1e-10 and fidelity.loss_recovered == pytest.approx(1.0, abs=1e-4)
    assert (tmp_path / "run" / "figures" / "latents_beside.png").exists()
    build_index(loaded, spec, tmp_path / "plain", IndexOptions(top_k=3), progress=False)
    done = analyze(tmp_path / "plain", only=["latents_beside"], loaded=loaded, progress=False, n_eval=20)
    assert done["latents_beside"]["tables"] == [] and "without a dictionary" in done["latents_beside"]["latents"]
    assert not list((tmp_path / "plain" / "metrics").glob("latents_beside*"))


def test_the_composition_verdict_reads_the_difference_the_right_way_round():
    """From what is observed: the layer's top token is one firing latent's own top token in 90% of the examples
    (10% with the pairing shuffled), one neuron's in 30% (10% shuffled). So the top prediction is one latent's more
    often beyond chance: the latents' excess *composition* (the top token being nobody's) minus the neurons' is
    (0.1 - 0.9) - (0.7 - 0.9) = -0.6, and the verdict names the latents (the demo's -6.3 points [-10.7, -1.9] were
    once read as the neurons')."""
    from ffkv.experiments.composition import composition_verdict, excess_composition

    n = 1000
    rows = np.arange(n)
    latents, neurons, shuffled = rows % 10 != 0, rows % 10 < 3, rows % 10 == 5
    found = excess_composition(latents, shuffled, neurons, shuffled, np.ones(n, dtype=bool))
    assert abs(found["excess_composition_latents_minus_neurons"] - (-0.6)) < 1e-12
    assert "one latent's more often" in found["verdict_composition"]
    found = excess_composition(neurons, shuffled, latents, shuffled, np.ones(n, dtype=bool))
    assert "one neuron's more often" in found["verdict_composition"]
    assert composition_verdict(-0.1, 0.1, 1000).startswith("undecided")
    assert composition_verdict(-0.2, -0.01, 50).startswith("no verdict")


def test_the_explanation_score_row_reads_the_excess_over_shuffled_with_the_verdict_rule():
    """One row per dictionary layer and explainer of explanation_scores_latents (`ffkv score`): the latents' and the
    neurons' mean scores, each beside its shuffled baseline, and the difference of their excesses; no verdict under
    MIN_N scored per kind, nor where a shuffled baseline has fewer."""
    measure = next(m for m in MEASURES if m.column == "explanation_score")
    row = {"layer": 0, "explainer": "openai:x#m", "score_latents": 0.4, "score_latents_ci_low": 0.35,
           "score_latents_ci_high": 0.45, "n_score_latents": 120, "shuffled_latents": 0.1, "n_shuffled_latents": 120,
           "score_neurons": 0.2, "score_neurons_ci_low": 0.15, "score_neurons_ci_high": 0.25, "n_score_neurons": 150,
           "shuffled_neurons": 0.05, "n_shuffled_neurons": 150, "excess_latents_minus_neurons": 0.15,
           "excess_latents_minus_neurons_ci_low": 0.05, "excess_latents_minus_neurons_ci_high": 0.25}
    got = rows_of(measure, pd.DataFrame([row]), 256)[0]
    assert (got["latents"], got["n_latents"], got["latents_null"]) == (0.4, 120, 0.1)
    assert (got["neurons"], got["n_neurons"], got["neurons_null"]) == (0.2, 150, 0.05)
    assert got["difference"] == 0.15 and got["verdict"] == "latents higher" and "openai:x#m" in got["label"]
    assert rows_of(measure, pd.DataFrame([{**row, "n_score_latents": MIN_N - 1}]), 256)[0]["verdict"].startswith(
        "no verdict")
    assert rows_of(measure, pd.DataFrame([{**row, "n_shuffled_neurons": MIN_N - 1}]), 256)[0]["verdict"].startswith(
        "no verdict")
    assert rows_of(measure, pd.DataFrame([{**row, "excess_latents_minus_neurons_ci_low": -0.01}]), 256)[0][
        "verdict"].startswith("cannot say")


def test_the_excess_verdict_says_higher_or_lower_never_exceeds():
    """The census's and patterns' verdict on each kind's excess over its own control: higher or lower, so that dead
    latents far below their random controls (SmolLM2: 21.5% against 78.9%, neurons 0% against 0%) read as the
    latents lower, never as the neurons "exceeding" anything."""
    from ffkv.experiments.common import MIN_N, excess_verdict

    assert excess_verdict(-0.62, -0.52, 1000) == "latents lower than neurons, each against its own control"
    assert excess_verdict(0.1, 0.3, 1000) == "latents higher than neurons, each against its own control"
    assert excess_verdict(-0.1, 0.3, 1000).startswith("undecided")
    assert excess_verdict(0.1, 0.3, MIN_N - 1, judged="labelled").startswith(f"no verdict: {MIN_N - 1} memories of "
                                                                               "one kind or control are labelled")
