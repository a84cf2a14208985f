"""The 95% Wilson interval of every per-layer share, and the small-n warning (issue 13, item 5)."""

from __future__ import annotations

import numpy as np
import pytest

from ffkv.errors import FfkvWarning
from ffkv.experiments.common import MIN_N, sample_size_warnings, share_with_interval
from ffkv.presentation.findings import wilson_interval


@pytest.mark.parametrize("k,n,low,high", [
    (5, 10, 0.2366, 0.7634),   # by hand: centre (5 + 1.92) / 13.84 = 0.5, half-width 1.96·sqrt(2.5 + 0.96) / 13.84
    (1, 10, 0.0179, 0.4042),
    (0, 10, 0.0, 0.2775),      # not empty at k = 0: (0, z² / (n + z²))
    (10, 10, 0.7225, 1.0),
    (81, 263, 0.2553, 0.3662),
])
def test_wilson_matches_hand_computed_values(k, n, low, high):
    got = wilson_interval(k, n)
    assert float(got[0]) == pytest.approx(low, abs=1e-4) and float(got[1]) == pytest.approx(high, abs=1e-4)


def test_wilson_is_vectorised_and_empty_samples_are_nan():
    low, high = wilson_interval(np.array([0, 5, 3]), np.array([0, 10, 10]))
    assert np.isnan(low[0]) and np.isnan(high[0])
    assert low[1] == pytest.approx(0.2366, abs=1e-4) and low[2] < 0.3 < high[2]


def test_share_with_interval_names_its_columns():
    row = share_with_interval(np.array([True] * 5 + [False] * 5), "kept")
    assert row["kept"] == 0.5
    assert row["kept_ci_low"] == pytest.approx(0.2366, abs=1e-4) and row["kept_ci_high"] == pytest.approx(0.7634, abs=1e-4)


def test_small_n_warns_once_with_the_experiment_and_n():
    with pytest.warns(FfkvWarning, match=r"composition: .* n = 4 examples, fewer than 100"):
        lines = sample_size_warnings("composition", 4)
    assert len(lines) == 1 and "\n" not in lines[0]
    assert sample_size_warnings("composition", MIN_N) == []
