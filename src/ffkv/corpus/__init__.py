"""Corpus: sources to deterministic examples and token ids (docs/definitions.md).

    spec.py         CorpusSpec, the validated options (manifest round trip)
    sources.py      files of a source, format detection, the binary-file check
    wikitext.py     WikiText headings and detokenization
    readers.py      text / WikiText / JSONL / Parquet / HF readers → documents
    sentences.py    rule-based sentence splitter
    selection.py    hash split and seeded subset
    examples.py     Example, iter_examples, CorpusReader
    fingerprint.py  fingerprint(spec) for the manifest
    shared.py       shared_data_dir() for real-data tests
"""

from ffkv.corpus.examples import CorpusReader, Example, iter_examples
from ffkv.corpus.fingerprint import fingerprint
from ffkv.corpus.sentences import split_sentences
from ffkv.corpus.shared import shared_data_dir
from ffkv.corpus.spec import CorpusSpec
from ffkv.corpus.wikitext import detokenize, heading_level

__all__ = [
    "CorpusReader",
    "CorpusSpec",
    "Example",
    "detokenize",
    "fingerprint",
    "heading_level",
    "iter_examples",
    "shared_data_dir",
    "split_sentences",
]
