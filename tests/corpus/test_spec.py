from pathlib import Path

import pytest

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError


@pytest.mark.parametrize("options, message", [
    ({"source": ""}, "source is empty"),
    ({"format": "csv"}, "format 'csv' is not one of auto, text, wikitext, jsonl, parquet, hf"),
    ({"unit": "word"}, "unit 'word' is not one of sentence, line, document, window"),
    ({"split": "test"}, "split 'test' is not one of all, train, heldout"),
    ({"window": 0}, "window must be a positive integer"),
    ({"window": 2.5}, "window must be a positive integer"),
    ({"max_tokens": -1}, "max_tokens must be a positive integer"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"min_tokens": 600}, "min_tokens (600) exceeds max_tokens (512)"),
    ({"unit": "window", "window": 1024}, "window (1024) exceeds max_tokens (512)"),
    ({"text_field": ""}, "text_field must be a non-empty"),
    ({"hf_split": ""}, "hf_split must be a non-empty"),
    ({"heldout_fraction": 0.0}, "heldout_fraction must be a number strictly between 0 and 1"),
    ({"heldout_fraction": 1.5}, "heldout_fraction must be a number strictly between 0 and 1"),
    ({"heldout_fraction": True}, "heldout_fraction must be a number"),
    ({"shuffle_seed": -3}, "shuffle_seed must be a non-negative integer"),
    ({"shuffle_seed": "7"}, "shuffle_seed must be a non-negative integer"),
    ({"max_examples": 0}, "max_examples must be a positive integer"),
    ({"max_examples": True}, "max_examples must be a positive integer"),
    ({"wikitext_detokenize": "yes"}, "wikitext_detokenize must be true or false"),
    ({"source": "hf:wikitext", "format": "jsonl"}, "is a Hugging Face dataset but format is 'jsonl'"),
    ({"source": "hf:"}, "names no dataset"),
])
def test_nonsense_values_are_refused_with_the_field_named(options, message):
    options = {"source": "corpus.txt", **options}
    with pytest.raises(FfkvError, match=None) as caught:
        CorpusSpec(**options)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_round_trip_through_a_dict():
    spec = CorpusSpec("data/wiki.train.tokens", unit="window", window=64, split="heldout", shuffle_seed=3,
                      max_examples=10, heldout_fraction=0.1, wikitext_detokenize=False)
    data = spec.to_dict()
    assert data["unit"] == "window" and data["shuffle_seed"] == 3
    assert CorpusSpec.from_dict(data) == spec
    assert CorpusSpec.from_dict({"source": "x.txt"}) == CorpusSpec("x.txt")


def test_from_dict_refuses_unknown_or_missing_options():
    with pytest.raises(FfkvError, match="unknown option.*colour"):
        CorpusSpec.from_dict({"source": "x.txt", "colour": "red"})
    with pytest.raises(FfkvError, match="no 'source'"):
        CorpusSpec.from_dict({"unit": "line"})
    with pytest.raises(FfkvError, match="mapping"):
        CorpusSpec.from_dict(["x.txt"])


def test_path_source_is_stored_as_text(tmp_path: Path):
    spec = CorpusSpec(tmp_path / "a.txt")
    assert spec.source == str(tmp_path / "a.txt")
    assert CorpusSpec("x.txt", heldout_fraction=1 / 4).heldout_fraction == 0.25


def test_a_local_source_is_located_by_its_absolute_path(tmp_path: Path, monkeypatch):
    (tmp_path / "a.txt").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    assert CorpusSpec("a.txt", unit="line").located() == CorpusSpec(str(tmp_path / "a.txt"), unit="line")
    assert CorpusSpec("hf:wikitext:wikitext-2-raw-v1").located().source == "hf:wikitext:wikitext-2-raw-v1"
    assert CorpusSpec("missing.txt").located().source == "missing.txt"   # its reader names it missing
