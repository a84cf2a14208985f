"""Read and tokenize the corpus in a separate process while the accelerator computes.

On a GPU the forward pass can outrun tokenization in the main process; a producer
process keeps a bounded queue of tokenized examples ahead of it. Order and content
are exactly those of `iter_examples`.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
from typing import Iterator

from ffkv.corpus import CorpusSpec, Example, iter_examples
from ffkv.models.tokenizer import Tokenizer


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _produce(spec: CorpusSpec, tokenizer: Tokenizer, skip: int, chunk: int, queue) -> None:
    try:
        examples = itertools.islice(iter_examples(spec, tokenizer), skip, None)
        while batch := list(itertools.islice(examples, chunk)):
            queue.put(batch)
        queue.put(None)
    except BaseException as error:  # noqa: BLE001 - the consumer re-raises it
        queue.put(_Failed(error))


def prefetched_examples(spec: CorpusSpec, tokenizer: Tokenizer, skip: int = 0,
                        chunk: int = 512, depth: int = 16) -> Iterator[Example]:
    """`iter_examples(spec, tokenizer)` from the `skip`-th example on, produced in another process."""
    # fork: the child needs no CUDA and no re-import of the caller's script (spawn would re-run it).
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = context.Queue(maxsize=depth)
    producer = context.Process(target=_produce, args=(spec, tokenizer, skip, chunk, queue), daemon=True)
    producer.start()
    try:
        while (item := queue.get()) is not None:
            if isinstance(item, _Failed):
                raise item.error
            yield from item
    finally:
        if producer.is_alive():
            producer.kill()
        producer.join()
