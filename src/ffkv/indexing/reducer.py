"""Reduce one layer's coefficients of one batch to its top-k trigger candidates per key.

This runs inside the forward pass (as a capture sink), so a layer's full
coefficient tensor is dropped as soon as it is reduced: memory stays at one
layer's activations, whatever the corpus size.
"""

from __future__ import annotations

import torch

from ffkv.batching import Batch
from ffkv.indexing.topk import EMPTY, ID_LIMIT, TopKState, select_top

MODES = ("example", "prefix")


#: Elements of c compared at once by `first_position_of`: its temporaries then stay in cache.
_CHUNK_ELEMENTS = 2**20


def first_position_of(c: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """The first position t at which c[b, t, j] equals best[b, j], as (B, d_m) int64.

    Equals the indices of `c.max(dim=1)` when `best` is `c.amax(dim=1)`, and is 2 to 3 times
    cheaper on a CPU (GPT-2-small shapes): the maximum of (c == best) weighted by T - t is
    vectorised there, while max with indices over a middle dimension is not.
    Examples are compared a few at a time, so that the temporaries stay in cache.
    """
    b, t, d_m = c.shape
    # The narrowest type that holds T - t; below 256 positions a byte, where the product with the
    # comparison's bytes (viewed as uint8) is a quarter cheaper than with int16.
    small = t < 2**8
    dtype = torch.uint8 if small else torch.int16 if t < 2**15 else torch.int32
    reverse = torch.arange(t, 0, -1, dtype=dtype, device=c.device)[None, :, None]
    rows = max(1, _CHUNK_ELEMENTS // (t * d_m))

    def marks(i: int) -> torch.Tensor:  # T - t where c equals best, 0 elsewhere
        equal = c[i: i + rows] == best[i: i + rows, None, :]
        return (equal.view(torch.uint8) if small else equal) * reverse

    last = torch.cat([marks(i).amax(dim=1) for i in range(0, b, rows)])
    return (t - last.long()).clamp_(max=t - 1)  # NaN never equals: clamp keeps it in range


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

    def write(self, layer: int, rows: slice, candidates: tuple[torch.Tensor, ...]) -> None:
        """Place (len(rows), n) candidates of `layer` after the accepted columns."""
        n = candidates[0].shape[-1]
        for target, source in zip(self.fields, candidates):
            target[layer, rows, self.filled: self.filled + n].copy_(source)

    def accept(self, n: int, one_per_example: bool) -> None:
        """The n columns just written hold a whole batch; merge once `columns` have gathered."""
        self.filled += n
        if self.filled >= self.columns:
            self.merge(one_per_example)

    def merge(self, one_per_example: bool) -> None:
        """Merge every accepted column into the state."""
        if self.filled:
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
    """

    #: What the forward pass must capture for this sink.
    quantities = ("coefficients",)

    def __init__(self, state: TopKState, mode: str = "example", signed: bool = False,
                 buffer_columns: int | None = None) -> None:
        """Args:
            buffer_columns: candidates per key gathered before a merge; None: 2·k on a CPU, a
                merge per batch on other devices, where a merge is a few launches for the whole
                model and its temporaries, not its sort, would grow.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.state = state
        self.mode = mode
        self.signed = signed
        self._directions = 2 if signed else 1
        if buffer_columns is None:
            buffer_columns = 2 * state.k if state.values.device.type == "cpu" else 0
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
        self._n = min(self.state.k, b if self.mode == "example" else b * t)
        self._buffer.reserve(self._n, self._fast)
        self._reduced.clear()

    def __call__(self, quantity: str, layer: int, coefficients: torch.Tensor) -> None:
        """Capture sink: reduce (B, T, d_m) coefficients of `layer` to at most k candidates per key
        and direction."""
        # In place, in the model's dtype: the model is done with this tensor, and max is exact in any dtype.
        # Only the few blocked positions are written (padding and special tokens), not a full masked copy.
        c = coefficients
        b, t, d_m = c.shape
        if self._directions * d_m != self.state.values.shape[1]:
            raise ValueError(f"a layer of {d_m} keys does not match a state of {self.state.values.shape[1]} rows "
                             f"({'signed' if self.signed else 'positive'} index)")
        for block, direction in enumerate((1, -1)[: self._directions]):
            # Blocked positions must lose in this direction: +inf never wins a minimum.
            c.index_put_(self.batch.blocked, self._losing[block].to(c.dtype))
            if self.mode == "example":
                best, pos = self._best_positions(layer, c, direction)          # (B, d_m)
                values, position = best.T, pos.T                                # (d_m, B)
                example_id = self._eid[None, :].expand(d_m, b)
                next_token = self.batch.next_token.gather(1, pos).T
            else:
                values = c.reshape(b * t, d_m).T.float()                        # (d_m, B*T), (eid, pos) order
                values = values if direction == 1 else -values
                position = self._pos[None, :].expand(d_m, -1)
                example_id = self._eid[None, :].expand(d_m, -1)
                next_token = self._next[None, :].expand(d_m, -1)
            if self._n < values.shape[1]:
                top = select_top(values, self._n)
                values, example_id = values.gather(1, top), example_id.gather(1, top)
                position, next_token = position.gather(1, top), next_token.gather(1, top)
            self._buffer.write(layer, slice(block * d_m, (block + 1) * d_m),
                               (values, example_id, position, next_token))
        self._reduced.add(layer)

    def _best_positions(self, layer: int, c: torch.Tensor, direction: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per example and key, in `direction` (+1: the maximum over positions; -1: the minimum,
        returned negated as the state stores it) and its first position.

        torch's max, min, argmax and argmin return the first extreme index, so ties go to the
        lower position. On a CPU, max with indices over the middle dimension is slow, so the
        values come from amax (amin) and positions are looked up only where a candidate can
        still enter the state (its value reaches the key's current k-th value); the
        others are never kept, and their position is left at 0.
        """
        d_m = c.shape[-1]
        if c.device.type != "cpu":
            if direction == 1:
                return c.max(dim=1)
            worst, pos = c.min(dim=1)
            return -worst, pos
        extreme = c.amax(dim=1) if direction == 1 else c.amin(dim=1)
        best = extreme if direction == 1 else -extreme
        kth = self.state.values[layer, :d_m, -1] if direction == 1 else self.state.values[layer, d_m:, -1]
        reach = best >= kth
        rows, keys = reach.nonzero(as_tuple=True)
        if len(rows) > reach.numel() // 8:  # early in a run most candidates reach: one pass is cheaper
            return best, first_position_of(c, extreme)
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
            self._buffer.accept(self._n, self._fast)
        self._reduced.clear()
        self.batch = self._eid = self._pos = self._next = self._blocked_flat = None

    def flush(self) -> None:
        """Merge every accepted batch's candidates into the state."""
        self._buffer.merge(self._fast)
