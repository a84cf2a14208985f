"""Tokenizing processes give exactly the stream of `iter_examples`, in order, from any skip."""

from __future__ import annotations

import pytest

from ffkv.corpus import CorpusSpec, iter_examples
from ffkv.errors import FfkvError
from ffkv.indexing import prefetch
from ffkv.indexing.prefetch import prefetched_examples
from support.helpers import loaded_tiny


@pytest.fixture(scope="module")
def tokenizer():
    return loaded_tiny("gpt2").tokenizer


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("\n".join(f"line {i} " + "word " * (i % 5) for i in range(100)) + "\n")
    return path


def as_rows(examples):
    return [(e.example_id, e.token_ids.tolist(), e.text) for e in examples]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("options", [
    {},
    {"max_examples": 30},
    {"min_tokens": 4, "split": "heldout", "heldout_fraction": 0.3},
    {"max_examples": 20, "shuffle_seed": 3},
])
@pytest.mark.parametrize("skip", [0, 11])
def test_same_examples_as_one_process(corpus, tokenizer, workers, options, skip):
    spec = CorpusSpec(source=str(corpus), unit="line", **options)
    expected = as_rows(iter_examples(spec, tokenizer))[skip:]
    assert len(expected) > 3
    got = as_rows(prefetched_examples(spec, tokenizer, skip=skip, workers=workers, chunk=7))
    assert got == expected


def test_a_failing_producer_is_reported(corpus, tokenizer):
    spec = CorpusSpec(source=str(corpus / "missing.txt"), unit="line")
    with pytest.raises(Exception) as raised:
        list(prefetched_examples(spec, tokenizer, workers=2, chunk=7))
    with pytest.raises(type(raised.value)):
        list(iter_examples(spec, tokenizer))


def test_a_vanished_producer_is_an_error(corpus, tokenizer, monkeypatch):
    monkeypatch.setattr(prefetch, "_produce", lambda *args: None)  # ends without a result
    spec = CorpusSpec(source=str(corpus), unit="line")
    with pytest.raises(FfkvError, match="ended without a result"):
        list(prefetched_examples(spec, tokenizer, workers=2, poll_seconds=0.1))
