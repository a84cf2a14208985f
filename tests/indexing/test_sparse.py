"""A TopK dictionary's latents reduced from their active entries (`ffkv.indexing.sparse`) give the latent tables of
the dense reduction byte for byte: ties between examples and positions, zeros among the active entries, a dead
key, blocked positions, batches merged several at a time, both modes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ffkv.batching import collate
from ffkv.indexing.reducer import TriggerReducer
from ffkv.memories.latent_keys import SparseCoefficients
from ffkv.indexing.tables import latent_trigger_table
from ffkv.indexing.topk import TopKState
from ffkv.store import atomic

SPECIAL, PAD = 1, 0
N_KEYS, K = 12, 4
DEAD = N_KEYS - 1


def batches(seed: int, n_batches: int = 14):
    """Batches of 1-5 examples (ids scattered over the batches, as length batches cut them), 1-6 tokens each,
    some special (blocked); per batch the TopK coefficients of pre-activations on a few levels (so that values
    tie), negative ones among the k largest (active entries of coefficient 0), key DEAD never among them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(5 * n_batches, generator=g).tolist()
    for _ in range(n_batches):
        b = int(torch.randint(1, 6, (1,), generator=g))
        group = [SimpleNamespace(example_id=ids.pop(), token_ids=np.asarray(
            torch.randint(1, 9, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g), dtype=np.int32))
            for _ in range(b)]
        batch = collate(group, PAD, [SPECIAL])
        t = batch.input_ids.shape[1]
        pre = torch.randint(-2, 4, (b, t, N_KEYS), generator=g).float() / 2
        pre[..., DEAD] = -100.0
        values, indices = pre.topk(K, dim=-1, sorted=False)
        yield batch, SparseCoefficients(torch.relu(values), indices, N_KEYS)


def reduced(mode: str, sparse: bool, seed: int, top_k: int, select_per_layer: bool | None = None) -> TopKState:
    state = TopKState.empty(1, N_KEYS, top_k)
    reducer = TriggerReducer(state, mode, select_per_layer=select_per_layer)
    for batch, c in batches(seed):
        reducer.start(batch)
        reducer("coefficients", 0, c if sparse else c.dense())
        reducer.commit()
    reducer.flush()
    return state


@pytest.mark.parametrize("mode", ["example", "prefix"])
@pytest.mark.parametrize("seed,top_k", [(0, 3), (1, 5), (2, 1)])
@pytest.mark.parametrize("select_per_layer", [None, False])
def test_the_sparse_reduction_writes_the_dense_reductions_table(tmp_path, mode, seed, top_k, select_per_layer):
    """Also where the merge selects once (a GPU's default): the dense selecting per layer, the sparse not."""
    dense = latent_trigger_table({3: reduced(mode, False, seed, top_k)})
    sparse = latent_trigger_table({3: reduced(mode, True, seed, top_k, select_per_layer)})
    keys = dense["key"].to_numpy()
    assert set(keys) == set(range(N_KEYS)) - {DEAD} and len(keys) >= top_k * (N_KEYS - 1) // 2
    if top_k > 1:  # ties, decided by the example id (and the position)
        assert dense.to_pandas().duplicated(["key", "coefficient"]).any()
    atomic.write_parquet(tmp_path / "dense.parquet", dense)
    atomic.write_parquet(tmp_path / "sparse.parquet", sparse)
    assert (tmp_path / "dense.parquet").read_bytes() == (tmp_path / "sparse.parquet").read_bytes()


def test_sparse_coefficients_are_their_dense_tensor_and_refuse_a_signed_state():
    batch, c = next(batches(0))
    dense = c.dense()
    assert dense.shape == (*batch.input_ids.shape, N_KEYS)
    assert torch.equal(dense.gather(-1, c.indices), c.values) and int((dense != 0).sum(-1).max()) <= K
    reducer = TriggerReducer(TopKState.empty(1, 2 * N_KEYS, 3), signed=True)
    reducer.start(batch)
    with pytest.raises(ValueError, match="never negative"):
        reducer("coefficients", 0, c)
