"""The GPU index's one-read kernel (`ffkv.indexing.extremes`) against torch's masked max and min, and the reducer
that uses it against the reducer that does not. On a CPU the kernel runs in Triton's interpreter; on a GPU, as
compiled (the same tests, `device` cuda)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ffkv.batching import collate
from ffkv.indexing import extremes
from ffkv.indexing.reducer import TriggerReducer
from ffkv.indexing.topk import TopKState

triton = pytest.importorskip("triton", reason="the kernel's tests run it in Triton's interpreter")

#: Triton's interpreter before 3.9 passes a kernel's integer arguments as arrays that `range` refuses (3.6 does); the
#: compiled kernel runs on any.
OLD_INTERPRETER = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9)
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(OLD_INTERPRETER, reason="Triton's interpreter before 3.9")),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.fixture
def kernel_on(monkeypatch, device):
    """The kernel runs: compiled on a GPU, interpreted on a CPU."""
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return device


def torch_extremes(c: torch.Tensor, competes: torch.Tensor):
    """What the reducer's torch path computes: max (min) over positions with blocked ones at -inf (+inf)."""
    high, low = c.clone(), c.clone()
    high[~competes], low[~competes] = float("-inf"), float("inf")
    (best, best_at), (worst, worst_at) = high.max(dim=1), low.min(dim=1)
    return best.float().T, best_at.int().T, (-worst).float().T, worst_at.int().T


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_gives_torchs_masked_max_and_min(kernel_on, device, dtype, seed):
    """Small integers tie everywhere (the first position must win), an example with no competing position keeps
    -inf (+inf) at position 0, NaN wins as torch propagates it, and keys past a block's end (300 = 2 x 128 + 44)
    are written too; the outputs are strided views, as the candidate buffer's columns are."""
    g = torch.Generator().manual_seed(seed)
    b, t, d = 6, 9, 300
    c = torch.randint(-3, 4, (b, t, d), generator=g).to(dtype)
    c[1, 4, 7] = c[3, 0, 299] = c[3, 5, 299] = float("nan")
    competes = torch.rand(b, t, generator=g) > 0.3
    competes[2] = False
    competes[3, [0, 5]] = True
    c, competes = c.to(device), competes.to(device)
    buffer = torch.full((2 * d, b + 5), 7.0, device=device)
    at = torch.full((2 * d, b + 5), 7, dtype=torch.int32, device=device)
    extremes.masked_extremes(c, competes, buffer[:d, 2:2 + b], at[:d, 2:2 + b], buffer[d:, 2:2 + b], at[d:, 2:2 + b])
    expected = torch_extremes(c, competes)
    got = (buffer[:d, 2:2 + b], at[:d, 2:2 + b], buffer[d:, 2:2 + b], at[d:, 2:2 + b])
    for e, r in zip(expected, got):
        assert torch.equal(e.isnan(), r.isnan()) and torch.equal(e.nan_to_num(), r.nan_to_num())
    assert (buffer[:, :2] == 7).all() and (at[:, b + 2:] == 7).all()  # nothing written outside the columns
    assert got[0][:, 2].eq(float("-inf")).all() and got[1][:, 2].eq(0).all()  # no competing position
    assert got[0][299, 3].isnan() and got[1][299, 3] == 0  # the first NaN
    assert (got[1] > 0).any() and (got[3] > 0).any()  # positions that are not all 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", [True, False])
def test_the_reducer_with_the_kernel_keeps_the_state_it_keeps_without(kernel_on, device, signed):
    """Batches of 1 to 9 examples (above and below k = 4) with tied integer coefficients, some of them starting
    with a special token: the reducer that selects in the merge through the kernel ends with the state of the
    one that selects per layer through torch (itself checked against a brute force in test_signed)."""
    g = torch.Generator().manual_seed(3)
    n_layers, d, k, special = 2, 150, 4, 1
    rows = d * (2 if signed else 1)
    states = {select: TopKState.empty(n_layers, rows, k, device) for select in (True, False)}
    reducers = {select: TriggerReducer(states[select], "example", signed=signed, select_per_layer=select)
                for select in (True, False)}
    next_id = itertools.count()
    for size in (1, 9, 3, 5, 2, 8):
        group = []
        for _ in range(size):
            tokens = torch.randint(2, 9, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
            if torch.rand(1, generator=g) < 0.3:
                tokens[0] = special
            group.append(type("Example", (), {"example_id": next(next_id), "token_ids": tokens.numpy()})())
        batch = collate(group, 0, {special}).to(device)
        layers = [torch.randint(-3, 4, (*batch.input_ids.shape, d), generator=g).to(device) for _ in range(n_layers)]
        for select, reducer in reducers.items():
            reducer.start(batch)
            for layer, c in enumerate(layers):
                reducer("coefficients", layer, c.float().clone())
            reducer.commit()
    for reducer in reducers.values():
        reducer.flush()
    for a, b in zip(states[True].state_dict().values(), states[False].state_dict().values()):
        assert torch.equal(a, b)
    assert (states[False].example_id != torch.iinfo(torch.int64).max).all()  # every slot filled: a real merge


def test_the_kernel_is_used_where_it_runs(monkeypatch):
    """Not on a CPU unless interpreted: the CPU index keeps torch's reductions."""
    c = torch.zeros(2, 3, 4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not extremes.available(c)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert extremes.available(c) and not extremes.available(c[0])
