"""Which example ids a run keeps: the train/held-out split and the seeded subset.

Both decisions hash the example id with BLAKE2b (never Python's salted ``hash``),
so they are the same on every machine and do not depend on reading order. The
subset keeps the ``max_examples`` ids of smallest seeded hash, a uniform random
sample found with a bounded heap (memory O(max_examples)).
"""

from __future__ import annotations

import hashlib
import heapq

_SCALE = float(1 << 64)


def _hash64(text: str, person: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, person=person).digest(), "big")


def is_heldout(example_id: int, heldout_fraction: float) -> bool:
    """Whether an example belongs to the held-out split (seedless: the split never moves)."""
    return _hash64(str(example_id), b"ffkv-split") < heldout_fraction * _SCALE


def in_split(example_id: int, split: str, heldout_fraction: float) -> bool:
    """Whether an example belongs to ``split`` (all | train | heldout)."""
    if split == "all":
        return True
    return is_heldout(example_id, heldout_fraction) == (split == "heldout")


def subset_rank(example_id: int, seed: int) -> int:
    """The seeded rank of an example; the subset keeps the smallest ranks."""
    return _hash64(f"{seed}:{example_id}", b"ffkv-subset")


class SubsetHeap:
    """The ``size`` ids of smallest rank seen so far (ties broken by smaller id)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._heap: list[tuple[int, int]] = []  # (-rank, -id): the root is the worst kept

    def would_keep(self, rank: int, example_id: int) -> bool:
        """Whether an id of this rank would enter the subset now (check before costly work)."""
        if len(self._heap) < self.size:
            return True
        worst_rank, worst_id = -self._heap[0][0], -self._heap[0][1]
        return (rank, example_id) < (worst_rank, worst_id)

    def offer(self, rank: int, example_id: int) -> None:
        """Keep the id if it ranks among the best ``size`` so far."""
        if len(self._heap) < self.size:
            heapq.heappush(self._heap, (-rank, -example_id))
        elif self.would_keep(rank, example_id):
            heapq.heapreplace(self._heap, (-rank, -example_id))

    def ids(self) -> set[int]:
        """The kept ids."""
        return {-neg_id for _, neg_id in self._heap}
