"""Vocabulary classes of the values (`ffkv.experiments.vocabulary_classes`): every statistic against a brute force
in NumPy, hand-set values whose class is known (one token's direction: prediction; its opposite: suppression; a
direction in the unembedding's null space: share 1), the random directions' shares as the null, and the tables,
report section and explorer column the real pipeline writes."""

from __future__ import annotations

import html

import numpy as np
import pytest
import torch

from ffkv.experiments import vocabulary_classes as vc
from support.helpers import loaded_tiny


def _brute_units(view) -> np.ndarray:
    u = view.unembedding.detach().double().numpy()
    u = u * view.arch.final_norm(view.model).weight.detach().double().numpy()
    u = u - u.mean(axis=0)
    return u / np.linalg.norm(u, axis=1, keepdims=True)


def _brute_moments(v: np.ndarray, units: np.ndarray) -> tuple[float, float, float, float]:
    cos = units @ (v / np.linalg.norm(v))
    mean, var = cos.mean(), cos.var()
    z = (cos - mean) / np.sqrt(var)
    return mean, var, (z**3).mean(), (z**4).mean()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_statistics_match_a_brute_force(family):
    view = loaded_tiny(family).view
    result = vc.value_classes(view, seed=3, n_control=64)
    keys, layers = result["keys"], result["layers"]
    units = _brute_units(view)
    _, _, vt = np.linalg.svd(units, full_matrices=False)
    k = max(1, round(view.d_model / 100))
    basis = vt[-k:]
    assert len(keys) == view.n_layers * view.d_m and len(layers) == view.n_layers
    for layer in range(view.n_layers):
        values = view.values(layer).detach().double().numpy()
        gates = view.keys(layer).detach().double().numpy()
        rows = keys[keys.layer == layer].sort_values("key")
        expected = np.array([_brute_moments(v, units) for v in values])
        np.testing.assert_allclose(rows[["vocab_mean", "vocab_var", "vocab_skew", "vocab_kurtosis"]].to_numpy(),
                                   expected, rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(rows["value_norm"], np.linalg.norm(values, axis=1), rtol=1e-12)
        cos_kv = (gates * values).sum(1) / np.linalg.norm(gates, axis=1) / np.linalg.norm(values, axis=1)
        np.testing.assert_allclose(rows["cos_key_value"], cos_kv, rtol=1e-9, atol=1e-12)
        if view.gated:
            up = view.up(layer).detach().double().numpy()
            cos_uv = (up * values).sum(1) / np.linalg.norm(up, axis=1) / np.linalg.norm(values, axis=1)
            np.testing.assert_allclose(rows["cos_up_value"], cos_uv, rtol=1e-9, atol=1e-12)
        else:
            assert rows["cos_up_value"].isna().all()
        share = ((values @ basis.T) ** 2).sum(1) / (values**2).sum(1)
        np.testing.assert_allclose(rows["null_space_share"], share, rtol=1e-4, atol=1e-7)
        # The classes follow the stated rules from these moments and the layer's cut-off.
        cut = float(layers.loc[layers.layer == layer, "partition_variance"].iloc[0])
        _, var, skew, kurt = expected.T
        rule = np.where((kurt > 10) & (skew > 0), "prediction", np.where((kurt > 10) & (skew < 0), "suppression",
                                                                           np.where(var > cut, "partition", "none")))
        assert list(rows["class"]) == list(rule)
        row = layers[layers.layer == layer].iloc[0]
        assert row.n_keys == view.d_m and row.prediction_share == pytest.approx(float((rule == "prediction").mean()))
        assert row.null_space_share_expected == pytest.approx(k / view.d_model)


def test_hand_set_values_get_their_known_class():
    """One token's unembedding along a direction e that every other token's is orthogonal to: a value along e
    raises that token alone (prediction), along -e lowers it alone (suppression); a value in the prepared
    unembedding's null space has share 1 there, one orthogonal to it share 0."""
    view = loaded_tiny("gpt2").view
    token, e = 5, torch.zeros(view.d_model)
    e[0] = 1.0
    with torch.no_grad():
        unembedding = view.unembedding                          # tied with the input embedding: only E changes
        unembedding -= torch.outer(unembedding @ e, e)
        unembedding[token] = 5.0 * e
    units = vc.prepared_unembedding(view)
    basis = vc.null_space(units)
    with torch.no_grad():
        values = view.values(0)
        values[0] = 3.0 * e
        values[1] = -3.0 * e
        values[2] = basis[0].float()
        inside = units[7].double() - (units[7].double() @ basis.T) @ basis
        values[3] = inside.float()
    keys = vc.value_classes(view, n_control=64)["keys"]
    first = keys[keys.layer == 0].set_index("key")
    assert first.loc[0, "class"] == "prediction" and first.loc[0, "vocab_kurtosis"] > 10
    assert first.loc[1, "class"] == "suppression" and first.loc[1, "vocab_skew"] < 0
    assert first.loc[0, "vocab_kurtosis"] == pytest.approx(first.loc[1, "vocab_kurtosis"])
    assert first.loc[2, "null_space_share"] == pytest.approx(1.0, abs=1e-6)
    assert first.loc[3, "null_space_share"] == pytest.approx(0.0, abs=1e-6)


def test_random_directions_rarely_pass_and_are_seeded():
    """The null: random directions are seldom prediction or suppression memories (the cut-off is far in the tail
    of their kurtosis) and exactly 1% or fewer pass the partition cut-off set on them; the same seed, the same
    table."""
    view = loaded_tiny("gpt2").view
    a = vc.value_classes(view, seed=7, n_control=400)["layers"]
    b = vc.value_classes(view, seed=7, n_control=400)["layers"]
    assert a.equals(b)
    assert (a["prediction_share_control"] + a["suppression_share_control"] <= 0.05).all()
    assert (a["partition_share_control"] <= 0.011).all()
    other = vc.value_classes(view, seed=8, n_control=400)["layers"]
    assert not other["partition_variance"].equals(a["partition_variance"])


def test_the_pipeline_writes_its_tables_report_section_and_explorer_column(fresh_run):
    from starlette.testclient import TestClient

    from ffkv.explorer import create_app
    from ffkv.report import write_report
    from ffkv.store.run import RunDir

    run, loaded = fresh_run
    rd = RunDir(run)
    keys, layers = rd.read_metric("vocabulary_classes_keys"), rd.read_metric("vocabulary_classes")
    assert len(keys) == loaded.view.n_layers * loaded.view.d_m and set(keys["class"]) <= set(vc.CLASSES)
    assert (layers["n_control"] == vc.N_CONTROL).all()
    assert rd.figure_path("vocabulary_classes", "png").is_file()
    page = write_report(run).read_text()
    section = page[page.index('id="analysis-vocabulary_classes"'):]
    section = section[:section.index("</section>")]
    assert "Gurnee et al. 2024" in section and "prediction memories" in section
    with TestClient(create_app(run, loaded=loaded), base_url="http://127.0.0.1:8000") as client:
        r = client.get("/layer/1?sort=vocab class&order=desc")
    assert r.status_code == 200, r.text[:300]
    top = keys[keys.layer == 0].sort_values(["class", "key"], ascending=[False, True]).iloc[0]
    text = html.unescape(r.text)
    assert "vocab class" in text and f'href="/memory/1/{int(top.key)}"' in r.text
    first_row = text[text.index(f'href="/memory/1/{int(top.key)}"'):]
    assert top["class"] in first_row[:first_row.index("</tr>")]
