"""Figure 2's labels for a dictionary's latents beside the neurons (`ffkv.experiments.patterns.latent_pattern_tables`),
on ffkv-tiny with its shipped transcoder: each latent's shallow score recounted from the latent trigger table and
the examples, dead latents exactly those that never fired, the shares and the excess over control recomputed from
the per-memory labels."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from ffkv.corpus import CorpusSpec
from ffkv.experiments import analyze
from ffkv.experiments.patterns import PATTERN_LABELS, SHALLOW_SHARE
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import load_model
from ffkv.models.default_corpus import default_corpus_path
from ffkv.models.tiny_lm import tiny_transcoders_path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("patterns_latents") / "run"
    loaded = load_model("ffkv-tiny")
    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=300, shuffle_seed=0)
    build_index(loaded, spec, out, IndexOptions(top_k=8, control_keys=64), progress=False,
                dictionary=tiny_transcoders_path())
    analyze(out, only=["patterns"], loaded=loaded, progress=False)
    return out


def test_latent_labels_and_shares_recount_from_the_tables(run):
    read = lambda name: pd.read_parquet(run / "metrics" / f"{name}.parquet")  # noqa: E731
    layers, keys, neuron_keys = read("patterns_latents"), read("patterns_latents_keys"), read("patterns_keys")
    trig = pd.read_parquet(run / "latent_trigger_examples.parquet")
    examples = pq.read_table(run / "examples.parquet").to_pandas().set_index("example_id")["token_ids"]
    assert list(layers["layer"]) == [3] and len(keys) == 512
    # Dead: exactly the latents without a trigger.
    fired = set(trig["key"])
    assert set(keys.loc[keys["dead"], "key"]) == set(range(512)) - fired and int(layers["n_dead"].iloc[0]) == 512 - len(fired)
    # Shallow score: the share of a latent's trigger prefixes ending in its most common last token.
    last = [int(examples[e][p]) for e, p in zip(trig["example_id"], trig["position"])]
    share = trig.assign(last=last).groupby("key")["last"].agg(lambda v: v.value_counts().iloc[0] / len(v))
    fired_keys = keys[~keys["dead"]].set_index("key")
    np.testing.assert_allclose(fired_keys["shallow_score"].to_numpy(), share.reindex(fired_keys.index).to_numpy())
    # Rare: fired in fewer than min(5, top-k) examples; labelled rare and left out, as the dead are.
    counts = trig.groupby("key").size()
    assert (fired_keys["rare"] == (counts.reindex(fired_keys.index) < 5)).all()
    assert (fired_keys.loc[fired_keys["rare"], "label"] == "rare").all()
    row = layers.iloc[0]
    assert int(row["n_rare"]) == int(fired_keys["rare"].sum()) and int(row["n_keys"]) == int((~fired_keys["rare"]).sum())
    live = fired_keys[~fired_keys["rare"]]
    assert (live["is_shallow"] == (share.reindex(live.index) >= SHALLOW_SHARE)).all()
    # The measure beside the neurons, recomputed from the labels.
    assert row["any_pattern_latents"] == pytest.approx(np.isin(live["label"], PATTERN_LABELS).mean())
    mine = neuron_keys[(neuron_keys["layer"] == 3) & ~neuron_keys["dead"]]
    assert row["any_pattern_neurons"] == pytest.approx(np.isin(mine["label"], PATTERN_LABELS).mean())
    excess = (row["any_pattern_latents"] - row["any_pattern_latents_control"]) \
        - (row["any_pattern_neurons"] - row["any_pattern_neurons_control"])
    assert row["excess_latents_minus_neurons"] == pytest.approx(excess)
    assert row["excess_latents_minus_neurons_ci_low"] < excess < row["excess_latents_minus_neurons_ci_high"]
    assert (run / "figures" / "patterns_latents.png").is_file()


def test_every_study_says_what_it_reads_on_latents(run):
    """The latent_applicability table a run with a dictionary gets: one row per registered study, the ones that
    read latents naming their tables (which the run holds once they ran), the others saying why not."""
    from ffkv.experiments import registry
    from ffkv.experiments.latent_kinds import NOT_YET

    table = pd.read_parquet(run / "metrics" / "latent_applicability.parquet")
    assert list(table["experiment"]) == list(registry.experiments())
    said = table.set_index("experiment")
    assert said.at["patterns", "applies"] and said.at["patterns", "statement"].startswith("patterns_latents")
    assert (run / "metrics" / "patterns_latents.parquet").is_file()
    assert not said.at["translators", "applies"] and said.at["translators", "statement"].startswith("not applicable")
    assert said.at["refinement", "statement"].startswith("not applicable") and not said.at["refinement", "applies"]
    assert said.at["membership", "applies"] and said.at["membership", "statement"].startswith("membership_latents")
    assert said.at["pruning", "applies"] and said.at["pruning", "statement"].startswith("pruning_latents")
    assert NOT_YET not in set(said["statement"])  # every study says what it reads on latents, or why not
    assert said.at["lookups", "applies"]
    assert said.at["census", "applies"] and said.at["census", "statement"].startswith("census_latents")
    assert set(said.loc[said["applies"], "statement"].str.split(":").str[0].str.split(", ").sum()) <= {
        "values_latents", "values_latents_keys", "patterns_latents", "patterns_latents_keys",
        "vocabulary_classes_latents", "vocabulary_classes_latents_keys", "census_latents", "census_latents_keys",
        "census_latents_control", "composition_latents", "suppressed_latents", "latents_beside",
        "latents_beside_dictionary", "explanation_scores_latents", "ablations_latents", "ablations_latents_prefixes",
        "membership_latents", "confidence_neurons_latents", "confidence_neurons_latents_keys",
        "confidence_neurons_latents_measured", "pruning_latents", "explorer/latent_stats.parquet",
        "explorer/latent_value_top_tokens.parquet", "explorer/latent_trigger_coefficients.npy",
        "explorer/explorer.duckdb"}


def test_the_run_summary_names_the_dictionary_in_words(run):
    from ffkv.presentation.summary import manifest_summary
    from ffkv.store.run import RunDir

    rows = dict(manifest_summary(RunDir(run).manifest()))
    assert rows["dictionary"].startswith("transcoder at layer 4: 512 latents, topk k=16 (")
    assert "sha256" not in rows["index"] and "dictionary" not in rows["index"]
