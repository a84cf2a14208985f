"""Figure 8 against its permutation chance level on models whose answer is known (issue 28).

A one-layer ReLU GPT-2 whose FF layer sees exactly the current token (attention writes nothing, no position
embedding), on lines of the five letters a-e. For each letter x two memories fire (a_x, b_x), and no other:

- ``single``: only a_x fires, and its value is E[A_x]: the FF output's top token is always its one memory's.
  Composition 0%, far below chance (another letter's output is this letter's memory's only 1 time in 5).
- ``unrelated``: v(a_x) = E[A_x] + 0.8·E[Z], v(b_x) = E[B_x] + 0.8·E[Z]: alone each predicts A_x or B_x, together
  Z, which no memory predicts: composition 100%, and so is the chance level (any other output is Z too).
- ``composed``: as ``unrelated`` with Z replaced by A_y, y the next letter: together they predict a token that
  the memories of letter y predict, so another example's output is this example's memory's 1 time in 5 (when it
  is letter x-1): composition 100% against a chance level of about 80%.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers as tf

from ffkv.corpus import CorpusSpec
from ffkv.experiments import analyze
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.store.run import RunDir
from support.helpers import CharTokenizer
from support.tiny_models import VOCAB

LETTERS = "abcde"


def model(kind: str) -> LoadedModel:
    tok = CharTokenizer()
    t = lambda ch: tok.encode(ch)[0]  # noqa: E731
    config = tf.GPT2Config(n_embd=64, n_layer=1, n_head=2, n_inner=16, n_positions=64, vocab_size=VOCAB,
                           activation_function="relu", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    m = tf.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        wte = m.transformer.wte.weight  # tied: these rows are E too
        wte.zero_()
        m.transformer.wpe.weight.zero_()
        planted = LETTERS + "ABCDE" + "FGHIJ" + "Z"
        for i, ch in enumerate(planted):
            wte[t(ch), i] = 3.0
        block = m.transformer.h[0]
        block.attn.c_proj.weight.zero_()
        block.attn.c_proj.bias.zero_()
        view = MemoryView(m)
        K, b, V = view.keys(0), view.key_bias(0), view.values(0)
        K.zero_(), b.fill_(-1.0), V.zero_()
        view.value_bias(0).zero_()
        E = view.unembedding
        for i, ch in enumerate(LETTERS):
            x = torch.nn.functional.layer_norm(wte[t(ch)], (64,))  # what the FF layer reads (its LN is identity)
            A, B, nxt = E[t("ABCDE"[i])], E[t("FGHIJ"[i])], E[t("ABCDE"[(i + 1) % 5])]
            together = {"unrelated": E[t("Z")], "composed": nxt}.get(kind)
            for key, out in ((2 * i, A), (2 * i + 1, B)):
                if kind == "single" and key % 2:
                    continue
                K[key], b[key] = x / x.norm() * 5.0, -2.5
                V[key] = out if together is None else out + 0.8 * together
    m.requires_grad_(False)
    return LoadedModel(m, tok, MemoryView(m), f"tiny-composition-{kind}", "float32", "cpu")


def composition(tmp_path, kind: str):
    rng = random.Random(0)
    corpus = tmp_path / f"{kind}.txt"
    corpus.write_text("\n".join("".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 9))) for _ in range(300)))
    loaded = model(kind)
    spec = CorpusSpec(source=str(corpus), unit="line")
    build_index(loaded, spec, tmp_path / kind, IndexOptions(top_k=5, control_keys=0), progress=False)
    analyze(tmp_path / kind, only="composition", loaded=loaded, eval_corpus=str(corpus), n_eval=300, progress=False)
    run = RunDir(tmp_path / kind)
    return run.read_metric("composition").iloc[0], run.read_metric("fidelity").set_index("figure").loc["Figure 8"]


def test_a_single_memory_model_is_far_below_chance_and_not_a_composition(tmp_path):
    row, verdict = composition(tmp_path, "single")
    assert row["composition_rate"] == 0.0 and row["mean_active"] == 1.0
    assert 0.7 < row["composition_rate_chance"] < 0.9
    assert row["composition_rate_minus_chance_ci_high"] < 0
    assert verdict["verdict"] == "no"


def test_composition_onto_an_unrelated_token_is_at_chance(tmp_path):
    row, _ = composition(tmp_path, "unrelated")
    assert row["composition_rate"] == 1.0 and row["composition_rate_chance"] == 1.0 and row["mean_active"] == 2.0
    assert row["composition_rate_minus_chance"] == 0.0


def test_composition_onto_other_memories_tokens_is_above_chance(tmp_path):
    row, verdict = composition(tmp_path, "composed")
    assert row["composition_rate"] == 1.0
    assert 0.7 < row["composition_rate_chance"] < 0.9
    assert row["composition_rate_minus_chance_ci_low"] > 0
    assert verdict["verdict"] == "yes" and verdict["n"] == 300


def test_one_held_out_example_gives_no_chance_level_and_no_traceback(tmp_path):
    """stories260K on an 18-line corpus left one held-out example: the permutation chance level was NaN in every
    layer and the fidelity rule's idxmin raised "Encountered all NA values" (a traceback, exit 1)."""
    import pandas as pd

    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    run, loaded = make_run(tmp_path / "r", "gpt2", n=30)
    one = tmp_path / "one.txt"
    one.write_text("a few words of text to read here\n")
    analyze(run, only="composition", eval_corpus=str(one), n_eval=1, loaded=loaded, progress=False)
    fidelity = pd.read_parquet(run / "metrics" / "fidelity.parquet").set_index("table")
    row = fidelity.loc["composition"]
    row = row[row["figure"] == "Figure 8"].iloc[0] if isinstance(row, pd.DataFrame) else row
    assert "no chance level" in row["chance"] and pd.isna(row["reproduces"])  # too few: no verdict
