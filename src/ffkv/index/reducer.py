"""Reduce one layer's coefficients of one batch to its top-k trigger candidates per key.

This runs inside the forward pass (as a capture sink), so a layer's full
coefficient tensor is dropped as soon as it is reduced: memory stays at one
layer's activations, whatever the corpus size.
"""

from __future__ import annotations

import torch

from ffkv.batching import Batch
from ffkv.index.topk import EMPTY, ID_LIMIT, TopKState, select_top

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
    reverse = torch.arange(t, 0, -1, dtype=torch.int16 if t < 2**15 else torch.int32, device=c.device)[None, :, None]
    rows = max(1, _CHUNK_ELEMENTS // (t * d_m))
    last = torch.cat([((c[i: i + rows] == best[i: i + rows, None, :]) * reverse).amax(dim=1)
                      for i in range(0, b, rows)])
    return (t - last.long()).clamp_(max=t - 1)  # NaN never equals: clamp keeps it in range


class TriggerReducer:
    """Collects per-batch candidates from coefficient captures, then merges them into a state.

    Candidates are merged only in `commit`, after the whole forward pass, so the
    state is always consistent with a whole number of batches (safe to checkpoint
    even when a pass is interrupted).

    With `signed`, the state has 2·d_m rows per layer (`ffkv.index.topk`): each layer's
    coefficients are reduced in both directions, the most negative ones as -m, and the two
    sets of candidates are concatenated, so that one selection and one merge serve both.
    """

    def __init__(self, state: TopKState, mode: str = "example", signed: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.state = state
        self.mode = mode
        self.signed = signed
        self._directions = 2 if signed else 1
        # The one-sort merge applies while each example is one candidate per key and ids fit 32 bits.
        self._fast = mode == "example" and state.ids_fit()
        self.batch: Batch | None = None
        self._eid = self._pos = self._next = self._blocked_flat = None
        self._pending: dict[int, tuple[torch.Tensor, ...]] = {}

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
        self._pending.clear()

    def __call__(self, quantity: str, layer: int, coefficients: torch.Tensor) -> None:
        """Capture sink: reduce (B, T, d_m) coefficients of `layer` to at most k candidates per key."""
        # In place, in the model's dtype: the model is done with this tensor, and max is exact in any dtype.
        # Only the few blocked positions are written (padding and special tokens), not a full masked copy.
        c = coefficients
        c[self.batch.blocked] = float("-inf")
        b, t, d_m = c.shape
        rows = self._directions * d_m  # the state's rows of this layer: positive keys, then negative ones
        if rows != self.state.values.shape[1]:
            raise ValueError(f"a layer of {d_m} keys does not match a state of {self.state.values.shape[1]} rows "
                             f"({'signed' if self.signed else 'positive'} index)")
        if self.mode == "example":
            best, pos = self._best_positions(layer, c, 1)                      # (B, d_m)
            values, position = best.T.float(), pos.T                            # (d_m, B)
            if self.signed:  # blocked positions must lose the minimum too: the candidates above are copies
                c[self.batch.blocked] = float("inf")
                best, pos = self._best_positions(layer, c, -1)                  # -min_j m and its argmin
                values, position = torch.cat([values, best.T.float()]), torch.cat([position, pos.T])
            example_id = self._eid[None, :].expand(rows, b)
            next_token = self.batch.next_token.gather(1, position.T).T
        else:
            values = c.reshape(b * t, d_m).T.float()                            # (d_m, B*T), (eid, pos) order
            if self.signed:
                values = torch.cat([values, -values])
                values[d_m:, self._blocked_flat] = float("-inf")               # blocked prefixes never compete
            position = self._pos[None, :].expand(rows, -1)
            example_id = self._eid[None, :].expand(rows, -1)
            next_token = self._next[None, :].expand(rows, -1)
        k = min(self.state.k, values.shape[1])
        if k < values.shape[1]:
            top = select_top(values, k)
            values, example_id = values.gather(1, top), example_id.gather(1, top)
            position, next_token = position.gather(1, top), next_token.gather(1, top)
        self._pending[layer] = (values, example_id, position, next_token)

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
        """Merge the finished batch's candidates, every layer at once, into the state."""
        if self._pending:
            n_layers = self.state.values.shape[0]
            if sorted(self._pending) != list(range(n_layers)):
                raise RuntimeError(f"the forward pass reduced layers {sorted(self._pending)}, "
                                   f"not all {n_layers}")
            fields = zip(*(self._pending[layer] for layer in range(n_layers)))
            self.state.merge_candidates(*(torch.stack(f) for f in fields), one_per_example=self._fast)
        self._pending.clear()
        self.batch = self._eid = self._pos = self._next = self._blocked_flat = None
