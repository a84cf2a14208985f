"""`Dictionary`'s verbs against answers known by construction and against brute force written here."""

from __future__ import annotations

import pytest
import torch

from ffkv.dictionaries import Dictionary, check_against
from ffkv.errors import FfkvError

D_MODEL = 4


def token_detectors(activation: str = "relu", **extra) -> Dictionary:
    """A transcoder whose latent t fires only on token t's embedding e_t (key e_t, bias -0.5: pre = 0.5 there,
    -0.5 on any other token) and writes the value v_t = (t+1)·e_{(t+1) mod 4}; latent 4 is dead (its key
    -Σe_t with bias -1 is negative on every one-hot input)."""
    eye = torch.eye(D_MODEL)
    encoder = torch.cat([eye, -torch.ones(1, D_MODEL)])
    encoder_bias = torch.tensor([-0.5] * D_MODEL + [-1.0])
    decoder = torch.stack([(t + 1) * eye[(t + 1) % D_MODEL] for t in range(D_MODEL)] + [torch.full((D_MODEL,), 9.0)])
    return Dictionary("transcoder", 2, encoder, encoder_bias, decoder, torch.tensor([0.0, 0.0, 0.0, 0.25]),
                      activation, **extra)


def test_token_detectors_fire_on_their_token_alone_and_write_their_value():
    d = token_detectors()
    tokens = torch.tensor([[0, 3, 1], [2, 2, 0]])
    x = torch.eye(D_MODEL)[tokens]                                   # (2, 3, d_model)
    acts = d.encode(x)
    assert acts.shape == (2, 3, 5)
    expected = torch.zeros(2, 3, 5)
    for b in range(2):
        for p in range(3):
            expected[b, p, tokens[b, p]] = 0.5
    assert torch.equal(acts, expected)
    assert not acts[..., 4].any()                                      # the dead latent never fires
    out = d(x)
    for b in range(2):
        for p in range(3):
            t = int(tokens[b, p])
            want = torch.zeros(D_MODEL)
            want[(t + 1) % D_MODEL] = 0.5 * (t + 1)
            want[3] += 0.25
            assert torch.equal(out[b, p], want)


def brute(d: Dictionary, x: torch.Tensor) -> tuple[list[list[float]], list[list[float]]]:
    """Activations and reconstruction of each row of x (n, d_model), latent by latent, in Python floats."""
    acts, outs = [], []
    for row in x.tolist():
        shifted = [v - (float(d.input_bias[j]) if d.input_bias is not None else 0.0) for j, v in enumerate(row)]
        pre = [sum(a * b for a, b in zip(shifted, d.encoder[i].tolist())) + float(d.encoder_bias[i])
               for i in range(d.n_latents)]
        if d.activation == "relu":
            a = [max(p, 0.0) for p in pre]
        elif d.activation == "jumprelu":
            a = [p if p > float(d.threshold[i]) and p > 0 else 0.0 for i, p in enumerate(pre)]
        else:
            keep = sorted(range(len(pre)), key=lambda i: -pre[i])[: d.k]
            a = [max(pre[i], 0.0) if i in keep else 0.0 for i in range(len(pre))]
        out = [sum(a[i] * float(d.decoder[i, j]) for i in range(d.n_latents)) + float(d.decoder_bias[j])
               for j in range(d.d_model)]
        if d.skip is not None:
            out = [o + sum(row[m] * float(d.skip[j, m]) for m in range(d.d_model)) for j, o in enumerate(out)]
        acts.append(a)
        outs.append(out)
    return acts, outs


def random_dictionary(activation: str, *, kind: str = "transcoder", skip: bool = False, input_bias: bool = False,
                      seed: int = 0) -> Dictionary:
    g = torch.Generator().manual_seed(seed)
    n, dm = 12, 5
    extra = {"k": 3} if activation == "topk" else {}
    if activation == "jumprelu":
        extra["threshold"] = torch.rand(n, generator=g, dtype=torch.float64)
    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    return Dictionary(kind, 1, draw(n, dm), draw(n), draw(n, dm), draw(dm), activation,
                      skip=draw(dm, dm) if skip else None, input_bias=draw(dm) if input_bias else None, **extra)


@pytest.mark.parametrize("activation, kind, skip, input_bias", [
    ("relu", "transcoder", False, False), ("jumprelu", "transcoder", True, False), ("topk", "transcoder", True, False),
    ("topk", "sae", False, True), ("relu", "sae", False, True), ("jumprelu", "sae", False, False)])
def test_encode_and_reconstruction_equal_brute_force(activation, kind, skip, input_bias):
    d = random_dictionary(activation, kind=kind, skip=skip, input_bias=input_bias)
    x = torch.randn(20, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    acts, outs = brute(d, x)
    assert torch.allclose(d.encode(x), torch.tensor(acts, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(d(x), torch.tensor(outs, dtype=torch.float64), atol=1e-12)
    if activation == "topk":
        assert int((d.encode(x) != 0).sum(-1).max()) <= d.k


@pytest.mark.parametrize("activation", ["topk", "relu", "jumprelu"])
def test_the_sparse_path_equals_the_dense_one(activation):
    d = random_dictionary(activation, skip=True)
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    k = d.k if activation == "topk" else d.n_latents
    values, indices = d.encode_sparse(x, k=k)
    assert values.shape == indices.shape == (3, 4, k)
    dense = torch.zeros(3, 4, d.n_latents, dtype=torch.float64).scatter_(-1, indices, values)
    assert torch.equal(dense, d.encode(x))
    assert torch.allclose(d.decode_sparse(values, indices, x), d(x), atol=1e-12)


def test_refusals_of_the_verbs():
    d = random_dictionary("relu", skip=True)
    with pytest.raises(FfkvError, match="no fixed k"):
        d.encode_sparse(torch.zeros(5, dtype=torch.float64))
    with pytest.raises(FfkvError, match="x=x"):
        d.decode(torch.zeros(12, dtype=torch.float64))


@pytest.mark.parametrize("change, message", [
    ({"kind": "crosscoder"}, "kind"),
    ({"activation": "gelu"}, "activation"),
    ({"decoder": torch.zeros(12, 6)}, "decoder has shape"),
    ({"encoder_bias": torch.zeros(11)}, "encoder_bias has shape"),
    ({"activation": "topk", "k": 13}, "k in 1..n_latents"),
    ({"activation": "jumprelu"}, "threshold"),
    ({"kind": "sae", "skip": torch.zeros(5, 5)}, "skip"),
    ({"layer": -1}, "layer"),
])
def test_a_malformed_dictionary_is_refused_at_construction(change, message):
    g = torch.Generator().manual_seed(0)
    fields = {"kind": "transcoder", "layer": 0, "encoder": torch.randn(12, 5, generator=g),
              "encoder_bias": torch.zeros(12), "decoder": torch.zeros(12, 5), "decoder_bias": torch.zeros(5),
              "activation": "relu", **change}
    with pytest.raises(FfkvError, match=message):
        Dictionary(**fields)


def test_check_against_a_model():
    d = token_detectors()                                               # layer 2, d_model 4
    check_against(d, n_layers=3, d_model=4)
    check_against({2: d}, n_layers=3, d_model=4)
    with pytest.raises(FfkvError, match="the model has 2 layers"):
        check_against({2: d}, n_layers=2, d_model=4)
    with pytest.raises(FfkvError, match="d_model is 8"):
        check_against(d, n_layers=3, d_model=8)
    with pytest.raises(FfkvError, match="filed under layer 1"):
        check_against({1: d}, n_layers=3, d_model=4)


def test_to_moves_every_tensor():
    d = random_dictionary("jumprelu", skip=True).to(dtype=torch.float32)
    tensors = (d.encoder, d.encoder_bias, d.decoder, d.decoder_bias, d.threshold, d.skip)
    assert {t.dtype for t in tensors} == {torch.float32}
