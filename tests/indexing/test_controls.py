"""The random-key control of the index (`ffkv.memories.controls`, SPEC section 3 Controls): drawn as stated,
reduced exactly like the model's own keys in the same pass, kept through resume and shards."""

from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.memories import controls
from ffkv.memories.controls import RandomKeys
from support.helpers import loaded_tiny
from indexing.test_exactness import write_corpus

FAMILIES = ("gpt2", "llama", "opt", "bert")


def _index(loaded, tmp_path, name, **options):
    spec = CorpusSpec(source=str(tmp_path / "corpus.txt"), unit="line")
    return build_index(loaded, spec, tmp_path / name, IndexOptions(top_k=4, **options),
                       BatchOptions(batch_size=5, window_batches=2), progress=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_control_made_of_the_models_own_keys_is_its_trigger_table(tmp_path, family, monkeypatch):
    """Wiring and function, against the model itself: a 'control' whose memories are the layer's own keys (same
    rows, biases, up rows) must give, through the FF input, exactly the trigger table the model's coefficients give."""
    write_corpus(tmp_path / "corpus.txt", n=17)
    loaded = loaded_tiny(family, bos=(family == "llama"), eos=(family == "bert"))
    view = loaded.view

    def own_keys(self, layer):
        def rows(t):
            return None if t is None else t.detach().clone()
        return controls.ControlLayer(source=torch.arange(view.d_m), keys=rows(view.keys(layer)),
                                     bias=rows(view.key_bias(layer)), up=rows(view.up(layer)),
                                     up_bias=rows(view.up_bias(layer)))

    monkeypatch.setattr(RandomKeys, "_draw", own_keys)
    run = _index(loaded, tmp_path, "run", control_keys=view.d_m)
    main = pq.read_table(run.table("trigger_examples")).to_pandas()
    control = pq.read_table(run.table("control_trigger_examples")).to_pandas()
    assert len(main) == view.n_layers * view.d_m * 4 * (2 if view.signed else 1)
    pd.testing.assert_frame_equal(control.drop(columns="coefficient"), main.drop(columns="coefficient"))
    torch.testing.assert_close(torch.tensor(control["coefficient"].to_numpy()),
                               torch.tensor(main["coefficient"].to_numpy()), rtol=1e-5, atol=1e-6)
    keys = pq.read_table(run.table("control_keys")).to_pandas()
    assert (keys["source_key"] == keys["key"]).all()


@pytest.mark.parametrize("family", ("gpt2", "llama"))
def test_control_memories_borrow_norms_biases_and_values_of_real_keys(family):
    loaded = loaded_tiny(family)
    view = loaded.view
    keys = RandomKeys(view, 300, seed=3)
    again, other = RandomKeys(view, 300, seed=3), RandomKeys(view, 300, seed=4)
    for layer in range(view.n_layers):
        c = keys.layers[layer]
        assert c.keys.shape == (300, view.d_model) and c.source.min() >= 0 and c.source.max() < view.d_m
        torch.testing.assert_close(c.keys.norm(dim=1), view.keys(layer)[c.source].norm(dim=1))
        if view.key_bias(layer) is not None:
            torch.testing.assert_close(c.bias, view.key_bias(layer)[c.source])
        if view.up(layer) is not None:
            torch.testing.assert_close(c.up.norm(dim=1), view.up(layer)[c.source].norm(dim=1))
        # Seeded: the same draw for the same seed, another for another seed; directions unlike the real keys'.
        assert torch.equal(c.keys, again.layers[layer].keys) and torch.equal(c.source, again.layers[layer].source)
        assert not torch.equal(c.keys, other.layers[layer].keys)
        cosine = torch.nn.functional.normalize(c.keys, dim=1) @ torch.nn.functional.normalize(view.keys(layer), dim=1).T
        assert cosine.gather(1, c.source[:, None]).abs().mean() < 0.5
        # The coefficient is the layer's own function of the FF input.
        x = torch.randn(3, 5, view.d_model)
        z = x.double() @ c.keys.double().T + (0 if c.bias is None else c.bias.double())
        expected = view.activation(layer)(z)
        if c.up is not None:
            expected = expected * (x.double() @ c.up.double().T)
        torch.testing.assert_close(keys.coefficients(layer, x).double(), expected, rtol=1e-5, atol=1e-6)


def test_no_control_writes_no_control_table(tmp_path):
    write_corpus(tmp_path / "corpus.txt", n=9)
    run = _index(loaded_tiny("gpt2"), tmp_path, "run", control_keys=0)
    assert not run.table("control_trigger_examples").exists() and run.manifest().control_keys == 0
    with pytest.raises(Exception, match="no random-key control"):
        run.read_triggers(control=True)


def test_bad_control_options_are_refused(tmp_path):
    from ffkv.errors import FfkvError
    for bad in (-1, 1.5, True):
        with pytest.raises(FfkvError, match="--control-keys"):
            IndexOptions(control_keys=bad).validate()
