"""The capture sink of the index's forward pass: every family of keys the index reduces, fed from one pass.

The index reduces several families of keys at once, each into its own trigger reducer: the model's keys (their
coefficients are captured as they are), the random control memories (`ffkv.memories.controls.RandomKeys`,
computed from the captured FF input), and a sparse dictionary's latents with their random control latents
(`ffkv.memories.latent_keys.LatentKeys`, computed from the FF input or output the dictionary reads). A `Feed` says
what one captured tensor of one layer feeds; `KeySink` routes each capture to its feeds and drives the reducers
through the protocol the index uses (`start`, the sink call, `commit`, `flush`, `quantities`). A family costs its
own product and reduction per layer, never another pass over the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ffkv.batching import Batch
from ffkv.indexing.reducer import TriggerReducer
from ffkv.memories.latent_keys import SparseCoefficients


@dataclass(frozen=True)
class Feed:
    """What one captured quantity of one layer feeds.

    Attributes:
        quantity: the captured quantity (``coefficients``, ``ff_in``, ``ff_out``: `ffkv.memories.view.QUANTITIES`).
        layer: the model's layer it is captured at.
        targets: per output of `compute`, the reducer that reduces it and the layer's place in that reducer's state
            (a family that covers only some layers keeps a state of those layers only).
        compute: the captured tensor -> the coefficients of one or more key sets, as (B, T, n) tensors or
            `ffkv.indexing.sparse.SparseCoefficients` (a TopK dictionary's latents); None: the
            captured tensor is itself the one output (and its reducer may overwrite it in place, so such a feed
            runs after every other feed of the same capture).
    """

    quantity: str
    layer: int
    targets: tuple[tuple[TriggerReducer, int], ...]
    compute: Callable[[torch.Tensor], tuple[torch.Tensor | SparseCoefficients, ...]] | None = None


class KeySink:
    """The index's capture sink: routes each captured tensor to its feeds' reducers."""

    def __init__(self, feeds: Iterable[Feed]) -> None:
        feeds = list(feeds)
        self.routes: dict[tuple[str, int], list[Feed]] = {}
        for feed in sorted(feeds, key=lambda f: f.compute is None):  # the in-place readers of a tensor last
            self.routes.setdefault((feed.quantity, feed.layer), []).append(feed)
        unique: dict[int, TriggerReducer] = {}
        for feed in feeds:
            for reducer, _ in feed.targets:
                unique.setdefault(id(reducer), reducer)
        self.reducers = list(unique.values())
        #: What the forward pass must capture for this sink.
        self.quantities = tuple(sorted({feed.quantity for feed in feeds}))

    def start(self, batch: Batch) -> None:
        for reducer in self.reducers:
            reducer.start(batch)

    def __call__(self, quantity: str, layer: int, tensor: torch.Tensor) -> None:
        for feed in self.routes.get((quantity, layer), ()):
            outputs = (tensor,) if feed.compute is None else feed.compute(tensor)
            for (reducer, place), coefficients in zip(feed.targets, outputs, strict=True):
                reducer("coefficients", place, coefficients)

    def commit(self) -> None:
        for reducer in self.reducers:
            reducer.commit()

    def flush(self) -> None:
        for reducer in self.reducers:
            reducer.flush()


def model_keys(reducer: TriggerReducer, n_layers: int) -> list[Feed]:
    """The feeds of the model's own keys: every layer's captured coefficients, as they are."""
    return [Feed("coefficients", layer, ((reducer, layer),)) for layer in range(n_layers)]


def random_keys(reducer: TriggerReducer, keys) -> list[Feed]:
    """The feeds of the random control memories (`ffkv.memories.controls.RandomKeys`): they read the FF input, as
    the layer's keys do."""
    return [Feed("ff_in", layer, ((reducer, layer),), lambda x, layer=layer: (keys.coefficients(layer, x),))
            for layer in range(keys.view.n_layers)]


__all__ = ["Feed", "KeySink", "model_keys", "random_keys"]
