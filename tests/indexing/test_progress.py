"""The index's progress bar knows the total: the corpus counted cheaply, equal to the examples indexed."""

from __future__ import annotations

import time

from ffkv.corpus import CorpusSpec, iter_examples
from ffkv.indexing.progress import IndexBar, count_examples
from support.helpers import CharTokenizer


def test_count_matches_the_examples(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("First sentence. Second one here!\n\nA third line\n" * 40)
    for options in ({"unit": "line"}, {"unit": "sentence"}, {"unit": "document"},
                    {"unit": "line", "split": "heldout", "heldout_fraction": 0.3},
                    {"unit": "sentence", "max_examples": 7}):
        spec = CorpusSpec(source=str(corpus), **options)
        assert count_examples(spec) == sum(1 for _ in iter_examples(spec, CharTokenizer())), options
    assert count_examples(CorpusSpec(source=str(corpus), unit="window", window=8)) is None


def test_the_bar_gets_the_total_with_time_left(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}\n" for i in range(500)))
    bar = IndexBar(CorpusSpec(source=str(corpus), unit="line"), show=True)
    deadline = time.time() + 10
    while bar._total is None and time.time() < deadline:
        time.sleep(0.01)
    bar.update(100)
    assert bar.bar.total == 500
    assert "100/500" in str(bar.bar) and "<" in str(bar.bar)  # done/total [elapsed<left]
    bar.close()
