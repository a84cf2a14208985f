"""`ffkv compare` (`ffkv.tools.compare`): a model and a copy whose FF memories are permuted (the same function)
recover the permutation with correlation 1; the streamed correlations and the rotation baseline equal a brute force
over every position held in memory; runs on other corpora or tokenizers are refused with one line."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.tools import compare as cmp
from ffkv.tools import matches
from support.helpers import loaded_tiny
from support.runs import corpus_lines, sharpen


def _permuted(loaded, seed: int = 1):
    """A copy of the model with each layer's memories reordered: key i of the copy is key perm[i] of the original
    (gate, up and value rows and the key bias moved together), so the model computes the same function."""
    other = copy.deepcopy(loaded)
    from ffkv.memories.view import MemoryView

    other.view = MemoryView(other.model)
    view = other.view
    perms = []
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in range(view.n_layers):
            perm = torch.randperm(view.d_m, generator=gen)
            for rows in (view.keys(layer), view.values(layer), view.up(layer), view.key_bias(layer),
                         view.up_bias(layer)):
                if rows is not None:
                    rows.copy_(rows[perm].clone())
            perms.append(perm.numpy())
    return other, perms


def _index(loaded, folder, corpus):
    spec = CorpusSpec(source=str(corpus), unit="line")
    return build_index(loaded, spec, folder, IndexOptions(top_k=3), progress=False).path


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus_lines(24)) + "\n")
    return path


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_permuted_copy_is_matched_key_for_key_with_correlation_one(tmp_path, corpus, family):
    a = sharpen(loaded_tiny(family, bos=(family == "llama")))
    b, perms = _permuted(a)
    ids = torch.tensor([[5, 9, 14, 30, 31, 60]])
    torch.testing.assert_close(b.model(ids).logits, a.model(ids).logits, rtol=1e-5, atol=1e-5)  # the same function
    run_a, run_b = _index(a, tmp_path / "a", corpus), _index(b, tmp_path / "b", corpus)
    folder = cmp.compare_runs(run_a, run_b, loaded=(a, b), progress=False)
    keys, layers = pd.read_parquet(folder / "keys.parquet"), pd.read_parquet(folder / "layers.parquet")
    assert folder == run_a / "compare" and matches.describe(folder)["examples"] == 24
    for layer, perm in enumerate(perms):
        own = keys[keys.layer == layer].sort_values("key")
        live = own["correlation"].notna().to_numpy()
        assert live.mean() > 0.9
        # key i of A is key j of B where perm[j] = i
        np.testing.assert_array_equal(own["best_match"].to_numpy()[live], np.argsort(perm)[live])
        np.testing.assert_allclose(own["correlation"].to_numpy()[live], 1.0, atol=1e-6)
        assert (own["rotation_correlation"].to_numpy()[live] < 0.999).all()
        row = layers[layers.layer == layer].iloc[0]
        assert row.n_keys == live.sum() and row.universal_share == pytest.approx((own["excess"] > 0.5).sum() / live.sum())
        assert row.universal_share_ci_low <= row.universal_share <= row.universal_share_ci_high
    # The explorer's memory page names the matched memory.
    from starlette.testclient import TestClient

    from ffkv.explorer import create_app

    key = int(np.flatnonzero(keys[keys.layer == 0].sort_values("key")["correlation"].notna())[0])
    with TestClient(create_app(run_a, loaded=a), base_url="http://127.0.0.1:8000") as client:
        page = client.get(f"/memory/1/{key}")
    assert page.status_code == 200, page.text[:300]
    line = page.text[page.text.index('id="compare-match"'):]
    line = line[:line.index("</p>")]
    assert f">1:{int(np.argsort(perms[0])[key])}</code>" in line and "correlation 1.000" in line


def test_streamed_correlations_and_the_rotation_baseline_match_a_brute_force(tmp_path, corpus):
    a, c = sharpen(loaded_tiny("gpt2", seed=0)), sharpen(loaded_tiny("gpt2", seed=5))
    rows = [(i, np.asarray(a.tokenizer.encode(line))) for i, line in enumerate(corpus_lines(24))]
    keys, layers = cmp.compare(a, c, rows, seed=3)
    for layer in range(a.view.n_layers):
        got = {}
        for side, loaded in (("a", a), ("c", c)):
            parts = []
            for _, ids in rows:
                with loaded.view.capture(("coefficients",), layers=[layer]) as cap:
                    loaded.view.forward(torch.tensor([ids]))
                parts.append(cap["coefficients"][layer][0].double().numpy())
            got[side] = np.concatenate(parts)
        d = a.view.d_m
        corr = np.corrcoef(got["a"].T, got["c"].T)[:d, d:]
        rotated = got["c"] @ cmp.random_rotation(d, 3, layer).numpy()
        corr_rot = np.corrcoef(got["a"].T, rotated.T)[:d, d:]
        own = keys[keys.layer == layer].sort_values("key")
        np.testing.assert_array_equal(own["best_match"], corr.argmax(1))
        np.testing.assert_allclose(own["correlation"], corr.max(1), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(own["rotation_correlation"], corr_rot.max(1), rtol=1e-6, atol=1e-9)
        # A difference of two correlations, each within 1e-6 of the brute force's: within 1e-6 of their sizes (an
        # excess near 0 is a cancellation: one of 2.08e-5 was seen 1.7e-9 from the brute force's).
        excess = corr.max(1) - corr_rot.max(1)
        bound = 1e-6 * (np.abs(corr.max(1)) + np.abs(corr_rot.max(1))) + 1e-9
        assert (np.abs(own["excess"].to_numpy() - excess) <= bound).all()
        assert (own["n_positions"] == len(got["a"])).all()
    # The rotation is orthogonal and seeded.
    r = cmp.random_rotation(7, 1, 2)
    torch.testing.assert_close(r.T @ r, torch.eye(7, dtype=torch.float64))
    assert torch.equal(r, cmp.random_rotation(7, 1, 2)) and not torch.equal(r, cmp.random_rotation(7, 1, 3))


def test_runs_on_other_corpora_or_tokenizers_are_refused_with_one_line(tmp_path, corpus):
    a = sharpen(loaded_tiny("gpt2"))
    other = tmp_path / "other.txt"
    other.write_text("\n".join(reversed(corpus_lines(24))) + "\n")
    run_a = _index(a, tmp_path / "a", corpus)
    run_b = _index(a, tmp_path / "b", other)
    with pytest.raises(FfkvError, match="different corpora") as error:
        cmp.compare_runs(run_a, run_b, loaded=(a, a), progress=False)
    assert "\n" not in str(error.value)
    bos = loaded_tiny("gpt2", bos=True)  # the same corpus, other token ids
    run_c = _index(bos, tmp_path / "c", corpus)
    with pytest.raises(FfkvError, match="tokenized the corpus differently"):
        cmp.compare_runs(run_a, run_c, loaded=(a, bos), progress=False)
    assert not (run_a / "compare").exists()


def test_the_command_compares_two_runs_and_refuses_other_corpora_with_one_line(tmp_path, corpus, capsys, monkeypatch):
    """`ffkv compare` on two runs of one model (tiny-gpt2, loaded from the manifests): every key matches itself with
    correlation 1, one line per layer; runs on another corpus: one error line, exit 2, nothing written."""
    from ffkv import cli
    from ffkv.models import loading
    from support import tiny_cli
    from support.cli_runs import error_line

    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    other = tmp_path / "other.txt"
    other.write_text("\n".join(reversed(corpus_lines(24))) + "\n")
    for name, text in (("a", corpus), ("b", corpus), ("c", other)):
        assert cli.main(["index", "--model", "tiny-gpt2", "--corpus", str(text), "--unit", "line",
                         "--out", str(tmp_path / name), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp"),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("layer ") == 3 and "written:" in out
    keys = pd.read_parquet(tmp_path / "cmp" / "keys.parquet")
    live = keys["correlation"].notna()
    assert (keys.loc[live, "best_match"] == keys.loc[live, "key"]).all()
    np.testing.assert_allclose(keys.loc[live, "correlation"], 1.0, atol=1e-6)
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--no-progress"]) == 2
    assert "different corpora" in error_line(capsys.readouterr().err)
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--of", "latents", "--no-progress"]) == 2
    assert "compared with itself, latents against latents" in error_line(capsys.readouterr().err)
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--of", "latents", "--against", "neurons",
                     "--no-progress"]) == 2
    assert "without a dictionary" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "a" / "compare").exists()


def test_a_damaged_comparison_is_refused_naming_its_file(tmp_path):
    """The explorer reads RUN/compare on every memory page: a damaged table is named, never a traceback."""
    from ffkv.errors import FfkvError
    from ffkv.tools.matches import match_of, read_matches

    assert read_matches(tmp_path) is None and match_of(tmp_path, 0, 0) is None  # no comparison: nothing shown
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "keys.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(FfkvError, match="keys.parquet is damaged"):
        read_matches(tmp_path)


# ---------------------------------------------------------------------------- latents
def _relu_copy(view, layer: int, perm: torch.Tensor):
    """A "transcoder" whose latent j is neuron perm[j] of a ReLU model's layer: its encoder row and bias are that
    key's, so a_j = relu(k·x + b) = m_perm[j] exactly."""
    from ffkv.dictionaries import Dictionary

    keys, bias = view.keys(layer).detach().clone(), view.key_bias(layer).detach().clone()
    return Dictionary(kind="transcoder", layer=layer, encoder=keys[perm], encoder_bias=bias[perm],
                      decoder=view.values(layer).detach().clone()[perm], decoder_bias=torch.zeros(view.d_model),
                      activation="relu")


def test_latents_that_copy_neurons_are_matched_to_them_with_correlation_one(corpus):
    """OPT's FF is ReLU: latents built from its keys, permuted, are its neurons; one pass reads both sets. Two
    dictionaries of that model, permuted differently, match each other latent for latent."""
    from ffkv.memories.sets import Latents, Neurons

    loaded = sharpen(loaded_tiny("opt"))
    view = loaded.view
    gen = torch.Generator().manual_seed(4)
    perms = {layer: torch.randperm(view.d_m, generator=gen) for layer in (0, 2)}
    latents = Latents(view, {layer: _relu_copy(view, layer, p) for layer, p in perms.items()})
    rows = [(i, np.asarray(loaded.tokenizer.encode(line))) for i, line in enumerate(corpus_lines(24))]
    keys, layers = cmp.compare_sets((loaded, latents), (loaded, Neurons(view)), rows, seed=1)
    assert sorted(layers.layer) == [0, 2]  # the layers both sets have
    for layer, perm in perms.items():
        own = keys[keys.layer == layer].sort_values("key")
        live = own["correlation"].notna().to_numpy()
        assert live.mean() > 0.5
        np.testing.assert_array_equal(own["best_match"].to_numpy()[live], perm.numpy()[live])
        np.testing.assert_allclose(own["correlation"].to_numpy()[live], 1.0, atol=1e-6)
        assert list(own["address"].head(2)) == [f"t{layer + 1}:0", f"t{layer + 1}:1"]
        assert own["match_address"].iloc[int(np.flatnonzero(live)[0])] == f"{layer + 1}:{int(perm[np.flatnonzero(live)[0]])}"
    other = {layer: torch.randperm(view.d_m, generator=gen) for layer in (0, 2)}
    twin = Latents(view, {layer: _relu_copy(view, layer, p) for layer, p in other.items()})
    keys, _ = cmp.compare_sets((loaded, latents), (loaded, twin), rows, seed=1)
    for layer in perms:
        own = keys[keys.layer == layer].sort_values("key")
        live = own["correlation"].notna().to_numpy()
        want = torch.argsort(other[layer])[perms[layer]].numpy()  # twin latent t with other[t] = perms[j]
        np.testing.assert_array_equal(own["best_match"].to_numpy()[live], want[live])


def test_latent_correlations_match_a_brute_force(corpus):
    """An SAE's latents (reading the FF output) against another model's neurons: the streamed correlations and the
    rotation baseline equal np.corrcoef over every position, the activations recomputed here from FF(x)."""
    from ffkv.dictionaries import Dictionary
    from ffkv.memories.sets import Latents, Neurons

    a, c = sharpen(loaded_tiny("gpt2", seed=0)), sharpen(loaded_tiny("gpt2", seed=5))
    g = torch.Generator().manual_seed(2)
    d, n, layer = a.view.d_model, 12, 1
    sae = Dictionary(kind="sae", layer=layer, encoder=torch.randn(n, d, generator=g), encoder_bias=torch.zeros(n),
                     decoder=torch.randn(n, d, generator=g), decoder_bias=torch.zeros(d), activation="relu",
                     input_bias=torch.randn(d, generator=g) / 10)
    rows = [(i, np.asarray(a.tokenizer.encode(line))) for i, line in enumerate(corpus_lines(24))]
    keys, _ = cmp.compare_sets((a, Latents(a.view, {layer: sae})), (c, Neurons(c.view)), rows, seed=3)
    got = {"a": [], "c": []}
    for _, ids in rows:
        with a.view.capture(("ff_out",), layers=[layer]) as cap:
            a.view.forward(torch.tensor([ids]))
        x = cap["ff_out"][layer][0].double()
        got["a"].append(torch.relu((x - sae.input_bias.double()) @ sae.encoder.double().T).numpy())
        with c.view.capture(("coefficients",), layers=[layer]) as cap:
            c.view.forward(torch.tensor([ids]))
        got["c"].append(cap["coefficients"][layer][0].double().numpy())
    A, C = np.concatenate(got["a"]), np.concatenate(got["c"])
    corr = np.corrcoef(A.T, C.T)[:n, n:]
    corr_rot = np.corrcoef(A.T, (C @ cmp.random_rotation(C.shape[1], 3, layer).numpy()).T)[:n, n:]
    live = np.isfinite(corr).all(1)
    own = keys.sort_values("key")
    assert live.sum() >= 6 and (own["layer"] == layer).all()
    np.testing.assert_array_equal(own["best_match"].to_numpy()[live], corr.argmax(1)[live])
    np.testing.assert_allclose(own["correlation"].to_numpy()[live], corr.max(1)[live], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(own["rotation_correlation"].to_numpy()[live], corr_rot.max(1)[live], rtol=1e-5,
                               atol=1e-7)


def test_compare_runs_reads_a_runs_latents_against_its_neurons(tmp_path, corpus):
    """One run indexed with a dictionary: its latents against its own neurons (one model, one pass), written to
    RUN/compare_latents_neurons; the same kind against itself, an unknown kind, or a run without a dictionary are
    refused with one line."""
    from ffkv.dictionaries import save_npz

    loaded = sharpen(loaded_tiny("opt"))
    perm = torch.randperm(loaded.view.d_m, generator=torch.Generator().manual_seed(0))
    path = save_npz(_relu_copy(loaded.view, 1, perm), tmp_path / "copy.npz")
    spec = CorpusSpec(source=str(corpus), unit="line")
    run = build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=3), progress=False, dictionary=path).path
    folder = cmp.compare_runs(run, run, loaded=(loaded, loaded), of="latents", against="neurons", progress=False)
    assert folder == run / "compare_latents_neurons" and not (run / "compare").exists()
    keys = pd.read_parquet(folder / "keys.parquet")
    live = keys["correlation"].notna()
    assert (keys.layer == 1).all() and live.mean() > 0.5
    np.testing.assert_array_equal(keys.loc[live, "best_match"], perm.numpy()[keys.loc[live, "key"]])
    assert matches.describe(folder)["of"] == "latents" and matches.describe(folder)["against"] == "neurons"
    for kwargs, message in (({"of": "latents"}, "with itself"), ({"of": "keys"}, "neurons or latents")):
        with pytest.raises(FfkvError, match=message):
            cmp.compare_runs(run, run, loaded=(loaded, loaded), progress=False, **kwargs)
    plain = _index(loaded, tmp_path / "plain", corpus)
    with pytest.raises(FfkvError, match="without a dictionary"):
        cmp.compare_runs(plain, run, loaded=(loaded, loaded), of="latents", against="neurons", progress=False)
