"""ffkv's activations and reconstructions equal the libraries' own, on folders the libraries wrote.

Each library builds a dictionary from its own random init (biases and thresholds then drawn too, so that
every term counts), saves it with its own writer, loads it with its own loader; ffkv opens the same folder,
and both run on the same random inputs. Skipped, naming the package, where the library is absent.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ffkv.dictionaries import open_dictionary, save_sparsify

TOL = 1e-5
D_IN, N_LATENTS = 32, 128


def inputs(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 9, D_IN, generator=torch.Generator().manual_seed(seed))


def dense(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(*values.shape[:-1], n, dtype=values.dtype).scatter_(-1, indices, values)


# -- EleutherAI sparsify ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sparsify():
    return pytest.importorskip("sparsify", reason="eai-sparsify is not installed (pip install eai-sparsify)")


def sparsify_coder(sparsify, transcode: bool, skip: bool):
    torch.manual_seed(0)
    coder = sparsify.SparseCoder(D_IN, sparsify.SparseCoderConfig(num_latents=N_LATENTS, k=8, transcode=transcode,
                                                                  skip_connection=skip))
    with torch.no_grad():
        coder.encoder.bias.normal_(0, 0.1)
        coder.b_dec.normal_()
        coder.W_dec.normal_(0, 0.2)
        if skip:
            coder.W_skip.normal_(0, 0.1)
    return coder


@pytest.mark.parametrize("transcode, skip", [(False, False), (True, False), (True, True)],
                         ids=["sae", "transcoder", "skip-transcoder"])
def test_sparsify_encode_and_reconstruction(tmp_path, sparsify, transcode, skip):
    coder = sparsify_coder(sparsify, transcode, skip)
    coder.save_to_disk(tmp_path / "layers.2.mlp")
    coder = sparsify.SparseCoder.load_from_disk(tmp_path / "layers.2.mlp")
    d = open_dictionary(tmp_path)[2]
    assert d.kind == ("transcoder" if transcode else "sae") and d.source["layout"] == "sparsify"
    x = inputs()
    theirs = coder.encode(x.reshape(-1, D_IN))
    mine = d.encode(x).reshape(-1, N_LATENTS)
    assert (mine - dense(theirs.top_acts, theirs.top_indices, N_LATENTS)).abs().max() <= TOL
    values, indices = d.encode_sparse(x)
    assert torch.equal(indices.reshape(-1, 8).sort(-1).values, theirs.top_indices.sort(-1).values)
    with torch.no_grad():
        out = coder(x.reshape(-1, D_IN)).sae_out
    assert (d(x).reshape(-1, D_IN) - out).abs().max() <= TOL


@pytest.mark.parametrize("transcode, skip", [(False, False), (True, True)], ids=["sae", "skip-transcoder"])
def test_sparsify_reads_what_save_sparsify_writes(tmp_path, sparsify, transcode, skip):
    sparsify_coder(sparsify, transcode, skip).save_to_disk(tmp_path / "a" / "layers.2.mlp")
    d = open_dictionary(tmp_path / "a")[2]
    save_sparsify(d, tmp_path / "b" / "layers.2.mlp")
    loaded = sparsify.SparseCoder.load_many(str(tmp_path / "b"), local=True)
    coder = loaded["layers.2.mlp"]
    assert torch.equal(coder.encoder.weight, d.encoder) and torch.equal(coder.W_dec, d.decoder)
    x = inputs(1).reshape(-1, D_IN)
    theirs = coder.encode(x)
    assert (d.encode(x) - dense(theirs.top_acts, theirs.top_indices, N_LATENTS)).abs().max() <= TOL


# -- SAELens ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sae_lens():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("sae_lens", reason="sae-lens is not installed (pip install sae-lens)")


SAELENS = [("standard", {}), ("jumprelu", {}), ("topk", {"k": 8}),
           ("topk", {"k": 8, "rescale_acts_by_decoder_norm": True}), ("transcoder", {}), ("skip_transcoder", {}),
           ("jumprelu_transcoder", {}), ("jumprelu_skip_transcoder", {})]


@pytest.mark.parametrize("architecture, extra", SAELENS,
                         ids=[a + ("-rescaled" if e.get("rescale_acts_by_decoder_norm") else "") for a, e in SAELENS])
def test_saelens_encode_and_reconstruction(tmp_path, sae_lens, architecture, extra):
    from sae_lens.registry import get_sae_class

    sae_class, config_class = get_sae_class(architecture)
    transcoder = "transcoder" in architecture
    if transcoder:
        extra = {**extra, "d_out": D_IN, "apply_b_dec_to_input": False}
    cfg = config_class(d_in=D_IN, d_sae=N_LATENTS, **extra)
    cfg.metadata.hook_name = "blocks.2.ln2.hook_normalized" if transcoder else "blocks.2.hook_mlp_out"
    if transcoder:
        cfg.metadata.hook_name_out = "blocks.2.hook_mlp_out"
    torch.manual_seed(0)
    sae = sae_class(cfg)
    with torch.no_grad():
        for name, parameter in sae.named_parameters():
            if name in ("b_enc", "b_dec", "W_skip"):
                parameter.normal_(0, 0.1)
            elif name == "threshold":
                parameter.uniform_(0, 0.5)
    sae.save_model(tmp_path / "sae")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sae = sae_lens.SAE.load_from_disk(tmp_path / "sae")
    d = open_dictionary(tmp_path / "sae")[2]
    assert d.kind == ("transcoder" if transcoder else "sae") and d.source["architecture"] == architecture
    x = inputs()
    with torch.no_grad():
        theirs, out = sae.encode(x), sae(x)
    assert (theirs != 0).any() and (theirs == 0).any()
    assert (d.encode(x) - theirs).abs().max() <= TOL
    assert (d(x) - out).abs().max() <= TOL
