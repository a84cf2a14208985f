"""Issue 46's known answer: a transcoder whose latents are token detectors exceeds its random directions by more
than the neurons of the same layer exceed theirs, on Figure 2's pattern measure; a transcoder of random directions
does not. On ffkv-tiny and its own corpus (a model with context, where random directions are not token detectors
by construction)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.dictionaries import Dictionary, save_sparsify
from ffkv.experiments import analyze
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import load_model
from ffkv.models.default_corpus import default_corpus_path

LAYER = 3
N_DETECTORS = 40


@pytest.fixture(scope="module")
def tiny():
    """ffkv-tiny, and per chosen token (the most frequent non-special ones of 200 verses) the mean FF input of
    layer LAYER at that token minus the mean over every position: the direction that detects it."""
    loaded = load_model("ffkv-tiny")
    view, tok = loaded.view, loaded.tokenizer
    lines = [line for line in default_corpus_path("train").read_text().splitlines() if line.strip()][:200]
    xs, ids = [], []
    for line in lines:
        t = torch.tensor([tok.encode(line)])
        with view.capture(("ff_in",)) as cap:
            view.forward(t, torch.ones_like(t))
        xs.append(cap["ff_in"][LAYER][0])
        ids.append(t[0])
    x, token = torch.cat(xs), torch.cat(ids)
    order = torch.bincount(token, minlength=view.vocab_size).argsort(descending=True).tolist()
    chosen = [t for t in order if t not in loaded.special_ids][:N_DETECTORS]
    mean = x.mean(0)
    rows = torch.stack([x[token == t].mean(0) - mean for t in chosen])
    return loaded, chosen, rows


def _transcoder(view, encoder):
    n = len(encoder)
    return Dictionary(kind="transcoder", layer=LAYER, encoder=encoder, encoder_bias=torch.zeros(n),
                      decoder=torch.randn(n, view.d_model, generator=torch.Generator().manual_seed(1)) * 0.01,
                      decoder_bias=torch.zeros(view.d_model), activation="topk", k=4)


def _patterns(tmp_path, loaded, d):
    folder = save_sparsify(d, tmp_path / "dicts" / f"h.{LAYER}.mlp")
    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=400, shuffle_seed=0)
    build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=10, control_keys=128), progress=False,
                dictionary=folder)
    analyze(tmp_path / "run", only=["patterns"], loaded=loaded, progress=False)
    return pd.read_parquet(tmp_path / "run" / "metrics" / "patterns_latents.parquet").iloc[0]


def test_token_detectors_beat_the_neurons_beyond_control(tmp_path, tiny):
    loaded, chosen, rows = tiny
    row = _patterns(tmp_path, loaded, _transcoder(loaded.view, rows))
    # The detectors' trigger prefixes end in their token (in a model with context a mean direction is not an exact
    # detector: 87% here), and every detector is labelled shallow.
    trig = pd.read_parquet(tmp_path / "run" / "latent_trigger_examples.parquet")
    examples = pd.read_parquet(tmp_path / "run" / "examples.parquet").set_index("example_id")["token_ids"]
    last = np.array([examples[e][p] for e, p in zip(trig["example_id"], trig["position"])])
    assert (last == np.array(chosen)[trig["key"].to_numpy()]).mean() > 0.8
    assert row["any_pattern_latents"] == 1.0 and row["n_control_latents"] >= 100
    assert row["excess_latents_minus_neurons_ci_low"] > 0  # beyond control, by more than the neurons


def test_random_directions_do_not(tmp_path, tiny):
    loaded, _, rows = tiny
    g = torch.randn(rows.shape, generator=torch.Generator().manual_seed(0))
    row = _patterns(tmp_path, loaded, _transcoder(loaded.view, g / g.norm(dim=1, keepdim=True) * rows.norm(dim=1,
                                                                                                       keepdim=True)))
    assert row["n_keys"] == N_DETECTORS and row["excess_latents_minus_neurons_ci_low"] <= 0
