"""`ffkv locate` and `ffkv attribute` on the embedded ffkv-tiny: what they print and write, and their refusals."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ffkv.api import embedded_corpus
from ffkv.cli import main


def test_locate_traces_a_prompt_and_names_the_intervene_command(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["locate", "--prompt", "And Abraham begat", "--subject", "Abraham", "--answer", "Isaac",
                 "--samples", "2", "--candidates", "8", "--top-memories", "3", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "answer ' Isaac'" in printed and printed.count("ffkv intervene RUN --off") == 1
    facts = pd.read_parquet(out / "locate_facts.parquet")
    assert facts.answer_token.iloc[0] == " Isaac" and facts.window.iloc[0] == 1  # 6 layers: round(60/48)
    memories = pd.read_parquet(out / "locate_memories.parquet")
    assert len(memories) == 8 and (memories.layer == facts.memory_layer.iloc[0]).all()
    assert (out / "figures" / "locate_fact_0.png").stat().st_size > 1000


def test_locate_reads_a_facts_file(tmp_path, capsys):
    facts = tmp_path / "facts.jsonl"
    facts.write_text(json.dumps({"prompt": "And Abraham begat", "subject": "Abraham"}) + "\n")
    code = main(["locate", "--facts", str(facts), "--samples", "1", "--candidates", "2", "--out", str(tmp_path / "o"),
                 "--no-progress"])
    assert code == 0
    assert json.loads((tmp_path / "o" / "locate.json").read_text())["n_facts"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--subject", "x"], "--facts"),
    (["--prompt", "And Abraham begat"], "--subject"),
    (["--prompt", "And Abraham begat", "--subject", "Isaac"], "does not occur"),
    (["--prompt", "And Abraham begat", "--subject", "Abraham", "--layer", "9"], "layer 9 does not exist"),
])
def test_locate_refusals(tmp_path, capsys, argv, message):
    code = main(["locate", *argv, "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and message in capsys.readouterr().err


def test_attribute_on_a_corpus(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["attribute", "--corpus", str(embedded_corpus("heldout")), "--unit", "line", "--max-examples", "3",
                 "--max-tokens", "24", "--steps", "2", "--check", "4", "--target", " LORD", "--out", str(out),
                 "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "rank correlation with the exact switch-off effect over 4 memories" in printed
    summary = json.loads((out / "attribute.json").read_text())
    assert summary["n_examples"] == 3 and summary["target"]["token"] is not None
    assert pd.read_parquet(out / "attribute_memories.parquet").exact_off_effect.notna().sum() == 4


def test_attribute_refuses_a_target_that_is_not_one_token(tmp_path, capsys):
    code = main(["attribute", "--corpus", str(embedded_corpus("heldout")), "--unit", "line", "--max-examples", "2",
                 "--target", "not one token at all", "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and "not one token" in capsys.readouterr().err


def test_attribute_to_the_latents_of_ffkv_tinys_transcoder(tmp_path, capsys):
    """--dictionary: the shipped transcoder's latents are attributed in the same pass, checked by switching them
    off, and written beside the neurons' table; a dictionary that is not one is refused naming the path."""
    from ffkv.models.tiny_lm import tiny_transcoders_path

    out = tmp_path / "out"
    code = main(["attribute", "--corpus", str(embedded_corpus("heldout")), "--unit", "line", "--max-examples", "3",
                 "--max-tokens", "24", "--steps", "0", "--check", "4", "--dictionary", str(tiny_transcoders_path()),
                 "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "over 4 latents" in printed and "top latents" in printed
    latents = pd.read_parquet(out / "attribute_latents.parquet")
    assert len(latents) == 512 and set(latents.layer) == {3} and latents.exact_off_effect.notna().sum() == 4
    assert latents.address.str.startswith("t4:").all()  # the command line counts layers from 1
    code = main(["attribute", "--corpus", str(embedded_corpus("heldout")), "--unit", "line", "--max-examples", "2",
                 "--dictionary", str(tmp_path), "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and str(tmp_path) in capsys.readouterr().err


def test_locate_traces_the_latents_of_ffkv_tinys_transcoder(tmp_path, capsys):
    """--dictionary: at the memories' cell, when it is the transcoder's layer (4), its latents are traced too."""
    from ffkv.models.tiny_lm import tiny_transcoders_path

    out = tmp_path / "out"
    code = main(["locate", "--prompt", "And Abraham begat", "--subject", "Abraham", "--answer", "Isaac",
                 "--samples", "2", "--candidates", "8", "--top-memories", "3", "--layer", "4",
                 "--dictionary", str(tiny_transcoders_path()), "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "latents of the dictionary at layer 4" in printed and "t4:" in printed
    latents = pd.read_parquet(out / "locate_latents.parquet")
    assert len(latents) == 8 and (latents.layer == 3).all() and latents.address.str.startswith("t4:").all()
    assert latents.indirect_effect.is_monotonic_decreasing
