"""Values as distributions (SPEC 6): hand-set value rows and a brute-force softmax."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from support.experiment_runs import make_run
from ffkv.experiments import analyze
from ffkv.memories.projection import scan_values
from ffkv.store.run import RunDir
from support.helpers import loaded_tiny


def test_scan_equals_full_softmax_across_chunk_edges():
    loaded = loaded_tiny("opt")
    view = loaded.view
    rng = np.random.default_rng(0)
    targets = rng.integers(-1, view.vocab_size, size=view.d_m)
    got = scan_values(view, 1, "identity", targets, chunk=7, top=5)
    # Brute force, in float64 numpy, every key at once.
    z = view.values(1).double().numpy() @ view.unembedding.double().numpy().T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_array_equal(got["top_token_id"], z.argmax(1))
    np.testing.assert_allclose(got["top_prob"], p.max(1), rtol=1e-4)
    np.testing.assert_allclose(got["entropy"], -(p * np.log(p)).sum(1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["top_probs"], -np.sort(-p, axis=1)[:, :5], rtol=1e-4)
    for i, t in enumerate(targets):
        if t < 0:
            assert got["target_rank"][i] == -1 and np.isnan(got["target_prob"][i])
        else:
            assert got["target_rank"][i] == 1 + (z[i] > z[i, t]).sum()
            assert got["target_prob"][i] == pytest.approx(p[i, t], rel=1e-4)


@pytest.mark.parametrize("sign", [1, -1])
def test_scan_in_chunks_equals_its_chunks_scanned_alone_byte_for_byte(sign):
    # each chunk's results are written into arrays allocated once (`scan_values`): the bytes and dtypes of each
    # chunk scanned on its own, one after another, with a last chunk shorter than the others and repeated keys
    loaded = loaded_tiny("llama")
    view = loaded.view
    rng = np.random.default_rng(1)
    keys = rng.integers(0, view.d_m, size=view.d_m + 5)
    targets = rng.integers(-1, view.vocab_size, size=len(keys))
    for chunk in (1, 7, len(keys) - 1, len(keys)):
        got = scan_values(view, 0, "final-norm", targets, chunk=chunk, top=6, sign=sign, keys=keys)
        alone = [scan_values(view, 0, "final-norm", targets[s:s + chunk], chunk=chunk, top=6, sign=sign,
                             keys=keys[s:s + chunk]) for s in range(0, len(keys), chunk)]
        assert list(got) == list(alone[0])
        for name, array in got.items():
            expected = np.concatenate([a[name] for a in alone])
            assert array.dtype == expected.dtype and array.shape == expected.shape, name
            assert array.tobytes() == expected.tobytes(), (chunk, name)


def test_value_set_to_token_embedding_is_its_argmax(tmp_path):
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    with torch.no_grad():  # unit-norm embeddings: E[t]·E[t] = 1 > E[t]·E[s] for every s != t
        E = view.unembedding
        E.copy_(E / E.norm(dim=1, keepdim=True))
    run, loaded = make_run(tmp_path, loaded=loaded)
    trig = pd.read_parquet(run / "trigger_examples.parquet", filters=[("direction", "=", 1)])
    top1 = trig[trig["rank"] == 0].set_index(["layer", "key"])["next_token_id"]
    last = view.n_layers - 1
    with torch.no_grad():  # the top layer's values never change any coefficient the index recorded
        V = view.values(last)
        for key in range(view.d_m):
            t = int(top1[(last, key)])
            V[key] = 5 * E[t] if t >= 0 else E[0]
        V0 = view.values(0)
        for key in range(view.d_m):
            t = int(top1[(0, key)])
            V0[key] = -E[t] if t >= 0 else E[0]
    analyze(run, only="values", loaded=loaded, progress=False)
    per_layer = pd.read_parquet(run / "metrics" / "values.parquet")
    keys = pd.read_parquet(run / "metrics" / "values_keys.parquet")
    has = (top1.loc[last] >= 0).to_numpy()
    assert has.sum() > 0
    assert per_layer.loc[last, "agreement_rate"] == 1.0
    assert per_layer.loc[last, "n_keys_with_target"] == has.sum()
    top = keys[keys["layer"] == last]
    assert (top.loc[top["trigger_target_id"] >= 0, "target_rank"] == 1).all()
    bottom = keys[(keys["layer"] == 0) & (keys["trigger_target_id"] >= 0)]
    assert per_layer.loc[0, "agreement_rate"] == 0.0
    assert (bottom["target_rank"] == view.vocab_size).all()  # -E[t] puts t last
    assert per_layer["chance_rate"].iloc[0] == pytest.approx(1 / view.vocab_size)
    # Table 2: the most confident values, every top-layer key agrees with its top-1 trigger.
    confident = pd.read_parquet(run / "metrics" / "values_confident.parquet")
    assert len(confident) == min(100, view.n_layers * view.d_m)
    assert confident["top_prob"].is_monotonic_decreasing
    for r in confident.itertuples():
        nxt = trig[(trig.layer == r.layer) & (trig.key == r.key)]["next_token_id"].to_numpy()
        assert r.any_trigger_agrees == bool((nxt == r.top_token_id).any())
    assert RunDir(run).metric_description("values")["projection"] == "identity"
    for name in ("values", "values_rank"):
        assert (run / "figures" / f"{name}.png").stat().st_size > 0
        assert (run / "figures" / f"{name}.svg").stat().st_size > 0
