"""The CPU's first-maximum lookup gives exactly the positions of torch's max with indices."""

from __future__ import annotations

import pytest
import torch

from ffkv.indexing import reducer
from ffkv.indexing.reducer import first_position_of


@pytest.mark.parametrize("chunk", [2**20, 1, 200])  # whole, one example at a time, two at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_position_equals_max_indices_with_ties_and_blocked_rows(dtype, chunk, monkeypatch):
    monkeypatch.setattr(reducer, "_CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    c = (torch.randint(0, 3, (5, 7, 11), generator=g).float() / 2).to(dtype)  # many exact ties
    c[1, 3:] = float("-inf")       # a padded example
    c[2] = float("-inf")           # an example with no competing position
    c[3, :, 4] = -0.0              # -0.0 and 0.0 are equal, the first wins
    c[3, 5, 4] = 0.0
    best, expected = c.max(dim=1)
    assert torch.equal(first_position_of(c, c.amax(dim=1)), expected)
    assert torch.equal(c.amax(dim=1), best)


@pytest.mark.parametrize("t", [255, 256])  # the widest sequence counted in bytes, and the first one past it
def test_first_position_at_the_width_of_a_byte(t):
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, 2, (3, t, 5), generator=g).float()
    c[0, :, 0] = 0.0
    c[0, t - 1, 0] = 1.0  # the last position, where T - t is 1
    c[1, :, 1] = 1.0      # every position ties: the first (T - t = T) wins
    best, expected = c.max(dim=1)
    assert torch.equal(first_position_of(c, best), expected)
    assert first_position_of(c, best)[0, 0] == t - 1 and first_position_of(c, best)[1, 1] == 0


def test_first_position_on_long_sequences():
    c = torch.zeros(1, 40_000, 2)
    c[0, 39_999, 0] = 1.0
    c[0, 33_000, 1] = 1.0
    c[0, 39_000, 1] = 1.0
    assert first_position_of(c, c.amax(dim=1)).tolist() == [[39_999, 33_000]]
