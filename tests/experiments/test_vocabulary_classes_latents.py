"""Vocabulary classes of a dictionary's decoder rows (`ffkv.experiments.vocabulary_classes` with `Latents`): a
dictionary whose decoder rows are a layer's own values gets that layer's statistics and classes exactly, its null
too, and no difference from the neurons beside it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ffkv.dictionaries import Dictionary
from ffkv.experiments.vocabulary_classes import CLASSES, beside_neurons, value_classes
from ffkv.memories.sets import Latents
from support.helpers import loaded_tiny

LAYER = 1


def test_a_dictionary_of_the_layers_own_values_is_classed_as_the_neurons():
    view = loaded_tiny("llama").view
    values = view.values(LAYER).detach().clone()
    n = values.shape[0]
    d = Dictionary(kind="transcoder", layer=LAYER, encoder=view.keys(LAYER).detach().clone(),
                   encoder_bias=torch.zeros(n), decoder=values, decoder_bias=torch.zeros(view.d_model),
                   activation="relu")
    neurons = value_classes(view)
    latents = value_classes(view, memories=Latents(view, {LAYER: d}))
    mine = neurons["keys"][neurons["keys"]["layer"] == LAYER].reset_index(drop=True)
    theirs = latents["keys"]
    assert list(theirs["layer"].unique()) == [LAYER] and len(theirs) == n
    for column in ("class", "vocab_mean", "vocab_var", "vocab_skew", "vocab_kurtosis", "value_norm", "key_norm",
                   "cos_key_value", "null_space_share"):
        pd.testing.assert_series_equal(theirs[column], mine[column], check_names=False)
    assert theirs["cos_up_value"].isna().all()  # a dictionary has no up projection
    row = latents["layers"].iloc[0]
    base = neurons["layers"].set_index("layer").loc[LAYER]
    assert row["partition_variance"] == base["partition_variance"]  # the same null: mixtures of the same rows
    beside = beside_neurons(latents["layers"], theirs, neurons["keys"]).iloc[0]
    for kind in CLASSES[:3]:
        assert beside[f"{kind}_share_neurons"] == base[f"{kind}_share"]
        assert beside[f"{kind}_share_minus_neurons"] == 0.0
        assert beside[f"{kind}_share_minus_neurons_ci_low"] <= 0 <= beside[f"{kind}_share_minus_neurons_ci_high"]
    assert np.isclose(beside["partition_share"], (theirs["class"] == "partition").mean())
