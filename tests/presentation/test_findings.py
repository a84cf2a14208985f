"""The report's sentences on this model: the paper's quantity, with n and a 95% confidence interval, layers
counted from 1, small shares readable."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ffkv.experiments.registry import reading
from ffkv.presentation.findings import wilson_interval


@pytest.mark.parametrize("share, n", [(0.5, 100), (0.035, 1000), (0.0, 50), (1.0, 7), (0.57, 1024)])
def test_wilson_interval_is_the_set_of_shares_a_score_test_keeps(share, n):
    """Brute force: the Wilson interval holds exactly the p whose score statistic |share - p| / sqrt(p(1-p)/n)
    stays within 1.96."""
    lo, hi = wilson_interval(share * n, n, z=1.96)
    grid = np.linspace(1e-9, 1 - 1e-9, 2_000_001)
    kept = grid[np.abs(share - grid) / np.sqrt(grid * (1 - grid) / n) <= 1.96]
    assert lo == pytest.approx(kept.min(), abs=2e-6) and hi == pytest.approx(kept.max(), abs=2e-6)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_the_patterns_sentence_says_what_shallow_counts_with_n_and_an_interval():
    table = pd.DataFrame({"layer": [0, 1, 2], "keys_shallow": [0.38, 0.3, 0.317], "keys_semantic": [0.115, 0.1, 0.137],
                          "keys_both": [0.19, 0.2, 0.348], "keys_none": [0.315, 0.4, 0.198],
                          "n_keys": [1024, 1024, 1024]})
    text = reading("patterns", table)
    lo, hi = wilson_interval((0.38 + 0.19) * 1024, 1024)
    assert text.startswith("In this model, in layer 1, 57.0% (95% CI ")
    assert f"{100 * lo:.1f}%-{100 * hi:.1f}%, n = 1,024) of keys have a shallow pattern (38.0% shallow only, " \
           "19.0% both)" in text
    assert "in layer 3, 66.5%" in text and "48.5% a semantic one (13.7% semantic only)" in text
    assert "layer 0" not in text and "top-layer" not in text


def test_the_values_sentence_shows_the_chance_rate_not_zero():
    table = pd.DataFrame({"layer": [0, 1], "agreement_rate": [0.035, 0.031], "chance_rate": [1 / 4096] * 2,
                          "chance_rate_shuffled": [0.003, 0.005], "n_keys": [1024, 1024],
                          "n_keys_with_target": [1000, 1004]})
    text = reading("values", table)
    assert "chance is 0.024% (1/|V|)" in text and "0.0%" not in text
    (a, b), (c, d) = wilson_interval(35, 1000), wilson_interval(0.031 * 1004, 1004)
    assert (f"3.5% (95% CI {100 * a:.1f}%-{100 * b:.1f}%, n = 1,000) in layer 1 to "
            f"3.1% (95% CI {100 * c:.1f}%-{100 * d:.1f}%, n = 1,004) in layer 2") in text


def test_the_ablations_sentence_gives_each_variant_its_interval():
    table = pd.DataFrame({"layer": [0, 1], "mean_change_last": [-0.6, -0.8], "sem_last": [0.01, 0.02],
                          "n_last": [480, 500], "mean_change_first": [-0.05, -0.07], "sem_first": [0.004, 0.005],
                          "n_first": [480, 500], "mean_change_random": [-0.1, -0.2], "sem_random": [0.01, 0.01],
                          "n_random": [480, 500]})
    text = reading("ablations", table)
    assert "by -70.0% (per layer -80.0% to -60.0%, 95% CIs within ±3.9%) on average over layers" in text
    assert "n = 480-500 prefixes per layer" in text


def test_no_sentence_for_a_table_that_is_not_a_paper_quantity():
    assert reading("values_keys", pd.DataFrame({"layer": [0], "key": [1]})) is None
    assert reading("patterns", pd.DataFrame()) is None
