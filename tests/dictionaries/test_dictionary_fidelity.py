"""`ffkv.dictionaries.fidelity`: the FVU streams exactly (batched as over the whole), equals its definition and the
FF output's mean is the tokens'; a latent chosen at zero did not fire; the rows' losses are per predicted token and
loss recovered is 1 for a free splice, 0 for the mean. (The model's passes: tests/tools/test_train_dictionary.py and
tests/experiments/test_latents_beside.py, against brute force and exact answers.)"""

from __future__ import annotations

import math

import pytest
import torch

from ffkv.dictionaries import Dictionary
from ffkv.dictionaries.fidelity import Fidelity, LayerFidelity, loss_recovered
from ffkv.dictionaries.train import fraction_of_variance_unexplained


def test_the_fvu_streams_exactly_and_equals_its_definition():
    g = torch.Generator().manual_seed(0)
    d = Dictionary("transcoder", 0, torch.randn(16, 8, generator=g), torch.zeros(16), torch.randn(16, 8, generator=g),
                   torch.zeros(8), "topk", k=4)
    x, y = torch.randn(300, 8, generator=g), torch.randn(300, 8, generator=g) + 3
    streamed, whole = LayerFidelity(d), LayerFidelity(d)
    for a, b in zip(x.split(77), y.split(77)):
        streamed.add(a, b)
    whole.add(x, y)
    assert streamed.n == 300 and streamed.fvu == pytest.approx(whole.fvu, rel=1e-12)
    assert streamed.fvu == pytest.approx(float(fraction_of_variance_unexplained(y.double(), d(x).double())), rel=1e-12)
    torch.testing.assert_close(streamed.mean, y.double().mean(0))


def test_a_latent_chosen_at_zero_did_not_fire():
    # top-2 of pre-activations (1, -1, -1, 0, 0): latent 0 fires, the second one chosen is at zero
    d = Dictionary("transcoder", 0, torch.eye(5, 3), torch.zeros(5), torch.ones(5, 3), torch.zeros(3), "topk", k=2)
    f = LayerFidelity(d)
    f.add(torch.tensor([[1.0, -1.0, -1.0]]), torch.zeros(1, 3))
    assert f.dead == 4 and f.fired.tolist() == [True, False, False, False, False]


def test_the_rows_read_losses_per_predicted_token():
    d = Dictionary("transcoder", 3, torch.eye(5, 3), torch.zeros(5), torch.ones(5, 3), torch.zeros(3), "topk", k=2)
    f = LayerFidelity(d)
    f.spliced, f.ablated = 5.0, 6.0
    (row,) = Fidelity({3: f}, loss_model=4.0, tokens=3, predicted=2).rows()
    assert (row["layer"], row["n_latents"], row["dead_latents"], row["eval_tokens"]) == (3, 5, 5, 0)
    assert (row["loss_original"], row["loss_spliced"], row["loss_mean_ablated"]) == (2.0, 2.5, 3.0)
    assert row["loss_recovered"] == 0.5 and math.isnan(row["fvu"])  # no token added: no variance to explain
    assert loss_recovered(2.0, 2.0, 3.0) == 1.0 and loss_recovered(2.0, 3.0, 3.0) == 0.0
    assert math.isnan(loss_recovered(2.0, 2.5, 2.0))
