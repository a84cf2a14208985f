import warnings
from pathlib import Path

import numpy as np
import pytest

from support.corpus import WordTokenizer
from ffkv.corpus import CorpusReader, CorpusSpec, Example, iter_examples
from ffkv.errors import FfkvError, FfkvWarning


@pytest.fixture
def lines_file(tmp_path: Path) -> Path:
    """400 lines; line i has (i % 7) + 1 words, so lengths are known."""
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(" ".join(f"w{i}_{k}" for k in range(i % 7 + 1)) for i in range(400)) + "\n")
    return path


def ids(spec, tok):
    return [e.example_id for e in iter_examples(spec, tok)]


def test_examples_have_ids_token_ids_and_text(lines_file, tok):
    examples = list(iter_examples(CorpusSpec(lines_file, unit="line"), tok))
    assert [e.example_id for e in examples] == list(range(400))
    first = examples[3]
    assert isinstance(first, Example) and first.text == "w3_0 w3_1 w3_2 w3_3"
    assert first.token_ids.dtype == np.int32 and first.token_ids.tolist() == tok.encode(first.text)


def test_same_ids_and_tokens_twice(lines_file, tok):
    spec = CorpusSpec(lines_file, unit="line", split="train", max_examples=50, shuffle_seed=5)
    a = [(e.example_id, e.token_ids.tolist()) for e in iter_examples(spec, tok)]
    b = [(e.example_id, e.token_ids.tolist()) for e in iter_examples(spec, WordTokenizer())]
    assert a == b and len(a) == 50


def test_min_tokens_skips_without_renumbering(lines_file, tok):
    kept = ids(CorpusSpec(lines_file, unit="line", min_tokens=6), tok)
    assert kept == [i for i in range(400) if i % 7 + 1 >= 6]


def test_max_tokens_truncates(lines_file, tok):
    examples = list(iter_examples(CorpusSpec(lines_file, unit="line", max_tokens=3), tok))
    assert max(len(e.token_ids) for e in examples) == 3
    assert examples[6].token_ids.tolist() == tok.encode(examples[6].text)[:3]
    assert examples[6].text == " ".join(f"w6_{k}" for k in range(7))  # the text stays whole


def test_window_unit(tmp_path, tok):
    path = tmp_path / "docs.txt"
    path.write_text(" ".join(f"a{i}" for i in range(10)) + "\n\n" + " ".join(f"b{i}" for i in range(3)) + "\n")
    bos = WordTokenizer(bos=True)
    examples = list(iter_examples(CorpusSpec(path, unit="window", window=4), bos))
    assert [e.example_id for e in examples] == [0, 1, 2, 3]
    stream = bos.encode(" ".join(f"a{i}" for i in range(10)))
    assert [e.token_ids.tolist() for e in examples[:3]] == [stream[0:4], stream[4:8], stream[8:11]]
    assert examples[0].text == "<s> a0 a1 a2" and examples[3].text == "<s> b0 b1 b2"
    # min_tokens drops the short tail window; ids of the rest stay
    assert ids(CorpusSpec(path, unit="window", window=4, min_tokens=4), bos) == [0, 1, 3]


def test_split_is_disjoint_covering_and_sized(lines_file, tok):
    spec = dict(source=lines_file, unit="line", heldout_fraction=0.25)
    train = set(ids(CorpusSpec(**spec, split="train"), tok))
    heldout = set(ids(CorpusSpec(**spec, split="heldout"), tok))
    assert train.isdisjoint(heldout) and train | heldout == set(range(400))
    assert 60 <= len(heldout) <= 140
    # the split of an id does not depend on the fraction's neighbours or on reading options
    assert set(ids(CorpusSpec(**spec, split="heldout", min_tokens=3), tok)) <= heldout


def test_first_n_without_a_seed(lines_file, tok):
    assert ids(CorpusSpec(lines_file, unit="line", max_examples=5), tok) == [0, 1, 2, 3, 4]
    assert ids(CorpusSpec(lines_file, unit="line", max_examples=5, min_tokens=7), tok) == [6, 13, 20, 27, 34]
    assert len(ids(CorpusSpec(lines_file, unit="line", max_examples=5000), tok)) == 400


def test_seeded_subset(lines_file, tok):
    def subset(seed, **options):
        return ids(CorpusSpec(lines_file, unit="line", max_examples=40, shuffle_seed=seed, **options), tok)

    a = subset(1)
    assert a == subset(1) and a == sorted(a) and len(set(a)) == 40
    assert a != subset(2)
    assert a != list(range(40))
    eligible = subset(1, min_tokens=5, split="train")
    assert len(eligible) == 40 and all(i % 7 + 1 >= 5 for i in eligible)
    heldout = set(ids(CorpusSpec(lines_file, unit="line", split="heldout"), tok))
    assert not heldout & set(eligible)


def test_seeded_subset_is_uniform(tmp_path, tok):
    path = tmp_path / "small.txt"
    path.write_text("\n".join(f"line {i}" for i in range(100)) + "\n")
    counts = np.zeros(100)
    seeds = 200
    for seed in range(seeds):
        counts[ids(CorpusSpec(path, unit="line", max_examples=25, shuffle_seed=seed), tok)] += 1
    # each id is kept with probability 1/4: mean 50, sd about 6
    assert counts.sum() == 25 * seeds
    assert counts.min() >= 25 and counts.max() <= 75
    assert abs(counts[:50].sum() - counts[50:].sum()) < 0.1 * counts.sum()


def test_a_seed_without_max_examples_changes_nothing(lines_file, tok):
    assert ids(CorpusSpec(lines_file, unit="line", shuffle_seed=3), tok) == list(range(400))


def test_everything_filtered_warns(lines_file, tok):
    with pytest.warns(FfkvWarning, match="gave no examples after"):
        assert ids(CorpusSpec(lines_file, unit="line", min_tokens=8, max_tokens=8), tok) == []


def test_tokenizer_is_required(lines_file):
    with pytest.raises(FfkvError, match="needs a tokenizer"):
        list(iter_examples(CorpusSpec(lines_file), None))


def test_corpus_reader(lines_file, tok):
    reader = CorpusReader(CorpusSpec(lines_file, unit="line", max_examples=7), tok)
    assert [e.example_id for e in reader] == [e.example_id for e in reader] == list(range(7))
    assert reader.approx_total() == 7
    assert CorpusReader(CorpusSpec(lines_file), tok).approx_total() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(reader)) == 7


def test_batch_encoding_gives_the_same_examples(tmp_path):
    from ffkv.corpus import CorpusSpec, iter_examples, shared_data_dir
    from ffkv.models.tokenizer import HFTokenizer

    data = shared_data_dir()
    if data is None or not (data / "tokenizers" / "gpt2").is_dir():
        pytest.skip("needs ../shared/data/tokenizers/gpt2")
    from transformers import AutoTokenizer

    fast = HFTokenizer(AutoTokenizer.from_pretrained(str(data / "tokenizers" / "gpt2")))

    class OneByOne:  # the same tokenizer without encode_batch
        def __getattr__(self, name):
            if name == "encode_batch":
                raise AttributeError(name)
            return getattr(fast, name)

    path = tmp_path / "c.txt"
    path.write_text("".join(f"Sentence number {i} is here. And another, {i * 7}!\n" for i in range(700)))
    spec = CorpusSpec(source=str(path), min_tokens=3)
    a = [(e.example_id, e.token_ids.tolist(), e.text) for e in iter_examples(spec, fast)]
    b = [(e.example_id, e.token_ids.tolist(), e.text) for e in iter_examples(spec, OneByOne())]
    assert a == b and len(a) > 1000
