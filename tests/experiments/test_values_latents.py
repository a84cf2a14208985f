"""Figures 4-5 for a dictionary's latents beside the neurons (`ffkv.experiments.values.latent_tables`): on a
transcoder of token detectors whose values write the next token of each detector's top trigger, every latent with
a target agrees; the table equals a brute force over the latent table and the decoder rows; a transcoder of random
values does not agree more than its chance."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.dictionaries import save_sparsify
from ffkv.experiments import analyze
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.memories.projection import logits
from indexing.test_exactness import write_corpus
from indexing.test_latents import DETECTOR_LAYER, _spec, brute_force_latents, detector_transcoder, token_local
from support.helpers import loaded_tiny


def _analysed(tmp_path, loaded, d):
    folder = save_sparsify(d, tmp_path / "dicts" / f"h.{DETECTOR_LAYER}.mlp")
    build_index(loaded, _spec(tmp_path), tmp_path / "run", IndexOptions(top_k=3, control_keys=16),
                BatchOptions(batch_size=4), progress=False, dictionary=folder)
    analyze(tmp_path / "run", only=["values"], loaded=loaded, progress=False)
    read = lambda name: pd.read_parquet(tmp_path / "run" / "metrics" / f"{name}.parquet")  # noqa: E731
    return read("values_latents"), read("values_latents_keys"), read("values_keys")


def _brute_agreement(view, d, table):
    """Per latent: the target of its top trigger (the table's rank 0 next token) and its decoder row's top token."""
    first = table[table["rank"] == 0].set_index("key")["next_token_id"]
    top = logits(view, d.decoder, "identity").argmax(dim=-1).numpy()
    targets = np.array([int(first.get(i, -1)) for i in range(d.n_latents)])
    return targets, top


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("values_latents")
    return tmp, write_corpus(tmp / "corpus.txt", n=40)


def _detectors(corpus, tmp_path):
    """The token-local tiny model, the corpus's lines in `tmp_path`, and the detector transcoder of test_latents."""
    src, lines = corpus
    (tmp_path / "corpus.txt").write_text((src / "corpus.txt").read_text())
    loaded = token_local(loaded_tiny("gpt2"))
    return loaded, lines, detector_transcoder(loaded, "topk")


def test_detectors_that_write_their_triggers_next_token_all_agree(corpus, tmp_path):
    loaded, lines, d = _detectors(corpus, tmp_path)
    view = loaded.view
    expected, _ = brute_force_latents(loaded, lines, {DETECTOR_LAYER: d}, k=3)
    first = expected[expected["rank"] == 0].set_index("key")["next_token_id"]
    embedding = view.unembedding.detach()
    rows = [embedding[int(first[i])] * 4 if i in first.index and first[i] >= 0 else d.decoder[i]
            for i in range(d.n_latents)]
    d = replace(d, decoder=torch.stack(rows))
    per_layer, keys, neuron_keys = _analysed(tmp_path, loaded, d)
    targets, top = _brute_agreement(view, d, expected)
    with_target = targets >= 0
    assert with_target.sum() >= 3  # the planted detectors that fired, with a next token
    assert (top[with_target] == targets[with_target]).all()  # the construction: every one agrees
    row = per_layer.iloc[0]
    assert int(row["layer"]) == DETECTOR_LAYER and int(row["n_keys_with_target"]) == int(with_target.sum())
    assert row["agreement_rate"] == 1.0
    np.testing.assert_array_equal(keys["trigger_target_id"].to_numpy(), targets)
    np.testing.assert_array_equal(keys["top_token_id"].to_numpy(), top)
    # The neurons of the layer beside them: their own table's agreement there.
    mine = neuron_keys[(neuron_keys["layer"] == DETECTOR_LAYER) & (neuron_keys["trigger_target_id"] >= 0)]
    assert row["agreement_rate_neurons"] == pytest.approx(mine["agrees"].mean())
    assert row["agreement_rate_minus_neurons"] == pytest.approx(1.0 - mine["agrees"].mean())


def test_random_values_agree_as_a_brute_force_says_and_no_better_than_detectors(corpus, tmp_path):
    loaded, lines, d = _detectors(corpus, tmp_path)
    view = loaded.view
    g = torch.Generator().manual_seed(3)
    d = replace(d, decoder=torch.randn(d.decoder.shape, generator=g))
    expected, _ = brute_force_latents(loaded, lines, {DETECTOR_LAYER: d}, k=3)
    per_layer, keys, _ = _analysed(tmp_path, loaded, d)
    targets, top = _brute_agreement(view, d, expected)
    with_target = targets >= 0
    assert per_layer.iloc[0]["agreement_rate"] == pytest.approx((top[with_target] == targets[with_target]).mean())
    assert per_layer.iloc[0]["agreement_rate"] < 1.0


def test_a_run_whose_dictionary_is_gone_keeps_its_neuron_tables_and_says_why(corpus, tmp_path):
    import shutil

    from ffkv.store.run import RunDir

    loaded, _, d = _detectors(corpus, tmp_path)
    folder = save_sparsify(d, tmp_path / "dicts" / f"h.{DETECTOR_LAYER}.mlp")
    build_index(loaded, _spec(tmp_path), tmp_path / "run", IndexOptions(top_k=3, control_keys=4),
                BatchOptions(batch_size=4), progress=False, dictionary=folder)
    analyze(tmp_path / "run", only=["values"], loaded=loaded, progress=False)
    run = RunDir(tmp_path / "run")
    before = run.read_metric("values_latents")
    shutil.move(str(tmp_path / "dicts"), str(tmp_path / "moved"))
    run.metric_path("values_latents").unlink()
    with pytest.warns(Warning, match=r"values_latents not computed.*is gone.*--dictionary PATH"):
        analyze(tmp_path / "run", only=["values"], loaded=loaded, progress=False)
    assert run.has_metric("values") and not run.has_metric("values_latents")
    # where the message points: `ffkv analyze RUN --dictionary PATH`, the same files read from where they lie now
    analyze(tmp_path / "run", only=["values"], loaded=loaded, progress=False, dictionary_at=tmp_path / "moved")
    pd.testing.assert_frame_equal(run.read_metric("values_latents"), before)


def test_serve_and_the_lookups_read_a_moved_dictionary_from_where_it_lies_now(corpus, tmp_path, capsys):
    """The explorer's lookups refuse a run whose dictionary is gone, naming --dictionary; given where it lies now,
    they build its latents' tables and a latent page shows its trigger examples."""
    import shutil

    from starlette.testclient import TestClient

    from ffkv.cli import main
    from ffkv.errors import FfkvError
    from ffkv.explorer import create_app

    loaded, _, d = _detectors(corpus, tmp_path)
    folder = save_sparsify(d, tmp_path / "dicts" / f"h.{DETECTOR_LAYER}.mlp")
    build_index(loaded, _spec(tmp_path), tmp_path / "run", IndexOptions(top_k=3, control_keys=4),
                BatchOptions(batch_size=4), progress=False, dictionary=folder)
    shutil.move(str(tmp_path / "dicts"), str(tmp_path / "moved"))
    with pytest.raises(FfkvError, match=r"is gone; name where it lies now \(--dictionary PATH\)"):
        create_app(tmp_path / "run", loaded=loaded)
    app = create_app(tmp_path / "run", loaded=loaded, dictionary_at=tmp_path / "moved" / folder.name)
    with TestClient(base_url="http://127.0.0.1:8000", app=app) as client:
        trig = pd.read_parquet(tmp_path / "run" / "latent_trigger_examples.parquet")
        key = int(trig["key"].iloc[0])
        page = client.get(f"/memory/t{DETECTOR_LAYER + 1}:{key}.json")
        assert page.status_code == 200, page.text
        assert [e["example_id"] for e in page.json()["trigger_examples"]] == \
            trig[trig["key"] == key].sort_values("rank")["example_id"].tolist()
    plain = tmp_path / "plain"  # a run without a dictionary: --dictionary would read nothing, so it is refused
    build_index(loaded, _spec(tmp_path), plain, IndexOptions(top_k=2, control_keys=0), progress=False)
    for refused in (lambda: analyze(plain, only=["values"], loaded=loaded, progress=False, dictionary_at=folder),
                    lambda: create_app(plain, loaded=loaded, dictionary_at=folder)):
        with pytest.raises(FfkvError, match="indexed without a dictionary, so --dictionary .* would be read by nothing"):
            refused()
    for command in ("analyze", "serve"):  # both commands take the option the message names
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--dictionary PATH" in capsys.readouterr().out
