"""Read and tokenize the corpus in other processes while the accelerator computes.

On a GPU the forward pass of a small model outruns one tokenizer: `workers`
processes each read the corpus and tokenize every n-th chunk of units
(`example_chunks(part=(w, n))`), and the consumer takes the chunks from them in
turn, so order and content are exactly those of `iter_examples`. Bounded queues
keep memory flat however far the producers could run ahead.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue as queue_module
from typing import Iterator

from ffkv.corpus import CorpusSpec, Example
from ffkv.corpus.examples import example_chunks, limit_examples
from ffkv.errors import FfkvError
from ffkv.models.tokenizer import Tokenizer


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _produce(spec: CorpusSpec, tokenizer: Tokenizer, part: tuple[int, int], chunk: int, queue) -> None:
    if part[1] > 1:
        # Several single-threaded tokenizers, not several thread pools contending for the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        for examples in example_chunks(spec, tokenizer, part, chunk):
            queue.put(examples)
        queue.put(None)
    except BaseException as error:  # noqa: BLE001 - the consumer re-raises it
        queue.put(_Failed(error))


def _get(queue, producer, poll_seconds: float):
    while True:
        try:
            return queue.get(timeout=poll_seconds)
        except queue_module.Empty:
            if not producer.is_alive():
                raise FfkvError(f"a tokenizing process ended without a result (exit code {producer.exitcode}); "
                                "it may have run out of memory") from None


def default_workers(spec: CorpusSpec) -> int:
    """Tokenizing processes for a GPU: up to 4, leaving two cores to the main process.

    Windows are cut from whole tokenized documents, so every part would tokenize
    everything: one process reads them.
    """
    if spec.unit == "window":
        return 1
    return max(1, min(4, (os.cpu_count() or 1) - 2))


def prefetched_examples(spec: CorpusSpec, tokenizer: Tokenizer, skip: int = 0, workers: int = 1,
                        chunk: int = 256, depth: int = 8, poll_seconds: float = 5.0) -> Iterator[Example]:
    """`iter_examples(spec, tokenizer)` from the `skip`-th example on, tokenized by `workers` processes."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    # fork: the children need no CUDA and no re-import of the caller's script (spawn would re-run it).
    context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queues = [context.Queue(maxsize=depth) for _ in range(workers)]
    producers = [context.Process(target=_produce, args=(spec, tokenizer, (w, workers), chunk, q), daemon=True)
                 for w, q in enumerate(queues)]
    for producer in producers:
        producer.start()

    def chunks() -> Iterator[list[Example]]:
        # Chunk j comes from producer j % workers; the first producer out of chunks marks the end.
        for queue, producer in itertools.cycle(zip(queues, producers)):
            item = _get(queue, producer, poll_seconds)
            if item is None:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    try:
        examples = limit_examples(spec, itertools.chain.from_iterable(chunks()))
        yield from itertools.islice(examples, skip, None)
    finally:
        for producer in producers:
            if producer.is_alive():
                producer.kill()
            producer.join()
