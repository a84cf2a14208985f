"""The index's progress bar: examples done, of how many, and the time left.

The total is counted by a background thread that reads the corpus units (sentences,
lines, documents) and keeps those of the run's split, without tokenizing: much cheaper
than the forward passes it runs beside. Until it is known (or where it cannot be counted
cheaply: token windows, which need the tokenizer, and hub datasets, which would be streamed
twice) the bar shows the count and rate alone; `max_examples` caps the total.
"""

from __future__ import annotations

import threading
import warnings

from tqdm.auto import tqdm

from ffkv.corpus import CorpusSpec
from ffkv.corpus.examples import iter_units
from ffkv.corpus.selection import in_split
from ffkv.corpus.sources import is_hf


def count_examples(spec: CorpusSpec) -> int | None:
    """How many examples the corpus gives (an upper bound where ``min_tokens`` drops short ones), or None
    where counting needs the tokenizer or a second download."""
    if spec.unit == "window" or is_hf(spec):
        return spec.max_examples
    n = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for unit in iter_units(spec, None):
            if in_split(unit.example_id, spec.split, spec.heldout_fraction):
                n += 1
                if spec.max_examples is not None and n >= spec.max_examples:
                    break
    return n


class IndexBar:
    """A tqdm bar over examples whose total arrives from a background count.

    Args:
        spec: the corpus (counted in a daemon thread).
        initial: examples already done (a resumed run).
        show: False hides the bar (the count is skipped too).
    """

    def __init__(self, spec: CorpusSpec, initial: int = 0, show: bool = True) -> None:
        self._total: int | None = spec.max_examples
        self.bar = tqdm(total=self._total, initial=initial, unit="ex", disable=not show, dynamic_ncols=True,
                        desc="index", smoothing=0.05)
        if show and (spec.max_examples is None or spec.shuffle_seed is None):
            threading.Thread(target=self._count, args=(spec,), name="ffkv-count", daemon=True).start()

    def _count(self, spec: CorpusSpec) -> None:
        try:
            self._total = count_examples(spec)
        except Exception:  # noqa: BLE001 - a count that fails leaves the bar without a total, nothing else
            pass

    def update(self, n: int, **postfix: str) -> None:
        if self._total is not None and self.bar.total != self._total:
            self.bar.total = self._total
        self.bar.update(n)
        if postfix:
            self.bar.set_postfix(refresh=False, **postfix)

    def close(self, finished: bool = True) -> None:
        if finished and not self.bar.disable and self.bar.total is not None and self.bar.n != self.bar.total:
            self.bar.total = self.bar.n  # the count was an upper bound (examples shorter than min_tokens)
            self.bar.refresh()
        self.bar.close()
