"""Reduce one layer's coefficients of one batch to its top-k trigger candidates per key.

This runs inside the forward pass (as a capture sink), so a layer's full
coefficient tensor is dropped as soon as it is reduced: memory stays at one
layer's activations, whatever the corpus size.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from ffkv.batching import Batch
from ffkv.indexing import extremes
from ffkv.indexing.sparse import best_per_example, top_prefixes
from ffkv.memories.latent_keys import SparseCoefficients
from ffkv.indexing.topk import EMPTY, ID_LIMIT, TopKState, select_top

MODES = ("example", "prefix")


#: The 1-minute load average per torch thread above which `contended` reads the machine as shared. The index's own
#: threads count in it: an idle machine running the index reads about 1 per thread.
CONTENDED_LOAD = 1.5
#: Seconds between two readings of the load average.
LOAD_EVERY = 1.0
_load_read = {"at": -math.inf, "contended": True}


def contended() -> bool:
    """Whether other work competes for this machine's cores: the 1-minute load average above `CONTENDED_LOAD` per
    torch thread (read at most every `LOAD_EVERY` seconds; True where the system gives no load average)."""
    now = time.monotonic()
    if now - _load_read["at"] >= LOAD_EVERY:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            load = math.inf
        _load_read.update(at=now, contended=load > CONTENDED_LOAD * torch.get_num_threads())
    return _load_read["contended"]


@contextmanager
def one_thread(device: torch.device, always: bool = False) -> Iterator[None]:
    """Run the enclosed CPU operations on one thread while the machine is shared (`contended`; `always`: whatever
    the load).

    The reduction's selections, gathers, writes and merges are many operations on (keys, batch)
    tensors: each is split over torch's threads, and on a shared machine each split waits for its
    other threads to be scheduled: one layer's selections and writes at SmolLM2's shape took 256 ms
    on 2 threads at load average 5.5 and 7 ms on one (`benchmarks/reduction_threads.py`). On an idle
    machine the switch costs more than it saves: the next parallel operation (the model's own) waits
    for torch's threads to start again, and SmolLM2's index over 1,200 short sentences took 7% longer
    switching than not (54.4 s against 50.7 s, median of 3, load 1.3-1.8). The passes over a layer's
    whole (B, T, d_m) coefficients stay parallel. Results do not depend on the number of threads.
    """
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1 or not (always or contended()):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class CandidateBuffer:
    """Candidates of accepted batches, one (L, rows, width) tensor per state field, merged
    into the state when `columns` per key have gathered (or on `merge`).

    Each layer's candidates are written once into their place, so neither a stack of the
    layers nor a concatenation of the batches is made before the merge.
    """

    #: values, example ids, positions, next tokens (as `TopKState.merge_candidates` takes them).
    DTYPES = (torch.float32, torch.int64, torch.int32, torch.int32)

    def __init__(self, state: TopKState, columns: int) -> None:
        self.state, self.columns = state, columns
        self.fields: list[torch.Tensor] = []
        self.filled = 0  # columns of accepted batches

    def reserve(self, n: int, one_per_example: bool) -> None:
        """Make room for a batch of n candidates per key (merging what is held if needed)."""
        width = self.fields[0].shape[-1] if self.fields else 0
        if self.filled + n > width:
            self.merge(one_per_example)
        if n > width:  # a batch then always fits while fewer than `columns` are held
            shape = (*self.state.values.shape[:2], self.columns + n)
            self.fields = [torch.empty(shape, dtype=d, device=self.state.values.device) for d in self.DTYPES]

    def write(self, layer: int, rows: slice, candidates: tuple[torch.Tensor | None, ...]) -> None:
        """Place (len(rows), n) candidates of `layer` after the accepted columns (a field given as None is left
        for the caller to write for every layer at once, through `written`)."""
        n = next(c for c in candidates if c is not None).shape[-1]
        for target, source in zip(self.fields, candidates):
            if source is not None:
                target[layer, rows, self.filled: self.filled + n].copy_(source)

    def written(self, field: int, n: int) -> torch.Tensor:
        """The (L, rows, n) columns of one field (an index into `DTYPES`) after the accepted ones: what `write`
        placed there, or where a field is written for every layer at once."""
        return self.fields[field][..., self.filled: self.filled + n]

    def accept(self, n: int, one_per_example: bool) -> None:
        """The n columns just written hold a whole batch; merge once `columns` have gathered."""
        self.filled += n
        if self.filled >= self.columns:
            self.merge(one_per_example)

    def merge(self, one_per_example: bool) -> None:
        """Merge every accepted column into the state."""
        if self.filled:
            with one_thread(self.state.values.device):  # blocks of a few dozen small sorts and gathers
                self.state.merge_candidates(*(f[..., : self.filled] for f in self.fields),
                                            one_per_example=one_per_example)
        self.filled = 0


class TriggerReducer:
    """Collects per-batch candidates from coefficient captures, then merges them into a state.

    A batch's candidates are accepted only in `commit`, after the whole forward pass, and
    reach the state in a merge, so the state is always consistent with a whole number of
    batches (safe to checkpoint even when a pass is interrupted). On a CPU, the candidates
    of a few batches are merged at once (`buffer_columns` per key): merging k + m·n
    candidates once costs far less than m merges of k + n, and the merge is exact and
    associative, so the result is the same. Call `flush` before reading or saving the state.

    With `signed`, the state has 2·d_m rows per layer (`ffkv.indexing.topk`): each layer's
    coefficients are reduced in both directions, the most negative ones as -m, into the
    two row blocks of the layer, so that one selection and one merge serve both.

    A capture may also be `SparseCoefficients` (a TopK dictionary's latents, `ffkv.indexing.sparse`): they reduce
    from their active entries alone, to the candidates the dense tensor gives where a key fired (the state then
    differs only in zeros, which no latent table keeps); positive index only.
    """

    #: What the forward pass must capture for this sink.
    quantities = ("coefficients",)

    def __init__(self, state: TopKState, mode: str = "example", signed: bool = False,
                 buffer_columns: int | None = None, select_per_layer: bool | None = None) -> None:
        """Args:
            buffer_columns: candidates per key gathered before a merge; None: 2·k on a CPU, a
                merge per batch on other devices, where a merge is a few launches for the whole
                model and its temporaries, not its sort, would grow.
            select_per_layer: in mode example, whether each layer's and direction's candidates are cut to the
                batch's best k per key as the layer is reduced (a selection per layer and direction), or every
                example's candidate waits in the buffer for the merge, whose one selection serves every layer
                and direction, and whose example ids and next tokens are written once for all layers. The two
                give the same state (the merge keeps the best k of all candidates either way; a batch's
                columns are in example-id order, so both break ties alike). None: per layer on a CPU, where
                the buffer gathers several batches and a batch rarely holds more than k examples; in the
                merge on other devices, where each selection is launches, not arithmetic: on an H200 the
                per-layer selections were 30% of GPT-2 small's indexed pass. Mode prefix selects per layer.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.state = state
        self.mode = mode
        self.signed = signed
        self._directions = 2 if signed else 1
        on_cpu = state.values.device.type == "cpu"
        self._select = mode == "prefix" or (on_cpu if select_per_layer is None else select_per_layer)
        if buffer_columns is None:
            buffer_columns = 2 * state.k if on_cpu else 0
        self._buffer = CandidateBuffer(state, buffer_columns)
        # The one-sort merge applies while each example is one candidate per key and ids fit 32 bits.
        self._fast = mode == "example" and state.ids_fit()
        self.batch: Batch | None = None
        self._eid = self._pos = self._next = self._blocked_flat = None
        self._n = 0  # candidates per key of the current batch
        self._reduced: set[int] = set()
        # What blocked positions are set to, per direction, as tensors on the device: a Python number
        # would be copied from pageable host memory at every write, which synchronises a GPU.
        self._losing = [torch.full((), v, device=state.values.device) for v in (float("-inf"), float("inf"))]

    def start(self, batch: Batch) -> None:
        """Announce the batch whose coefficients the next forward pass produces."""
        self.batch = batch
        self._fast = self._fast and batch.max_example_id < ID_LIMIT
        # Per-batch constants, made once on the device (no scalar copies inside the layer loop).
        b, t = batch.input_ids.shape
        if self.mode == "example":
            self._eid = torch.where(batch.competes.any(dim=1), batch.example_ids, EMPTY)
        else:
            self._eid = torch.where(batch.competes, batch.example_ids[:, None], EMPTY).reshape(-1)
            self._pos = torch.arange(t, device=batch.input_ids.device, dtype=torch.int32).repeat(b)
            self._next = batch.next_token.reshape(-1)
            self._blocked_flat = batch.blocked[0] * t + batch.blocked[1]
        # Candidates per key of this batch: the batch's best k, or every example's until the merge selects.
        self._n = min(self.state.k, b if self.mode == "example" else b * t) if self._select else b
        self._buffer.reserve(self._n, self._fast)
        self._reduced.clear()

    def __call__(self, quantity: str, layer: int, coefficients: torch.Tensor | SparseCoefficients) -> None:
        """Capture sink: reduce (B, T, d_m) coefficients of `layer` (or sparse ones) to at most k candidates per
        key and direction."""
        if isinstance(coefficients, SparseCoefficients):
            self._reduce_sparse(layer, coefficients)
            return
        # In place, in the model's dtype: the model is done with this tensor, and max is exact in any dtype.
        # Only the few blocked positions are written (padding and special tokens), not a full masked copy.
        c = coefficients
        b, t, d_m = c.shape
        if self._directions * d_m != self.state.values.shape[1]:
            raise ValueError(f"a layer of {d_m} keys does not match a state of {self.state.values.shape[1]} rows "
                             f"({'signed' if self.signed else 'positive'} index)")
        if self.mode == "example" and not self._select and extremes.available(c):
            # One kernel: both directions, blocked positions skipped, written straight into the buffer.
            values, positions = (self._buffer.written(field, self._n)[layer] for field in (0, 2))
            extremes.masked_extremes(c, self.batch.competes, values[:d_m], positions[:d_m],
                                     *((values[d_m:], positions[d_m:]) if self.signed else ()))
            self._reduced.add(layer)
            return
        for block, direction in enumerate((1, -1)[: self._directions]):
            # Blocked positions must lose in this direction: +inf never wins a minimum.
            with one_thread(c.device):
                c.index_put_(self.batch.blocked, self._losing[block].to(c.dtype))
            if self.mode == "example":
                best, pos = self._best_positions(layer, c, direction)          # (B, d_m)
                with one_thread(c.device):  # (d_m, B) selections: small operations
                    self._keep_examples(layer, block, best.T, pos.T)
            else:
                values = c.reshape(b * t, d_m).T.float()                        # (d_m, B*T), (eid, pos) order
                self._keep(layer, block, values if direction == 1 else -values, self._eid[None, :].expand(d_m, -1),
                           self._pos[None, :].expand(d_m, -1), self._next[None, :].expand(d_m, -1))
        self._reduced.add(layer)

    def _reduce_sparse(self, layer: int, c: SparseCoefficients) -> None:
        """Reduce sparse coefficients of `layer`: the candidates of the dense reduction where a key fired (one per
        example at its first best position, or the best prefixes), the zeros elsewhere left out."""
        if self.signed:
            raise ValueError("sparse coefficients are never negative: reduce them into a positive (unsigned) state")
        if c.n_keys != self.state.values.shape[1]:
            raise ValueError(f"sparse coefficients of {c.n_keys} keys do not match a state of "
                             f"{self.state.values.shape[1]} rows")
        with one_thread(c.values.device):  # O(B·T·k) scatters and sorts: small operations
            if self.mode == "example":
                best, pos = best_per_example(c, self.batch.competes)                # (B, n_keys)
                self._keep_examples(layer, 0, best.T, pos.T)
            else:
                values, columns = top_prefixes(c, self.batch.competes, self._n)     # (n_keys, n)
                filled, at = columns >= 0, columns.clamp(min=0)
                self._keep(layer, 0, values, torch.where(filled, self._eid[at], EMPTY), self._pos[at],
                           torch.where(filled, self._next[at], -1))
        self._reduced.add(layer)

    def _keep_examples(self, layer: int, block: int, values: torch.Tensor, position: torch.Tensor) -> None:
        """Keep one direction's (d_m, B) candidates of mode example: each example's best value per key and its
        position; their example ids and next tokens follow from the position (`commit` writes them for every
        layer at once where no selection comes first)."""
        if not self._select:
            d_m = values.shape[0]
            self._buffer.write(layer, slice(block * d_m, (block + 1) * d_m), (values, None, position, None))
            return
        self._keep(layer, block, values, self._eid[None, :].expand(values.shape[0], -1), position,
                   self.batch.next_token.gather(1, position.T).T)

    def _keep(self, layer: int, block: int, values: torch.Tensor, example_id: torch.Tensor, position: torch.Tensor,
              next_token: torch.Tensor) -> None:
        """Write the batch's best n candidates per key of one direction's (d_m, columns) candidates to the buffer."""
        if self._n < values.shape[1]:
            top = select_top(values, self._n)
            values, example_id = values.gather(1, top), example_id.gather(1, top)
            position, next_token = position.gather(1, top), next_token.gather(1, top)
        d_m = values.shape[0]
        self._buffer.write(layer, slice(block * d_m, (block + 1) * d_m), (values, example_id, position, next_token))

    def _best_positions(self, layer: int, c: torch.Tensor, direction: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per example and key, in `direction` (+1: the maximum over positions; -1: the minimum,
        returned negated as the state stores it) and its first position.

        torch's max, min, argmax and argmin return the first extreme index, so ties go to the
        lower position. On a CPU, max with indices over the middle dimension costs three times
        amax, so the values come from amax (amin) and positions are looked up only where a
        candidate can still enter the state (its value reaches the key's current k-th value);
        the others are never kept, and their position is left at 0. Early in a run, when most
        candidates reach, one max (min) with indices over the whole layer gives them all.
        """
        d_m = c.shape[-1]
        if c.device.type != "cpu":
            if direction == 1:
                return c.max(dim=1)
            worst, pos = c.min(dim=1)
            return -worst, pos
        extreme = c.amax(dim=1) if direction == 1 else c.amin(dim=1)
        with one_thread(c.device):
            best = extreme if direction == 1 else -extreme
            kth = self.state.values[layer, :d_m, -1] if direction == 1 else self.state.values[layer, d_m:, -1]
            reach = best >= kth
            rows, keys = reach.nonzero(as_tuple=True)
        if len(rows) > reach.numel() // 8:  # most candidates reach: one pass over the layer
            return best, (c.max(dim=1) if direction == 1 else c.min(dim=1)).indices
        with one_thread(c.device):
            pos = torch.zeros(best.shape, dtype=torch.long)
            if len(rows):
                sub = c[rows, :, keys]
                pos[rows, keys] = sub.argmax(dim=1) if direction == 1 else sub.argmin(dim=1)
        return best, pos

    def commit(self) -> None:
        """Accept the finished batch's candidates, every layer at once; they reach the state in
        this call or, on a CPU, in a later one that merges several batches (or in `flush`)."""
        n_layers = self.state.values.shape[0]
        if self._reduced:
            if sorted(self._reduced) != list(range(n_layers)):
                raise RuntimeError(f"the forward pass reduced layers {sorted(self._reduced)}, "
                                   f"not all {n_layers}")
            if not self._select:  # every layer's example ids and next tokens, from the positions written
                self._buffer.written(1, self._n).copy_(self._eid)
                at = self._buffer.written(2, self._n).long()                        # (L, rows, B) positions
                at += torch.arange(0, at.shape[-1] * self.batch.next_token.shape[1], self.batch.next_token.shape[1],
                                   device=at.device)                                 # into the flat (B·T) tokens
                self._buffer.written(3, self._n).copy_(self.batch.next_token.reshape(-1).take(at))
            self._buffer.accept(self._n, self._fast)
        self._reduced.clear()
        self.batch = self._eid = self._pos = self._next = self._blocked_flat = None

    def flush(self) -> None:
        """Merge every accepted batch's candidates into the state."""
        self._buffer.merge(self._fast)
