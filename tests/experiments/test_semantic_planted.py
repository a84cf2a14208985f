"""The semantic label keeps its stated recall on planted topics (issue 28): the control's cut-off raises the bar
a key must pass, and `patterns.semantic_recall` states what share of planted topics still passes it; keys whose
trigger examples *are* planted topics must be found at least that often.

ffkv-tiny (its own KJV corpus) indexed for real; then 60 live keys of the top layer get trigger examples planted
by hand: each a set of prefixes of different verses that hold a word of one hand-picked topic (sheep, flock,
shepherd, ...), ending a few tokens after it, so no word or ending is shared by the set, only the topic. The
topics are chosen by hand, not by the calibration's co-occurrence topics, so the check is independent of how the
stated recall is measured. The rest of the pipeline is the real one (`ffkv analyze --only patterns`).

On this tiny model the random directions of the top layer already reach z of about 12, so the stated recall is low
(about 10%; planted sets score a median z of 4.8, as the real keys' and the random directions' do): the test
holds the label to what it states, and Figure 2 to no verdict, not to a recall this model cannot give.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ffkv.corpus import CorpusSpec
from ffkv.experiments import analyze
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import load_model
from ffkv.models.default_corpus import default_corpus_path
from ffkv.store.run import RunDir
from support.helpers import replace_triggers

TOPICS = (
    ("sheep", "flock", "shepherd", "lamb", "lambs", "goats", "fold", "rams"),
    ("gold", "silver", "brass", "shekels", "talents", "precious", "stones", "jewels"),
    ("sword", "battle", "army", "spear", "horsemen", "chariots", "war", "slew"),
    ("bread", "wine", "drink", "feast", "meat", "cakes", "corn", "eat"),
    ("king", "throne", "reign", "crown", "kingdom", "princes", "palace", "queen"),
    ("water", "river", "sea", "waters", "rain", "fountain", "well", "flood"),
)
N_PLANTED = 60
TOP_K = 20


def _planted_sets(examples: pd.DataFrame, tokenizer, rng) -> list[list[tuple[int, int]]]:
    """N_PLANTED sets of TOP_K (example_id, position): a topic's words in turn, each prefix from another verse
    that holds the word, ending 1 to 4 tokens after it."""
    holders: dict[str, list[tuple[int, int]]] = {}
    for row in examples.itertuples():
        ids = list(row.token_ids)
        for topic in TOPICS:
            for word in topic:
                piece = [t for t in tokenizer.encode(" " + word) if t not in tokenizer.special_ids]
                for p in range(len(ids) - len(piece)):
                    if ids[p:p + len(piece)] == piece:
                        end = p + len(piece) - 1
                        if end + 2 < len(ids):
                            holders.setdefault(word, []).append((int(row.example_id), end))
                        break
    sets = []
    for s in range(N_PLANTED):
        words = TOPICS[s % len(TOPICS)]
        chosen, used = [], set()
        for j in range(TOP_K * 8):
            options = [(e, q) for e, q in holders.get(words[j % len(words)], []) if e not in used]
            if not options:
                continue
            e, q = options[int(rng.integers(len(options)))]
            used.add(e)
            length = len(examples.loc[e, "token_ids"])
            chosen.append((e, int(min(length - 2, q + rng.integers(1, 5)))))
            if len(chosen) == TOP_K:
                break
        assert len(chosen) == TOP_K, words
        sets.append(chosen)
    return sets


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    loaded = load_model("ffkv-tiny")
    folder = tmp_path_factory.mktemp("planted-topics")
    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=1500, shuffle_seed=0)
    run = build_index(loaded, spec, folder / "run", IndexOptions(top_k=TOP_K), progress=False)
    top = loaded.view.n_layers - 1
    triggers = pd.read_parquet(run.table("trigger_examples"))
    examples = pd.read_parquet(run.table("examples")).set_index("example_id", drop=False)
    rng = np.random.default_rng(5)
    # Live keys: their largest coefficient is kept, so they stay as active as they were.
    firing = triggers[(triggers["layer"] == top) & (triggers["direction"] == 1) & (triggers["rank"] == 0)]
    keys = firing.sort_values("coefficient", ascending=False)["key"].to_numpy()[:N_PLANTED]
    columns = {c: triggers[c].to_numpy().copy() for c in ("example_id", "position", "next_token_id")}
    for key, planted in zip(keys, _planted_sets(examples, loaded.tokenizer, rng)):
        rows = np.flatnonzero((triggers["layer"] == top) & (triggers["key"] == key) & (triggers["direction"] == 1))
        columns["example_id"][rows] = [e for e, _ in planted]
        columns["position"][rows] = [p for _, p in planted]
        columns["next_token_id"][rows] = [int(examples.loc[e, "token_ids"][p + 1]) for e, p in planted]
    triggers = triggers.assign(**columns)
    replace_triggers(run.path, triggers)
    heldout = CorpusSpec(source=str(default_corpus_path("heldout")), unit="line")
    analyze(folder / "run", only="patterns", loaded=loaded, eval_corpus=heldout, n_eval=100, progress=False)
    return RunDir(folder / "run"), top, keys


def test_planted_topic_keys_are_found_at_the_stated_recall(planted_run):
    run, top, planted = planted_run
    keys = run.read_metric("patterns_keys").set_index(["layer", "key"])
    per_layer = run.read_metric("patterns").set_index("layer")
    stated = float(per_layer.loc[top, "semantic_recall"])
    found = keys.loc[[(top, int(k)) for k in planted]]
    assert not found["dead"].any()
    recall = float(found["is_semantic"].mean())
    # The stated recall, within the binomial noise of 60 keys (2.58 standard errors: 99%, two-sided): the label
    # finds planted topics as often as the run says, neither the calibration's optimism nor a hidden loss.
    slack = 2.58 * np.sqrt(max(stated * (1 - stated), 0.05) / len(planted))
    assert abs(recall - stated) <= slack, (recall, stated)
    # Where the stated recall is this low, Figure 2 gets no verdict, and says why.
    if stated < 0.5:
        figure_2 = run.read_metric("fidelity").set_index("figure").loc["Figure 2"]
        assert pd.isna(figure_2["reproduces"]) and "planted topics" in figure_2["verdict"]
