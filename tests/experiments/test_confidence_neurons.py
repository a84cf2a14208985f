"""Confidence-regulation and GLU classes (`ffkv.experiments.confidence_neurons`): the frozen-scale normalization,
the unigram direction and the GLU rule against brute forces; a hand-built gated layer whose GLU classes are known; and
on the real pipeline (index, analyze) a tiny GPT-2 with a planted entropy memory (a large value in the unembedding's
exact null space) and a planted token-frequency memory, classed right, their effects checked against a brute force."""

from __future__ import annotations

import contextlib

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.experiments import confidence_neurons as cn
from ffkv.experiments import vocabulary_classes as vc
from support.helpers import loaded_tiny


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_frozen_normalization_is_the_normalization_with_its_clean_scale(family):
    view = loaded_tiny(family).view
    norm = view.arch.final_norm(view.model)
    gen = torch.Generator().manual_seed(0)
    h, delta = torch.randn(5, view.d_model, generator=gen) * 3, torch.randn(5, view.d_model, generator=gen)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(view.d_model, generator=gen) + 0.5)
        y = norm(h)
    got = cn._frozen_norm(view)(h, y, delta)
    hd, dd, gamma = h.double(), delta.double(), norm.weight.detach().double()
    if family == "gpt2":
        sigma = (hd.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
        expected = gamma * (dd - dd.mean(-1, keepdim=True)) / sigma
    else:
        expected = gamma * dd / (hd.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # Linear in delta: the change of a small step is the normalization's own change less its scale's.
    assert cn._frozen_norm(view)(h, y, 2 * delta).sub(2 * got).abs().max() < 1e-9


def test_unigram_counts_and_the_frequency_direction(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "examples.parquet"
    pq.write_table(pa.table({"token_ids": pa.array([[5, 6, 6], [], [6, 9]], pa.list_(pa.int32()))}), path)
    counts = cn.unigram_counts([path], 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 3, 0, 0, 1, 0, 0]
    with pytest.raises(Exception, match="outside the model's vocabulary"):
        cn.unigram_counts([path], 8)
    view = loaded_tiny("gpt2").view
    units = vc.prepared_unembedding(view)
    counts = np.arange(view.vocab_size) % 7
    f = np.log1p(counts.astype(float))
    expected = units.double().numpy().T @ (f - f.mean())
    np.testing.assert_allclose(cn.frequency_direction(units, counts).numpy(), expected / np.linalg.norm(expected),
                               rtol=1e-6, atol=1e-9)


def test_glu_rule_on_cosines():
    tau = 0.3
    c_gate = np.array([0.5, 0.5, -0.5, -0.5, 0.1, 0.9, -0.2])
    c_in = np.array([0.5, -0.5, -0.5, 0.5, 0.8, 0.2, -0.31])
    assert list(cn.glu_classes(c_gate, c_in, tau)) == [
        "enrichment", "depletion", "conditional enrichment", "conditional depletion", "proportional change",
        "orthogonal output", "proportional change"]
    assert cn.glu_tau(64) == pytest.approx(2.576 / 8)


def test_a_hand_built_gated_layer_gets_its_glu_classes():
    """Gate, up and value rows set by hand on a tiny Llama: the classes follow from the signs of the cosines."""
    view = loaded_tiny("llama").view
    e0, e1 = torch.zeros(view.d_model), torch.zeros(view.d_model)
    e0[0], e1[1] = 1.0, 1.0
    planted = {0: (e0, e0, "enrichment"), 1: (e0, -e0, "depletion"), 2: (-e0, -e0, "conditional enrichment"),
               3: (-e0, e0, "conditional depletion"), 4: (e1, e0, "proportional change"),
               5: (e0, e1, "orthogonal output")}
    with torch.no_grad():
        for key, (gate, up, _) in planted.items():
            view.keys(1)[key] = 2 * gate
            view.up(1)[key] = 3 * up
            view.values(1)[key] = 0.5 * e0
    vocab_keys = vc.value_classes(view, n_control=32)["keys"]
    result = cn.confidence_classes(view, vocab_keys, np.ones(view.vocab_size, dtype=np.int64), n_control=32)
    keys = result["keys"].set_index(["layer", "key"])
    for key, (_, _, kind) in planted.items():
        assert keys.loc[(1, key), "glu_class"] == kind, key
    layer = result["layers"].set_index("layer").loc[1]
    assert layer["glu_tau"] == pytest.approx(2.576 / np.sqrt(view.d_model))
    shares = [layer[f"{cn._slug(k)}_share"] for k in cn.GLU_CLASSES]
    assert sum(shares) == pytest.approx(1.0)
    assert layer["enrichment_share"] == pytest.approx((keys.loc[1, "glu_class"] == "enrichment").mean())
    # A GPT-2 has no gate: no GLU class.
    view = loaded_tiny("gpt2").view
    result = cn.confidence_classes(view, vc.value_classes(view, n_control=16)["keys"],
                                   np.ones(view.vocab_size, dtype=np.int64), n_control=16)
    assert result["keys"]["glu_class"].isna().all() and "enrichment_share" not in result["layers"]


def _plant(loaded, counts: np.ndarray) -> tuple[int, int, int, int]:
    """A tiny GPT-2 with an exact null direction e of the unembedding (mean 0 over d, so the LayerNorm's centring
    keeps it): the last layer's memory 3 writes 30·e (an entropy memory, its key made to vary); layer 0's memory 7
    writes along the unigram log-frequency direction (a token-frequency memory); the last layer's memory 4 writes a
    large vector along one token (large, but not in the null space)."""
    view = loaded.view
    last = view.n_layers - 1
    e = torch.zeros(view.d_model)
    e[0], e[1] = 1 / np.sqrt(2), -1 / np.sqrt(2)
    with torch.no_grad():
        view.unembedding.sub_(torch.outer(view.unembedding @ e, e))  # tied: the input embedding loses e too
        view.values(last)[3] = 30.0 * e
        view.keys(last)[3] = 3.0 * torch.nn.functional.normalize(torch.arange(view.d_model).float() - 7.5, dim=0)
        units = vc.prepared_unembedding(view)
        view.values(0)[7] = cn.frequency_direction(units, counts).float() * view.values(0)[7].norm()
        view.values(last)[4] = 30.0 * units[11] / units[11].norm()
    return last, 3, 0, 7


def test_planted_entropy_and_token_frequency_memories_are_classed_right(tmp_path):
    from ffkv.experiments import analyze
    from ffkv.store.run import RunDir
    from support.runs import N_LINES, index_run

    run, loaded = index_run(tmp_path)
    rd = RunDir(run)
    counts = cn.unigram_counts([rd.table("examples")], loaded.view.vocab_size)
    last, entropy_key, freq_layer, freq_key = _plant(loaded, counts)
    analyze(run, only=["vocabulary_classes", cn.NAME], eval_corpus=str(tmp_path / "corpus.txt"), n_eval=N_LINES,
            progress=False, loaded=loaded)
    keys = rd.read_metric(f"{cn.NAME}_keys").set_index(["layer", "key"])
    measured = rd.read_metric(f"{cn.NAME}_measured").set_index(["layer", "key"])
    planted = keys.loc[(last, entropy_key)]
    assert planted["entropy_candidate"] and planted["class"] == "entropy"
    assert planted["total_effect"] > 1e-2 and planted["direct_effect"] < 1e-3 * planted["total_effect"]
    assert keys.loc[(last, 4), "entropy_candidate"] == False  # noqa: E712 - large, but along a token
    assert keys.loc[(freq_layer, freq_key), "class"] == "token_frequency"
    assert keys.loc[(freq_layer, freq_key), "unigram_cos"] == pytest.approx(1.0, abs=1e-5)
    assert keys.loc[(last, entropy_key), "unigram_cos"] == pytest.approx(0.0, abs=1e-5)
    assert not keys.loc[(freq_layer, freq_key), "entropy_candidate"]
    assert measured.loc[(last, entropy_key), "n_examples"] == N_LINES and measured["why"].eq("").all()
    layers = rd.read_metric(cn.NAME).set_index("layer")
    own = keys.loc[last]
    assert layers.loc[last, "entropy_share"] == pytest.approx(own["entropy"].mean())
    assert layers.loc[last, "n_measured"] == own["total_effect"].notna().sum() >= 1
    assert 0 <= layers.loc[last, "entropy_share_ci_low"] <= layers.loc[last, "entropy_share"] \
        <= layers.loc[last, "entropy_share_ci_high"]
    _check_effects_by_brute_force(loaded, tmp_path / "corpus.txt", last, entropy_key, measured)
    # The surface: the report's section and the layer page's badge.
    from starlette.testclient import TestClient

    from ffkv.explorer import create_app
    from ffkv.report import write_report

    page = write_report(run).read_text()
    section = page[page.index(f'id="analysis-{cn.NAME}"'):]
    assert "Stolfo et al. 2024" in section[:section.index("</section>")]
    with TestClient(create_app(run, loaded=loaded), base_url="http://127.0.0.1:8000") as client:
        r = client.get(f"/layer/{last + 1}?sort=confidence class&order=asc")
    assert r.status_code == 200, r.text[:300]
    row = r.text[r.text.index(f'href="/memory/{last + 1}/{entropy_key}"'):]
    assert "entropy" in row[:row.index("</tr>")]


def _check_effects_by_brute_force(loaded, corpus, layer: int, key: int, measured: pd.DataFrame) -> None:
    """TE and DE of the planted memory recomputed from the model's full forward passes and the LayerNorm's formula."""
    from ffkv.memories.interventions import Intervention, intervene

    view = loaded.view
    grab = {}

    def coefficients(ids):
        hook = view.arch.down_proj(view.blocks[layer]).register_forward_pre_hook(
            lambda mod, args: grab.__setitem__("m", args[0][0, :, key].clone()))
        try:
            return loaded.model(ids).logits[0], grab["m"]
        finally:
            hook.remove()

    _effects_by_brute_force(loaded, corpus, layer, view.values(layer)[key], coefficients,
                            lambda mean: intervene(view, [Intervention(layer, key, "set", mean)]),
                            measured.loc[(layer, key)])


def _effects_by_brute_force(loaded, corpus, layer: int, value: torch.Tensor, coefficients, ablated_to,
                            row: pd.Series) -> None:
    """TE and DE of mean-ablating one memory, from the model's full forward passes, one held-out example at a time:
    `coefficients(ids)` gives (logits, the memory's coefficient at each position), `ablated_to(mean)` a context in
    which the memory's coefficient is `mean` everywhere; DE through the final LayerNorm's formula, its scale frozen."""
    from ffkv.corpus import CorpusSpec
    from ffkv.experiments.common import select_held_out
    from support.runs import N_LINES

    spec = CorpusSpec(source=str(corpus), unit="line", split="all", max_examples=N_LINES, shuffle_seed=0)
    held = select_held_out(loaded, spec, 0)
    model, view = loaded.model, loaded.view
    found = [coefficients(torch.tensor([e.token_ids])) for e in held.examples]
    rows = np.arange(len(held.examples))
    m = torch.stack([found[i][1][j] for i, j in zip(rows, held.positions)]).double()
    mean = float(m.mean())
    targets = torch.as_tensor(held.targets)
    clean = torch.stack([found[i][0][j] for i, j in zip(rows, held.positions)]).double()
    loss = torch.nn.functional.cross_entropy(clean, targets, reduction="none")
    with ablated_to(mean):
        ablated = torch.stack([model(torch.tensor([e.token_ids])).logits[0, j]
                               for e, j in zip(held.examples, held.positions)]).double()
    te = (torch.nn.functional.cross_entropy(ablated, targets, reduction="none") - loss).abs().mean()
    ln = view.arch.final_norm(view.model)
    h_pre = []
    hook = ln.register_forward_pre_hook(lambda mod, args: h_pre.append(args[0][0].clone()))
    try:
        for e in held.examples:
            model(torch.tensor([e.token_ids]))
    finally:
        hook.remove()
    h = torch.stack([h_pre[i][j] for i, j in zip(rows, held.positions)]).double()
    sigma = (h.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
    delta = (mean - m)[:, None] * value.double()
    shift = ln.weight.double() * (delta - delta.mean(-1, keepdim=True)) / sigma @ view.unembedding.double().T
    de = (torch.nn.functional.cross_entropy(clean + shift, targets, reduction="none") - loss).abs().mean()
    assert row["mean_coefficient"] == pytest.approx(mean, rel=1e-5)
    assert row["total_effect"] == pytest.approx(float(te), rel=1e-4, abs=1e-7)
    assert row["direct_effect"] == pytest.approx(float(de), rel=1e-4, abs=1e-7)


def test_planted_entropy_and_token_frequency_latents_are_classed_right_beside_the_neurons(tmp_path):
    """A hand-built transcoder at the last layer of the tiny GPT-2 whose latent 3 writes 30·e (e an exact null
    direction of the unembedding), latent 7 the unigram log-frequency direction and latents 8-13 small multiples of it,
    latent 4 a large vector along one token: 3 is an entropy latent whose effects match a brute-force hook on the FF
    output (the mean ablation of a_3, the dictionary's error term kept), 7-13 token-frequency latents; the neurons'
    tables are the same as without the dictionary; the latents stand beside the layer's neurons, each kind against
    random mixtures of its own values."""
    from ffkv.corpus import CorpusSpec
    from ffkv.dictionaries import Dictionary
    from ffkv.dictionaries.npz_layout import save_npz
    from ffkv.experiments import analyze
    from ffkv.indexing.indexer import IndexOptions, build_index
    from ffkv.store.run import RunDir
    from support.runs import N_LINES, index_run

    first, loaded = index_run(tmp_path / "plain")
    counts = cn.unigram_counts([RunDir(first).table("examples")], loaded.view.vocab_size)
    view = loaded.view
    last = view.n_layers - 1
    e = torch.zeros(view.d_model)
    e[0], e[1] = 1 / np.sqrt(2), -1 / np.sqrt(2)
    n = 24
    g = torch.Generator().manual_seed(5)
    encoder, decoder = torch.randn(n, view.d_model, generator=g), torch.randn(n, view.d_model, generator=g)
    with torch.no_grad():
        view.unembedding.sub_(torch.outer(view.unembedding @ e, e))
        units = vc.prepared_unembedding(view)
        frequency = cn.frequency_direction(units, counts).float()
    decoder[3] = 30.0 * e
    encoder[3] = 3.0 * torch.nn.functional.normalize(torch.arange(view.d_model).float() - 7.5, dim=0)
    decoder[4] = 30.0 * units[11] / units[11].norm()
    for j in range(7, 14):
        decoder[j] = frequency * (1.0 + 0.1 * j)
    d = Dictionary(kind="transcoder", layer=last, encoder=encoder, encoder_bias=torch.zeros(n), decoder=decoder,
                   decoder_bias=torch.zeros(view.d_model), activation="relu")
    run = tmp_path / "run"
    corpus = tmp_path / "plain" / "corpus.txt"
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), run, IndexOptions(top_k=5, control_keys=16),
                progress=False, dictionary=save_npz(d, tmp_path / "planted.npz"))
    analyze(run, only=["vocabulary_classes", cn.NAME], eval_corpus=str(corpus), n_eval=N_LINES, progress=False,
            loaded=loaded)
    analyze(first, only=["vocabulary_classes", cn.NAME], eval_corpus=str(corpus), n_eval=N_LINES, progress=False,
            loaded=loaded)
    rd = RunDir(run)
    for table in (cn.NAME, f"{cn.NAME}_keys", f"{cn.NAME}_measured"):  # the neurons' tables: no latent changes them
        pd.testing.assert_frame_equal(rd.read_metric(table), RunDir(first).read_metric(table), check_exact=True)
    keys = rd.read_metric(f"{cn.LATENTS}_keys").set_index("key")
    assert list(keys["layer"].unique()) == [last] and len(keys) == n
    assert keys.loc[3, "entropy_candidate"] and keys.loc[3, "class"] == "entropy"
    assert not keys.loc[4, "entropy_candidate"]  # large, but along a token
    assert set(keys.index[keys["class"] == "token_frequency"]) == set(range(7, 14))
    assert keys.loc[3, "total_effect"] > 1e-2 and keys.loc[3, "direct_effect"] < 1e-3 * keys.loc[3, "total_effect"]

    def latent(ids):
        grab = {}
        mlp = view.blocks[last].mlp
        hook = mlp.register_forward_hook(lambda mod, args, out: grab.__setitem__("x", args[0][0].clone()))
        try:
            logits = loaded.model(ids).logits[0]
        finally:
            hook.remove()
        return logits, torch.relu(grab["x"] @ encoder[3] + 0.0)

    @contextlib.contextmanager
    def ablated_to(mean):
        """a_3 set to `mean`: the FF output moves by (mean - a_3)·d_3, the rest (the error term) untouched."""
        hook = view.blocks[last].mlp.register_forward_hook(
            lambda mod, args, out: out + (mean - torch.relu(args[0] @ encoder[3]))[..., None] * decoder[3])
        try:
            yield
        finally:
            hook.remove()

    row = rd.read_metric(cn.LATENTS).iloc[0]
    assert row["layer"] == last and row["n_latents"] == n and row["n_measured_latents"] >= 1
    assert row["token_frequency_share_latents"] == pytest.approx(7 / n)
    neuron_keys = rd.read_metric(f"{cn.NAME}_keys")
    assert row["token_frequency_share_neurons"] == pytest.approx(
        neuron_keys.loc[neuron_keys["layer"] == last, "moves_unigram"].mean())
    excess = (row["token_frequency_share_latents"] - row["token_frequency_share_latents_control"]) - (
        row["token_frequency_share_neurons"] - row["token_frequency_share_neurons_control"])
    assert row["excess_token_frequency_share_latents_minus_neurons"] == pytest.approx(excess)
    assert row["entropy_share"] == pytest.approx(keys["entropy"].mean())
    measured = rd.read_metric(f"{cn.LATENTS}_measured").set_index(["layer", "key"])
    _effects_by_brute_force(loaded, corpus, last, decoder[3], latent, ablated_to, measured.loc[(last, 3)])


def test_a_model_without_a_gate_shows_no_glu_column(fresh_run):
    """The real pipeline's tiny GPT-2 (every experiment): the confidence class is on the layer page, the GLU class,
    empty for a model without a gate, is not."""
    from starlette.testclient import TestClient

    from ffkv.explorer import create_app

    run, loaded = fresh_run
    with TestClient(create_app(run, loaded=loaded), base_url="http://127.0.0.1:8000") as client:
        page = client.get("/layer/1").text
    assert "confidence class" in page and "GLU class" not in page
