"""`Run` reads a dictionary's latents as it reads neurons: on a run indexed with a hand-built transcoder of token
detectors, its triggers are the latent table's rows at the planted tokens, its values' top tokens the planted
ones; the dictionary is read again from its files and refused when they moved or changed."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pandas as pd
import pytest
import torch

from ffkv.api import Run
from ffkv.dictionaries import save_sparsify
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from indexing.test_exactness import write_corpus
from indexing.test_latents import DETECTOR_LAYER, PLANTED, _spec, detector_transcoder, token_local
from support.helpers import loaded_tiny


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("latents")
    lines = write_corpus(tmp / "corpus.txt", n=19)
    loaded = token_local(loaded_tiny("gpt2"))
    d = detector_transcoder(loaded, "topk")
    folder = save_sparsify(d, tmp / "dicts" / f"h.{DETECTOR_LAYER}.mlp")
    build_index(loaded, _spec(tmp), tmp / "run", IndexOptions(top_k=4, control_keys=8),
                BatchOptions(batch_size=3, window_batches=2), progress=False, dictionary=folder.parent)
    return tmp, loaded, lines, folder


def test_run_reads_latents_as_it_reads_neurons(indexed):
    tmp, loaded, lines, folder = indexed
    run = Run(tmp / "run", loaded=loaded)
    tok = loaded.tokenizer
    assert run.layout.latents == {DETECTOR_LAYER: ("transcoder", len(PLANTED) + 1)}
    table = pd.read_parquet(tmp / "run" / "latent_trigger_examples.parquet")
    for i, ch in enumerate(PLANTED):
        got = run.triggers(DETECTOR_LAYER, i, of="latents")
        mine = table[table["key"] == i].reset_index(drop=True)
        assert len(got) == len(mine) > 0
        pd.testing.assert_frame_equal(got[list(mine.columns)], mine)
        assert set(got["trigger_token"]) == set(tok.token_strings(tok.encode(ch)[:1]))
        assert all(text == lines[e] for text, e in zip(got["text"], got["example_id"]))
        values = run.values(DETECTOR_LAYER, i, of="latents", k=1)
        assert int(values[values["end"] == "top"]["token_id"].iloc[0]) == tok.encode(ch)[0]
    assert run.triggers(DETECTOR_LAYER, len(PLANTED), of="latents").empty  # the dead latent never fired
    assert str(run.layout.parse(f"t{DETECTOR_LAYER + 1}:2")) == f"t{DETECTOR_LAYER + 1}:2"
    # The neurons' view is unchanged: its own value, its own table.
    neuron = run.values(DETECTOR_LAYER, 2, k=1)
    v = loaded.view.values(DETECTOR_LAYER)[2]
    assert int(neuron["token_id"].iloc[0]) == int((v @ loaded.view.unembedding.T).argmax())
    with pytest.raises(FfkvError, match="never negative"):
        run.triggers(DETECTOR_LAYER, 0, "negative", of="latents")
    with pytest.raises(FfkvError, match="has no dictionary"):
        run.triggers(DETECTOR_LAYER + 1, 0, of="latents")
    with pytest.raises(FfkvError, match="latents 0.."):
        run.values(DETECTOR_LAYER, len(PLANTED) + 1, of="latents")


def test_a_moved_or_changed_dictionary_is_named(indexed, tmp_path):
    tmp, loaded, _, folder = indexed
    moved = tmp_path / "moved"
    shutil.copytree(folder.parent, moved)
    shutil.move(str(folder.parent), str(tmp_path / "gone"))
    try:
        with pytest.raises(FfkvError, match="is gone"):
            Run(tmp / "run", loaded=loaded).memories("latents")
        latents = Run(tmp / "run", loaded=loaded, dictionary=moved).memories("latents")
        planted = detector_transcoder(loaded, "topk")
        assert torch.equal(latents.values(DETECTOR_LAYER)[:-1], planted.decoder[:-1])  # the dead row is random
        save_sparsify(replace(planted, decoder=planted.decoder * 2), tmp_path / "other" / folder.name)
        with pytest.raises(FfkvError, match="not the dictionary this run was indexed with"):
            Run(tmp / "run", loaded=loaded, dictionary=tmp_path / "other").memories("latents")
    finally:
        shutil.move(str(tmp_path / "gone"), str(folder.parent))


def test_a_run_without_a_dictionary_has_no_latents(tmp_path):
    write_corpus(tmp_path / "corpus.txt", n=5)
    loaded = loaded_tiny("gpt2")
    build_index(loaded, _spec(tmp_path), tmp_path / "run", IndexOptions(top_k=2, control_keys=0), progress=False)
    run = Run(tmp_path / "run", loaded=loaded)
    assert run.layout.latents == {}
    with pytest.raises(FfkvError, match="indexed with --dictionary"):
        run.triggers(0, 0, of="latents")
    with pytest.raises(FfkvError, match="holds no latents"):
        run.dir.read_triggers(source="latents")
    with pytest.raises(FfkvError, match="indexed without a dictionary"):
        run.memories("latents")


def test_run_edits_latents_by_their_address(indexed):
    """`Run.trace`/`intervene` take a latent's address; switching a detector off changes the run's logits exactly
    where its token is, and the command line prints the edit as it was written."""
    from ffkv.api import intervene
    from ffkv.memories.interventions import Intervention, intervene as edit_model

    tmp, loaded, lines, folder = indexed
    run = Run(tmp / "run", loaded=loaded)
    address = f"t{DETECTOR_LAYER + 1}:0"
    edits = run._edits([address], {f"{DETECTOR_LAYER + 1}:3": 2.0}, None)
    assert edits == [Intervention(DETECTOR_LAYER, 0, "off", kind="transcoder"),
                     Intervention(DETECTOR_LAYER, 3, "scale", 2.0)]
    tok = loaded.tokenizer
    ids = torch.tensor([tok.encode("a " + PLANTED[0] + " b")])
    planted = tok.encode(PLANTED[0])[0]
    with torch.no_grad():
        clean = loaded.model(input_ids=ids).logits
        with edit_model(loaded.view, edits[:1]):
            edited = loaded.model(input_ids=ids).logits
    # token_local: a position's residual depends on its token alone, so the logits change where the token is.
    changed = (edited - clean).abs().amax(dim=-1)[0] > 0
    assert changed.tolist() == [i == planted for i in ids[0].tolist()] and changed.any()
    # The trace edits the latent, never neuron 0 of the layer: its predictions are the edited model's.
    prompt = tok.encode("a " + PLANTED[0])
    traced = run.trace("a " + PLANTED[0], off=[address])
    assert traced.edited.latent_edits == {(DETECTOR_LAYER, 0): edits[0]} and not traced.edited.edits
    with torch.no_grad(), edit_model(loaded.view, edits[:1]):
        p = loaded.model(input_ids=torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
    assert traced.edited.final[0].token_id == int(p.argmax())
    assert traced.edited.final[0].prob == pytest.approx(float(p.max()), rel=1e-5)
    result = intervene(run, off=[address], n_eval=5, eval_corpus=str(tmp / "corpus.txt"))
    assert f"{address} off" in result.to_text()
    assert result.description()["interventions"][0]["memory"] == address
