"""Fitted per-layer translators: known answers on hand-built streams, KL against brute force, the projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ffkv.errors import FfkvError
from ffkv.memories.projection import logits as project
from ffkv.memories.translators import Translators, fit_translators, kl_rows, mean_interval
from ffkv.memories.view import MemoryView
from support.tiny_models import tiny_model


def _hand_built(n: int = 512, d: int = 6, vocab: int = 40, layers: int = 2, seed: int = 0):
    """Final vectors h*, an unembedding E, and per layer a residual h_l with h* = M_l h_l + c_l (known answer)."""
    g = torch.Generator().manual_seed(seed)
    h_final = torch.randn(n, d, generator=g)
    E = torch.randn(vocab, d, generator=g)
    M = torch.eye(d) + 0.2 * torch.randn(layers, d, d, generator=g)
    c = 0.5 * torch.randn(layers, d, generator=g)
    resid = torch.stack([torch.linalg.solve(M[l], (h_final - c[l]).T).T for l in range(layers)])
    return h_final, E, M, c, resid


def _stream(resid, final_logits, batch: int):
    def stream():
        for start in range(0, resid.shape[1], batch):
            part = slice(start, start + batch)
            z = final_logits[part]
            yield resid[:, part], (lambda s, z=z: z[s])
    return stream


def test_fit_recovers_a_known_linear_translator():
    h_final, E, M, c, resid = _hand_built()
    final = h_final @ E.T
    before = np.array([float(kl_rows(final, resid[l] @ E.T).mean()) for l in range(2)])
    fitted = fit_translators(_stream(resid, final, 128), lambda x: x @ E.T, n_layers=2, d_model=6, chunk=50,
                             epochs=400, lr=0.02)
    for layer in range(2):
        after = float(kl_rows(final, fitted.apply(layer, resid[layer]) @ E.T).mean())
        assert before[layer] > 0.3 and after < 1e-3, (before, after)
        # The optimum is unique (E has full column rank and the ones vector is outside its span): recovered.
        assert torch.allclose(fitted.weight[layer], M[layer], atol=0.05)
        assert torch.allclose(fitted.bias[layer], c[layer], atol=0.05)
    assert fitted.info["n_positions"] == 512 and fitted.info["steps"] == 400 * 4


def test_fit_through_a_normalization_drives_kl_to_zero():
    h_final, E, M, c, resid = _hand_built(seed=1)
    norm = torch.nn.LayerNorm(6, elementwise_affine=False)
    final = norm(h_final) @ E.T
    fitted = fit_translators(_stream(resid, final, 256), lambda x: norm(x) @ E.T, 2, 6, chunk=64, epochs=300,
                             lr=0.02)
    for layer in range(2):
        start = float(kl_rows(final, norm(resid[layer]) @ E.T).mean())
        after = float(kl_rows(final, norm(fitted.apply(layer, resid[layer])) @ E.T).mean())
        assert after < 0.01 * start and after < 5e-3


def test_kl_rows_against_brute_force():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 11, generator=g) * 3, torch.randn(7, 11, generator=g) * 3
    an, bn = a.double().numpy(), b.double().numpy()
    for i in range(7):
        p = np.exp(an[i]) / np.exp(an[i]).sum()
        q = np.exp(bn[i]) / np.exp(bn[i]).sum()
        assert float(kl_rows(a, b)[i]) == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-4, abs=1e-6)
    assert torch.allclose(kl_rows(a, a), torch.zeros(7), atol=1e-6)


def test_chunking_does_not_change_the_fit():
    h_final, E, M, c, resid = _hand_built(n=64)
    final = h_final @ E.T
    one = fit_translators(_stream(resid, final, 64), lambda x: x @ E.T, 2, 6, chunk=64, epochs=3, lr=0.01)
    many = fit_translators(_stream(resid, final, 64), lambda x: x @ E.T, 2, 6, chunk=5, epochs=3, lr=0.01)
    assert torch.allclose(one.weight, many.weight, atol=1e-5) and torch.allclose(one.bias, many.bias, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_identity_translator_is_the_final_norm_projection(family):
    view = MemoryView(tiny_model(family))
    h = torch.randn(5, view.d_model)
    with pytest.raises(FfkvError, match="translator"):
        project(view, h, "translator", layer=0)
    view.translators = Translators.identity(view.n_layers, view.d_model)
    for layer in range(view.n_layers):
        assert torch.equal(project(view, h, "translator", layer=layer), project(view, h, "final-norm"))
        assert torch.equal(project(view, h, "translator", layer=layer, update=True), project(view, h, "final-norm"))


def test_translator_projection_applies_a_and_b_then_the_norm():
    view = MemoryView(tiny_model("gpt2"))
    d = view.d_model
    g = torch.Generator().manual_seed(0)
    t = Translators(torch.randn(view.n_layers, d, d, generator=g), torch.randn(view.n_layers, d, generator=g))
    view.translators = t
    h = torch.randn(4, d, generator=g)
    ln = view.model.transformer.ln_f
    E = view.unembedding
    expected = ln(h @ t.weight[1].T + t.bias[1]) @ E.T
    assert torch.allclose(project(view, h, "translator", layer=1), expected, atol=1e-5)
    assert torch.allclose(project(view, h, "translator", layer=1, update=True), ln(h @ t.weight[1].T) @ E.T, atol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    t = Translators(torch.randn(3, 4, 4), torch.randn(3, 4), {"n_positions": 9})
    path = t.save(tmp_path / "translators" / "t.npz")
    back = Translators.load(path)
    assert torch.equal(back.weight, t.weight) and torch.equal(back.bias, t.bias) and back.info == {"n_positions": 9}


def test_mean_interval():
    m, lo, hi = mean_interval([1.0, 2.0, 3.0, 4.0])
    half = 1.96 * np.std([1, 2, 3, 4], ddof=1) / 2
    assert m == 2.5 and lo == pytest.approx(2.5 - half) and hi == pytest.approx(2.5 + half)
