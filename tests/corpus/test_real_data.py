"""Checks on the shared WikiText-103 validation set (skipped when it is absent)."""

from pathlib import Path

import pytest

from ffkv.corpus import CorpusSpec, heading_level, iter_examples, shared_data_dir
from ffkv.corpus.examples import iter_units


@pytest.fixture(scope="module")
def valid_raw() -> Path:
    root = shared_data_dir()
    path = root / "wikitext-103" / "wiki.valid.raw" if root else None
    if path is None or not path.is_file():
        pytest.skip("shared WikiText-103 data is not present")
    return path


def test_lines_verbatim(valid_raw):
    raw = valid_raw.read_text(encoding="utf-8").splitlines()
    assert len(raw) == 3760
    assert sum(len(line.split()) for line in raw) == 213_886  # headings included
    expected = [line.strip() for line in raw if line.strip() and not heading_level(line)]
    got = [u.text for u in iter_units(CorpusSpec(valid_raw, unit="line", wikitext_detokenize=False), None)]
    assert got == expected
    assert sum(len(t.split()) for t in got) == 213_886 - sum(len(l.split()) for l in raw if heading_level(l))


def test_articles_and_sentences(valid_raw):
    docs = list(iter_units(CorpusSpec(valid_raw, unit="document"), None))
    assert len(docs) == 60  # 60 top-level headings, each starting an article
    sentences = [u.text for u in iter_units(CorpusSpec(valid_raw), None)]
    assert len(sentences) == 7974  # regression value of the rule-based splitter
    assert sentences[0].startswith("Homarus gammarus, known as the European lobster")
    assert sentences[1] == "It is closely related to the American lobster, H. americanus."


def test_with_the_gpt2_tokenizer(valid_raw):
    path = valid_raw.parents[1] / "tokenizers" / "gpt2"
    if not path.is_dir():
        pytest.skip("shared GPT-2 tokenizer is not present")
    from transformers import AutoTokenizer

    from ffkv.models.tokenizer import HFTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    spec = CorpusSpec(valid_raw, split="heldout", max_examples=30, shuffle_seed=0)
    examples = list(iter_examples(spec, tok))
    assert len(examples) == 30
    assert [e.example_id for e in examples] == [e.example_id for e in iter_examples(spec, tok)]
    assert all(tok.decode(e.token_ids.tolist()) == e.text for e in examples if len(e.token_ids) < 512)
