"""Examples to padded batches, grouped by similar length to waste little on padding.

Shared by the index and the experiments. The index builds batches from consecutive
windows of the example stream, so a run can checkpoint after any window and resume by
skipping the examples already consumed; the experiments batch rows of their own
(`row_batches`), each rank running its share (`ffkv.parallel.owned`). Within a batch,
rows are in ascending example id, which the exact tie-break needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from ffkv.parallel import owned

#: Batch shape of the experiments' own forward passes (speed only, never the result).
BATCH_SIZE = 32
MAX_BATCH_TOKENS = 8192


@dataclass
class Batch:
    """A padded batch (right padding).

    Attributes:
        example_ids: (B,) int64, ascending.
        input_ids: (B, T) int64, padded with the tokenizer's pad id.
        attention_mask: (B, T) int64, 1 on real tokens.
        competes: (B, T) bool, positions whose prefix competes for trigger examples
            (real tokens that are not special tokens such as BOS or SEP).
        next_token: (B, T) int32, the next token of each prefix, -1 at the end.
        blocked: (rows, columns) int64 indices of the positions that do not compete
            (found on the host, so that masking them costs no device sync).
        n_tokens: number of real tokens.
        max_example_id: the largest example id (known on the host, no device sync).
    """

    example_ids: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    competes: torch.Tensor
    next_token: torch.Tensor
    blocked: tuple[torch.Tensor, torch.Tensor]
    n_tokens: int
    max_example_id: int

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on `device`; to a GPU through pinned memory, so the copy does not wait for the GPU."""
        pin = torch.device(device).type == "cuda"
        move = lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.example_ids), move(self.input_ids), move(self.attention_mask),
                     move(self.competes), move(self.next_token), (move(self.blocked[0]), move(self.blocked[1])),
                     self.n_tokens, self.max_example_id)


def collate(examples: Sequence, pad_id: int, special_ids: Iterable[int] = (), pad_multiple: int = 1) -> Batch:
    """Pad examples (objects with `example_id` and `token_ids`) into one `Batch`.

    The padded length is rounded up to a multiple of `pad_multiple`: on a GPU, few
    distinct shapes mean few kernel plans to build, and aligned tiles.
    """
    examples = sorted(examples, key=lambda e: e.example_id)
    lengths = [len(e.token_ids) for e in examples]
    b, t = len(examples), -(-max(lengths) // pad_multiple) * pad_multiple
    ids = np.full((b, t), pad_id, dtype=np.int64)
    nxt = np.full((b, t), -1, dtype=np.int32)
    mask = np.zeros((b, t), dtype=np.int64)
    for row, (e, n) in enumerate(zip(examples, lengths)):
        ids[row, :n] = e.token_ids
        nxt[row, : n - 1] = e.token_ids[1:]
        mask[row, :n] = 1
    input_ids = torch.from_numpy(ids)
    attention_mask = torch.from_numpy(mask)
    competes = attention_mask.bool()
    special = torch.tensor(sorted(set(special_ids)), dtype=torch.int64)
    if len(special):
        competes &= ~torch.isin(input_ids, special)
    return Batch(
        example_ids=torch.tensor([e.example_id for e in examples], dtype=torch.int64),
        input_ids=input_ids,
        attention_mask=attention_mask,
        competes=competes,
        next_token=torch.from_numpy(nxt),
        blocked=torch.nonzero(~competes, as_tuple=True),
        n_tokens=int(sum(lengths)),
        max_example_id=int(examples[-1].example_id),
    )


def windows(examples: Iterable, window: int) -> Iterator[list]:
    """Consecutive lists of `window` examples (the last may be shorter)."""
    chunk: list = []
    for e in examples:
        chunk.append(e)
        if len(chunk) == window:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def length_batches(chunk: Sequence, batch_size: int, max_batch_tokens: int | None = None) -> list[list]:
    """Split one window into batches of similar length (stable: ties keep stream order).

    A batch holds at most `batch_size` examples and, when given, at most
    `max_batch_tokens` padded tokens.
    """
    by_length = sorted(chunk, key=lambda e: len(e.token_ids))
    batches: list[list] = []
    current: list = []
    for e in by_length:
        # Sorted by length, so e is the longest of the batch it would join.
        too_many = max_batch_tokens is not None and current and len(e.token_ids) * (len(current) + 1) > max_batch_tokens
        if len(current) == batch_size or too_many:
            batches.append(current)
            current = []
        current.append(e)
    if current:
        batches.append(current)
    return batches


@dataclass
class _Row:
    example_id: int
    token_ids: np.ndarray


@dataclass
class RowBatches:
    """This rank's padded batches of some rows (every batch in one process; `ffkv.parallel`).

    Iterating yields (row indices of the batch, in batch order; the batch on `device`).
    """

    groups: list[list[_Row]]
    pad_id: int
    special_ids: tuple[int, ...]
    device: torch.device | str

    @property
    def rows(self) -> np.ndarray:
        """The row indices of this rank's batches: what it passes to `ffkv.parallel.gather_rows`."""
        return np.array([r.example_id for group in self.groups for r in group], dtype=np.int64)

    def __iter__(self) -> Iterator[tuple[np.ndarray, Batch]]:
        for group in self.groups:
            batch = collate(group, self.pad_id, self.special_ids).to(self.device)
            yield batch.example_ids.cpu().numpy(), batch


def row_batches(rows: Sequence[tuple[int, np.ndarray]], pad_id: int, special_ids: Iterable[int],
                device: torch.device | str, batch_size: int = BATCH_SIZE,
                max_batch_tokens: int | None = MAX_BATCH_TOKENS, every_rank: bool = False) -> RowBatches:
    """The padded batches of (row index, token ids) pairs, grouped by length, that this rank runs
    (all of them when `every_rank`: a computation that each rank must run whole, such as a fit).

    All rows are cut into the batches one process would run, then each rank keeps its
    share (`owned`), so every row goes through the same padded batch in any world size.
    The row index stands in for the example id, so `collate` keeps rows in index order.
    """
    items = [_Row(i, np.asarray(t)) for i, t in rows]
    groups = length_batches(items, batch_size, max_batch_tokens)
    return RowBatches(groups if every_rank else owned(groups), pad_id,
                      tuple(sorted(int(i) for i in special_ids)), device)
