"""Key patterns (SPEC 4): shallow scores by hand-set trigger tables, semantic score, human workflow."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from support.experiment_runs import make_run
from support.helpers import replace_triggers
from ffkv.errors import FfkvError
from ffkv.experiments import analyze
from ffkv.tools.annotate import export_sample, import_labels
from ffkv.experiments.patterns import cohen_kappa, masked_length


def set_triggers(run, rows):
    """Replace the run's trigger table by hand-set (layer, key, rank, example_id, position) rows."""
    df = pd.DataFrame(rows, columns=["layer", "key", "rank", "example_id", "position"])
    df["coefficient"] = 1.0 - 0.01 * df["rank"]
    df["next_token_id"] = -1
    df["direction"] = 1
    replace_triggers(run, df)


@pytest.fixture(scope="module")
def patterned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("patterns")
    run, loaded = make_run(folder, "gpt2", n=80)
    examples = pd.read_parquet(run / "examples.parquet")
    ids = examples["example_id"].to_numpy()
    tokens = {int(e): np.asarray(t) for e, t in zip(examples["example_id"], examples["token_ids"])}
    rows = []
    # Key (0, 0): every prefix ends with the token 'a' (" a" and "a" share the char-level last token 'a').
    ends_a = [(e, i) for e in ids for i, t in enumerate(tokens[e]) if t == tokens[e][0] * 0 + (4 + ord("a") % 93)][:8]
    rows += [(0, 0, r, e, p) for r, (e, p) in enumerate(ends_a)]
    # Key (0, 1): 8 prefixes of 8 examples, ending at their first token (different words mostly).
    rows += [(0, 1, r, int(e), 0) for r, e in enumerate(ids[:8])]
    # Key (2, 2): one example's prefix 8 times, ending at different positions of its longest words:
    # identical context -> semantic; endings differ -> not shallow.
    longest = max(ids, key=lambda e: len(tokens[e]))
    rows += [(2, 2, r, int(longest), int(p)) for r, p in enumerate(range(len(tokens[longest]) - 8, len(tokens[longest])))]
    set_triggers(run, rows)
    analyze(run, only="patterns", loaded=loaded, progress=False)
    keys = pd.read_parquet(run / "metrics" / "patterns_keys.parquet").set_index(["layer", "key"])
    return run, loaded, keys, tokens, rows


def test_shallow_score_is_the_share_of_the_most_common_ending(patterned):
    run, loaded, keys, tokens, rows = patterned
    for (layer, key), g in pd.DataFrame(rows, columns=["layer", "key", "rank", "e", "p"]).groupby(["layer", "key"]):
        for n in (1, 2, 3):
            suffixes = [tuple(tokens[e][max(0, p + 1 - n): p + 1]) for e, p in zip(g["e"], g["p"]) if p + 1 >= n]
            best = max(suffixes.count(s) for s in set(suffixes)) if suffixes else 0
            column = "shallow_score" if n == 1 else f"shallow_score_{n}"
            assert keys.loc[(layer, key), column] == pytest.approx(best / len(g))
    assert keys.loc[(0, 0), "shallow_score"] == 1.0
    assert keys.loc[(0, 0), "label"] in ("shallow", "both")
    suffix = list(keys.loc[(0, 0), "shared_suffix"])
    assert suffix[-1] == 4 + ord("a") % 93  # the longest ending shared by >= 30%, ending in 'a'
    assert f"ends with {loaded.tokenizer.decode(suffix)!r}" in keys.loc[(0, 0), "description"]


def test_identical_contexts_are_semantic(patterned):
    run, loaded, keys, tokens, rows = patterned
    assert keys.loc[(2, 2), "is_semantic"]
    assert keys.loc[(2, 2), "semantic_z"] >= 3 and keys.loc[(2, 2), "mean_pairwise_cosine"] > 0.5
    # Key (0, 1) ends at each example's first token: no body left once the trigger token is left out.
    assert keys.loc[(0, 1), "n_embedded"] == 0 and np.isnan(keys.loc[(0, 1), "semantic_z"])
    assert not keys.loc[(0, 1), "is_semantic"]
    per_layer = pd.read_parquet(run / "metrics" / "patterns.parquet")
    assert per_layer.shape[0] == 3
    label_shares = per_layer[[f"keys_{l}" for l in ("shallow", "semantic", "both", "none")]].sum(axis=1)
    np.testing.assert_allclose(label_shares, np.where(per_layer["n_keys"] > 0, 1.0, 0.0))  # layer 1 has no keys here
    prefixes = pd.read_parquet(run / "metrics" / "patterns_prefixes.parquet")
    assert len(prefixes) == len(rows)


def test_masked_length():
    assert masked_length(np.array([5, 4, 3]), (4, 5)) == 2  # tail is last-first; the suffix in text order
    assert masked_length(np.array([5, 9, 3]), (4, 5)) == 1
    assert masked_length(np.array([6, 4, 3]), (4, 5)) == 0
    assert masked_length(np.array([5, 4, 3]), ()) == 0


def test_human_workflow_round_trip(patterned, tmp_path):
    run, loaded, keys, tokens, rows = patterned
    sample = export_sample(run, tmp_path / "sample.csv", keys_per_layer=40, top=3, loaded=loaded)
    table = pd.read_csv(sample, keep_default_na=False)
    assert set(table.columns) >= {"memory", "rank", "prefix", "label"} and (table["rank"] < 3).all()
    # Memories are written LAYER:KEY with layers from 1, as the explorer and the command write them.
    memories = [tuple(int(x) for x in m.split(":")) for m in table["memory"]]
    assert min(l for l, _ in memories) == 1 and max(l for l, _ in memories) == loaded.view.n_layers
    # Label every exported key with the automatic label: agreement 1, kappa 1.
    table["label"] = [keys.loc[(l - 1, k), "label"] for l, k in memories]
    table.to_csv(tmp_path / "filled.csv", index=False)
    assert import_labels(run, tmp_path / "filled.csv", annotator="me") == table["memory"].nunique()
    analyze(run, only="patterns", loaded=loaded, progress=False)
    human = pd.read_parquet(run / "metrics" / "patterns_human.parquet")
    assert (human["agreement"].dropna() == 1.0).all()
    assert (run / "figures" / "patterns_human.png").exists()
    # A different label everywhere: agreement 0.
    flip = {"shallow": "semantic", "semantic": "none", "both": "none", "none": "shallow"}
    table["label"] = table["label"].map(flip)
    table.to_csv(tmp_path / "flipped.csv", index=False)
    import_labels(run, tmp_path / "flipped.csv", annotator="me")
    analyze(run, only="patterns", loaded=loaded, progress=False)
    assert (pd.read_parquet(run / "metrics" / "patterns_human.parquet")["agreement"].dropna() == 0.0).all()
    flipped = table.copy()
    table.loc[0, "label"] = "deep"
    table.to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(FfkvError, match="unknown label 'deep'"):
        import_labels(run, tmp_path / "bad.csv")
    # A CSV of an older export names keys by layer and key from 0: read by that convention, the same labels.
    old = flipped.assign(layer=[l - 1 for l, _ in memories], key=[k for _, k in memories]).drop(columns="memory")
    old.to_csv(tmp_path / "old.csv", index=False)
    assert import_labels(run, tmp_path / "old.csv", annotator="old") == table["memory"].nunique()
    stored = pd.read_parquet(run / "annotations" / "labels.parquet")
    mine = stored[stored["annotator"] == "me"].set_index(["layer", "key"])["label"]
    theirs = stored[stored["annotator"] == "old"].set_index(["layer", "key"])["label"]
    assert len(theirs) == len(mine) and (theirs == mine.reindex(theirs.index)).all()
    table.loc[0, "memory"] = f"{loaded.view.n_layers + 1}:0"
    table.to_csv(tmp_path / "outside.csv", index=False)
    with pytest.raises(FfkvError, match="line 2: memory .* does not exist"):
        import_labels(run, tmp_path / "outside.csv")


def test_cohen_kappa():
    a = np.array(["x", "x", "y", "y"])
    assert cohen_kappa(a, a) == 1.0
    assert cohen_kappa(a, np.array(["y", "y", "x", "x"])) == -1.0


def test_tables_state_the_thresholds_and_their_calibration(patterned):
    from ffkv.experiments import semantic
    from ffkv.report.content import build_sections
    from ffkv.store.run import RunDir

    run, *_ = patterned
    description = RunDir(run).metric_description("patterns")
    assert description["semantic_z"] == semantic.SEMANTIC_Z == 3.0
    assert "semantic: z >= 3" in description["labels"] and semantic.CALIBRATION_NOTE in description["labels"]
    assert description["calibration"].startswith("on this run's corpus: z >= 3: false positives")
    how = dict(next(s for s in build_sections(RunDir(run)) if s.name == "patterns").how)
    assert "z >= 3" in how["labels"] and "calibration" in how  # the report shows both


def test_mixed_key_control_per_layer(patterned, tmp_path):
    run, *_ = patterned
    per_layer = pd.read_parquet(run / "metrics" / "patterns.parquet")
    # 3 keys at most per layer here, fewer than the set size: no control sets, and a NaN share (not 0).
    assert (per_layer["n_control_sets"] == 0).all() and per_layer["semantic_control"].isna().all()
    # Layer 0: 30 keys whose prefixes all come from one example (any mix of keys is one context): control 1.
    # Layer 1: 30 keys of prefixes of random examples: control sets are random sets.
    run, loaded = make_run(tmp_path, "gpt2", n=120)
    examples = pd.read_parquet(run / "examples.parquet")
    tokens = {int(e): len(t) for e, t in zip(examples["example_id"], examples["token_ids"])}
    longest = max(tokens, key=tokens.get)
    rng = np.random.default_rng(0)
    rows = [(0, key, r, longest, tokens[longest] - 1 - r - key % 3) for key in range(30) for r in range(6)]
    ids = [e for e in tokens if tokens[e] >= 8]
    rows += [(1, key, r, int(e), int(rng.integers(5, tokens[e]))) for key in range(30)
             for r, e in enumerate(rng.choice(ids, 6, replace=False))]
    set_triggers(run, rows)
    analyze(run, only="patterns", loaded=loaded, progress=False)
    per_layer = pd.read_parquet(run / "metrics" / "patterns.parquet").set_index("layer")
    assert per_layer.loc[0, "n_control_sets"] == 100 and per_layer.loc[1, "n_control_sets"] >= 90  # some lack content
    assert per_layer.loc[0, "semantic_control"] == 1.0
    assert per_layer.loc[1, "semantic_control"] <= 0.1
    assert np.isnan(per_layer.loc[2, "semantic_control"])  # no keys


def test_key_shares_carry_their_wilson_interval():
    """3 of 10 keys shallow: the 95% Wilson interval is 0.1078-0.6032 (by hand: centre (3 + 1.92) / 13.84,
    half-width 1.96·sqrt(2.1 + 0.96) / 13.84); 0 of 10 semantic: 0-0.2775."""
    from ffkv.experiments.patterns import shares

    keys = pd.DataFrame({"layer": [0] * 10, "label": ["shallow"] * 3 + ["none"] * 7})
    row = shares(keys, None, 1).iloc[0]
    assert row["keys_shallow"] == pytest.approx(0.3) and row["n_keys"] == 10
    assert (row["keys_shallow_ci_low"], row["keys_shallow_ci_high"]) == pytest.approx((0.1078, 0.6032), abs=1e-4)
    assert (row["keys_semantic_ci_low"], row["keys_semantic_ci_high"]) == pytest.approx((0.0, 0.2775), abs=1e-4)
