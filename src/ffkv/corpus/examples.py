"""Examples: a corpus spec and a tokenizer to a deterministic stream of token ids (docs/definitions.md).

Every unit (sentence, line, document or token window) gets the 0-based index of its
place in the whole source as its example id, before any split, subset or length
filter, so the same source and options always give the same ids. Examples are
yielded in ascending id order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ffkv.corpus.readers import iter_documents
from ffkv.corpus.selection import SubsetHeap, in_split, subset_rank
from ffkv.corpus.sentences import split_sentences
from ffkv.corpus.spec import CorpusSpec
from ffkv.errors import FfkvError, warn
from ffkv.models.tokenizer import Tokenizer


@dataclass
class Example:
    """One example.

    Attributes:
        example_id: the unit's 0-based index in the source (stable across runs).
        token_ids: (T,) int32, as the tokenizer encodes the text, at most ``max_tokens``.
        text: the example's text (for a window, the decoded window).
        cut: the text holds more than ``max_tokens`` tokens: `token_ids` are its first ``max_tokens``.
    """

    example_id: int
    token_ids: np.ndarray
    text: str
    cut: bool = False


@dataclass
class _Unit:
    example_id: int
    text: str | None  # None for windows until needed (decoding costs)
    token_ids: list[int] | None  # known up front only for windows


def iter_examples(spec: CorpusSpec, tokenizer: Tokenizer) -> Iterator[Example]:
    """The examples of a corpus, in ascending example id.

    ``split`` keeps ids by a hash of the id; ``min_tokens`` skips short examples;
    ``max_examples`` keeps the first n, or with ``shuffle_seed`` a seeded uniform
    random n (found in a first pass over the source that keeps only ids).
    """
    yield from limit_examples(spec, itertools.chain.from_iterable(example_chunks(spec, tokenizer)))


def example_chunks(spec: CorpusSpec, tokenizer: Tokenizer, part: tuple[int, int] = (0, 1),
                   chunk: int = 256) -> Iterator[list[Example]]:
    """The examples of consecutive chunks of `chunk` units, before ``max_examples`` applies.

    With ``part=(w, n)`` only chunks j with j % n == w are tokenized and yielded: n
    processes that each take one part, read in turn, give the whole stream in order
    (`ffkv.indexing.prefetch`). Units are tokenized a chunk at a time: batch encoding
    (where the tokenizer has it) runs natively, in parallel where it may.
    """
    if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
        raise FfkvError("reading corpus examples needs a tokenizer with encode(text): load the model's tokenizer first")
    only = _choose_subset(spec, tokenizer) if spec.max_examples is not None and spec.shuffle_seed is not None else None

    def kept(unit: _Unit) -> bool:
        return (only is None or unit.example_id in only) and in_split(unit.example_id, spec.split,
                                                                       spec.heldout_fraction)

    units = filter(kept, iter_units(spec, tokenizer))
    mine, n_parts = part
    for j in itertools.count():
        batch = list(itertools.islice(units, chunk))
        if not batch:
            return
        if j % n_parts == mine:
            yield _tokenized(spec, tokenizer, batch)


def _tokenized(spec: CorpusSpec, tokenizer: Tokenizer, units: list[_Unit]) -> list[Example]:
    todo = [u for u in units if u.token_ids is None]
    if todo:
        for unit, ids in zip(todo, encode_many(tokenizer, [u.text for u in todo], spec.max_tokens)):
            unit.token_ids = list(ids)
    return [Example(u.example_id, np.asarray(u.token_ids[:spec.max_tokens], dtype=np.int32),
                    u.text if u.text is not None else tokenizer.decode(u.token_ids), len(u.token_ids) > spec.max_tokens)
            for u in units if len(u.token_ids) >= spec.min_tokens]


def limit_examples(spec: CorpusSpec, examples: Iterator[Example]) -> Iterator[Example]:
    """The first ``max_examples`` of `examples` (all without a limit); warns when there are none.

    With ``shuffle_seed`` the chunks hold only the chosen subset, which has at most
    ``max_examples`` examples, so the same cut applies.
    """
    count = 0
    if spec.max_examples != 0:
        for example in examples:
            yield example
            count += 1
            if spec.max_examples is not None and count >= spec.max_examples:
                break
    if count == 0:
        warn(f"corpus {spec.source} gave no examples after split={spec.split!r} and min_tokens={spec.min_tokens}: "
             "loosen them")


class CorpusReader:
    """A re-iterable view of a corpus's examples, for runs that read it more than once."""

    def __init__(self, spec: CorpusSpec, tokenizer: Tokenizer) -> None:
        self.spec = spec
        self.tokenizer = tokenizer

    def __iter__(self) -> Iterator[Example]:
        return iter_examples(self.spec, self.tokenizer)

    def approx_total(self) -> int | None:
        """A cheap upper estimate of the number of examples (for a progress bar), or None."""
        return self.spec.max_examples


def iter_units(spec: CorpusSpec, tokenizer: Tokenizer | None) -> Iterator[_Unit]:
    """Every unit of the source, numbered in source order; windows need the tokenizer."""
    if spec.unit == "window" and tokenizer is None:
        raise FfkvError("unit 'window' counts tokens, so it needs a tokenizer: pass the model's tokenizer")
    next_id = 0
    for document in iter_documents(spec):
        if spec.unit == "line":
            texts = iter(document.lines)
        elif spec.unit == "sentence":
            texts = (s for paragraph in document.paragraphs for s in split_sentences(paragraph))
        elif spec.unit == "document":
            texts = iter([document.text])
        else:
            ids = list(tokenizer.encode(document.text))
            for start in range(0, len(ids), spec.window):
                yield _Unit(next_id, None, ids[start:start + spec.window])
                next_id += 1
            continue
        for text in texts:
            yield _Unit(next_id, text, None)
            next_id += 1
    if next_id == 0:
        raise FfkvError(f"corpus {spec.source} holds no text (empty, or only blank lines and headings): "
                        "check the source and text_field")


def _token_ids(unit: _Unit, tokenizer: Tokenizer, max_tokens: int) -> list[int]:
    if unit.token_ids is None:
        unit.token_ids = list(encode_many(tokenizer, [unit.text], max_tokens)[0])
    return unit.token_ids


#: Characters per allowed token beyond which a text is tokenized by its prefixes (`encode_prefix`), not whole.
LONG_TEXT_CHARS_PER_TOKEN = 64


def encode_many(tokenizer: Tokenizer, texts: list[str], max_tokens: int | None = None) -> list[list[int]]:
    """Token ids of several texts: the tokenizer's `encode_batch` where it has one, else `encode` each.

    With `max_tokens`, a text too long to fit is tokenized only as far as needed (`encode_prefix`): the ids
    hold its first ``max_tokens`` and at least one more (so it reads as cut), and memory follows the cut,
    not the text.
    """
    long = set() if max_tokens is None else \
        {i for i, t in enumerate(texts) if len(t) > LONG_TEXT_CHARS_PER_TOKEN * max_tokens}
    short = [t for i, t in enumerate(texts) if i not in long]
    batch = getattr(tokenizer, "encode_batch", None)
    done = iter(batch(short) if batch is not None and short else [tokenizer.encode(t) for t in short])
    return [encode_prefix(tokenizer, t, max_tokens) if i in long else next(done) for i, t in enumerate(texts)]


#: Tokens beyond the cut that two prefix tokenizations must agree on before the cut (`encode_prefix`).
PREFIX_MARGIN = 16


def encode_prefix(tokenizer: Tokenizer, text: str, max_tokens: int) -> list[int]:
    """The first ``max_tokens + 1`` token ids of `text` (fewer: all of them), read from growing prefixes of
    the text rather than the whole: a 20 MiB line costs what its first tokens cost.

    A prefix's last tokens may differ from the whole text's (a word cut in two), so a prefix counts only
    when it gives at least ``max_tokens + PREFIX_MARGIN`` tokens and a prefix twice as long gives the same
    first ``max_tokens + 1``; prefixes double until then, or until the next would hold the whole text.
    """
    want = max_tokens + 1
    length = LONG_TEXT_CHARS_PER_TOKEN * max_tokens
    ids = list(tokenizer.encode(text[:length]))
    while 2 * length < len(text):
        longer = list(tokenizer.encode(text[:2 * length]))
        if len(ids) >= max_tokens + PREFIX_MARGIN and ids[:want] == longer[:want]:
            return ids[:want]
        ids, length = longer, 2 * length
    return list(tokenizer.encode(text))[:want]


def _choose_subset(spec: CorpusSpec, tokenizer: Tokenizer) -> set[int]:
    """First pass: the ids of a seeded uniform subset of the eligible examples."""
    heap = SubsetHeap(spec.max_examples)
    for unit in iter_units(spec, tokenizer):
        if not in_split(unit.example_id, spec.split, spec.heldout_fraction):
            continue
        rank = subset_rank(unit.example_id, spec.shuffle_seed)
        # Tokenize only units that would enter the heap: about n·(1 + ln(N/n)) of N.
        if heap.would_keep(rank, unit.example_id) and \
                len(_token_ids(unit, tokenizer, spec.max_tokens)) >= spec.min_tokens:
            heap.offer(rank, unit.example_id)
    return heap.ids()
