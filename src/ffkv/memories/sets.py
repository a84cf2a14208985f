"""A layer's memories, whatever their source: the model's own neurons, or a sparse dictionary's latents.

Both are key-value memories of a feed-forward layer (docs/definitions.md, "Sparse
dictionaries"): memory i of layer l has a key it reads, a value it writes, and a coefficient at each position.
`MemorySet` is that one interface; code that reads memories takes a `MemorySet` and never asks which source it
holds:

=========================  ==============================  ======================================================
                           `Neurons` (the model's FF)      `Latents` (a transcoder's or an SAE's)
=========================  ==============================  ======================================================
``layers``                 every FF layer                  the layers the dictionary covers
``size(l)``                d_m                             the layer's latents
``keys(l)``, ``values(l)`` K and V of the FF layer         encoder and decoder rows
``reads(l)``               the captured ``coefficients``   the FF input after its norm (transcoder) or the
                                                           FF output (SAE): `ffkv.memories.view.QUANTITIES`
``coefficients(l, x)``     x itself (m, captured as is)    the dictionary's activations of x (`Dictionary.encode`)
``ref(l, i)``              `MemoryRef` ``L:K``             `LatentRef` ``tL:J`` / ``sL:J``
=========================  ==============================  ======================================================

`MemorySet.layout` says which memories can be named (`ffkv.memories.address.MemoryLayout`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from jaxtyping import Float

from ffkv.dictionaries import Dictionary, check_against, reopen
from ffkv.errors import FfkvError
from ffkv.memories.address import LatentRef, MemoryLayout, MemoryRef
from ffkv.memories.view import MemoryView

#: The captured quantity a dictionary's keys read, by its kind (`ffkv.memories.view.QUANTITIES`).
READS = {"transcoder": "ff_in", "sae": "ff_out"}


class MemorySet(ABC):
    """The memories of some FF layers of one model: keys, values, and how a forward pass yields their
    coefficients."""

    #: "neurons" or "latents": which source, as the run's tables name it (latent_trigger_examples.parquet).
    source: str

    @property
    @abstractmethod
    def layers(self) -> list[int]:
        """The FF layers (from 0) that have memories of this set."""

    @abstractmethod
    def size(self, layer: int) -> int:
        """How many memories `layer` has."""

    @abstractmethod
    def keys(self, layer: int) -> Float[torch.Tensor, "n d_model"]:
        """The layer's keys, one row per memory."""

    @abstractmethod
    def values(self, layer: int) -> Float[torch.Tensor, "n d_model"]:
        """The layer's values, one row per memory: what memory i adds to the FF output per unit of coefficient."""

    @abstractmethod
    def reads(self, layer: int) -> str:
        """The captured quantity `coefficients` reads (a name of `ffkv.memories.view.QUANTITIES`)."""

    @abstractmethod
    def coefficients(self, layer: int, captured: Float[torch.Tensor, "*batch d"]) -> Float[torch.Tensor, "*batch n"]:
        """The memories' coefficients at each position, from the captured `reads(layer)` of those positions."""

    @abstractmethod
    def ref(self, layer: int, index: int) -> MemoryRef | LatentRef:
        """Memory `index` of `layer`, as its address (checked)."""

    @property
    @abstractmethod
    def layout(self) -> MemoryLayout:
        """The memories one can name: the model's neurons, and these latents if this set holds latents."""

    def _layer(self, layer: int) -> int:
        if layer not in self.layers:
            have = ", ".join(str(lay + 1) for lay in self.layers)
            raise FfkvError(f"layer {layer + 1} has no {self.source} here: layers {have} have (counted from 1)")
        return layer


class Neurons(MemorySet):
    """The model's own FF memories (`MemoryView`): key i is row i of K, value i row i of V, m captured as is."""

    source = "neurons"

    def __init__(self, view: MemoryView) -> None:
        self.view = view

    @property
    def layers(self) -> list[int]:
        return list(range(self.view.n_layers))

    def size(self, layer: int) -> int:
        return self.view.d_m

    def keys(self, layer: int) -> Float[torch.Tensor, "n d_model"]:
        return self.view.keys(self._layer(layer))

    def values(self, layer: int) -> Float[torch.Tensor, "n d_model"]:
        return self.view.values(self._layer(layer))

    def reads(self, layer: int) -> str:
        return "coefficients"

    def coefficients(self, layer: int, captured: Float[torch.Tensor, "*batch d"]) -> Float[torch.Tensor, "*batch n"]:
        return captured

    def ref(self, layer: int, index: int) -> MemoryRef:
        return MemoryRef.check(layer, index, self.view.n_layers, self.view.d_m)

    @property
    def layout(self) -> MemoryLayout:
        return MemoryLayout(self.view.n_layers, self.view.d_m)


class Latents(MemorySet):
    """A sparse dictionary's latents (`ffkv.dictionaries.Dictionary`, one per layer it covers): key i is encoder
    row i, value i decoder row i, and the coefficient the dictionary's own activation of what its key reads.

    Args:
        view: the model the dictionaries belong to (checked against its layer count and width).
        dictionaries: FF layer (from 0) -> its dictionary (`ffkv.dictionaries.open_dictionary`); each is moved
            to the model's device, in its own dtype.
    """

    source = "latents"

    def __init__(self, view: MemoryView, dictionaries: Mapping[int, Dictionary]) -> None:
        if not dictionaries:
            raise FfkvError("no layer's dictionary given (expected FF layer -> Dictionary)")
        check_against(dictionaries, view.n_layers, view.d_model)
        self.view = view
        self.dictionaries = {int(layer): d.to(view.device) for layer, d in sorted(dictionaries.items())}

    @property
    def layers(self) -> list[int]:
        return list(self.dictionaries)

    def size(self, layer: int) -> int:
        return self.dictionaries[self._layer(layer)].n_latents

    def keys(self, layer: int) -> Float[torch.Tensor, "n d_model"]:
        return self.dictionaries[self._layer(layer)].encoder

    def values(self, layer: int) -> Float[torch.Tensor, "n d_model"]:
        return self.dictionaries[self._layer(layer)].decoder

    def reads(self, layer: int) -> str:
        return READS[self.dictionaries[self._layer(layer)].kind]

    def coefficients(self, layer: int, captured: Float[torch.Tensor, "*batch d"]) -> Float[torch.Tensor, "*batch n"]:
        return self.dictionaries[self._layer(layer)].encode(captured)

    def ref(self, layer: int, index: int) -> LatentRef:
        return self.layout.check_latent(layer, index)

    @classmethod
    def of_run(cls, view: MemoryView, recorded: Mapping[str, Mapping] | None, where: str | Path | None = None,
               run: str | Path = "the run") -> "Latents":
        """The latents of the dictionary a run was indexed with: `recorded` is its manifest's ``index.dictionary``,
        read again from its files (or from `where`, if they moved) and checked to be the same ones
        (`ffkv.dictionaries.reopen`); a run indexed without one is refused in one line naming `run`."""
        if not recorded:
            raise FfkvError(f"{run} was indexed without a dictionary: it has no latents (index with --dictionary PATH)")
        return cls(view, reopen(recorded, where))

    def attach(self) -> "Latents":
        """Attach these latents to their model's view (``view.latents``), so that edits of latents
        (`ffkv.memories.interventions.intervene`, ``t4:42`` on the command line) apply to them. Returns self."""
        self.view.latents = self
        return self

    @contextmanager
    def attached(self) -> Iterator["Latents"]:
        """`attach` within the block only: the view's own attachment (another dictionary's, or none) comes back
        after it, also on an error."""
        before = self.view.latents
        self.attach()
        try:
            yield self
        finally:
            self.view.latents = before

    @property
    def layout(self) -> MemoryLayout:
        return MemoryLayout(self.view.n_layers, self.view.d_m,
                            {layer: (d.kind, d.n_latents) for layer, d in self.dictionaries.items()})


def refuse_unused_dictionary(recorded: Mapping[str, Mapping] | None, where: str | Path | None,
                             run: str | Path = "the run") -> None:
    """Refuse, in one line naming `run`, a `where` (``--dictionary``: where the dictionary a run was indexed with lies
    now) for a run indexed without one (`recorded` empty), which would otherwise read nothing of it."""
    if where is not None and not recorded:
        raise FfkvError(f"{run} was indexed without a dictionary, so --dictionary {str(where)[:200]} would be read by "
                        "nothing: it names where a run's dictionary lies now (to read latents, index with --dictionary "
                        "PATH)")


def memories_of(view: MemoryView, kind: str) -> MemorySet:
    """The memories an edit of `kind` (`ffkv.memories.interventions.EDIT_KINDS`) names: the view's neurons, or
    the latents attached to it (refused in one line where none are)."""
    if kind == "neuron":
        return Neurons(view)
    if view.latents is None:
        raise FfkvError(f"a {kind}'s latent is named, but no dictionary is attached to the model (a run indexed "
                        "with --dictionary attaches its own)")
    return view.latents


__all__ = ["READS", "MemorySet", "Neurons", "Latents", "memories_of"]
