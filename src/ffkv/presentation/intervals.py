"""Intervals for two statistics of the studies beyond the paper: a ROC AUC (DeLong) and a paired mean difference.

(Shares use the Wilson interval of `ffkv.presentation.findings.wilson_interval`.)
"""

from __future__ import annotations

import numpy as np

from ffkv.presentation.findings import Z95


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, ties given the mean of the ranks they span."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    # Runs of equal values: each gets the mean of its 1-based positions.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    mean_rank = (starts + 1 + ends) / 2.0
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def _auc_components(positive: np.ndarray, negative: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeLong's structural components (V10 per positive, V01 per negative) from midranks; their means are the AUC."""
    x = np.asarray(positive, dtype=np.float64)
    y = np.asarray(negative, dtype=np.float64)
    m, n = len(x), len(y)
    all_ranks = _midranks(np.concatenate([x, y]))
    v10 = (all_ranks[:m] - _midranks(x)) / n        # share of negatives below X_i (ties half)
    v01 = 1.0 - (all_ranks[m:] - _midranks(y)) / m  # share of positives above Y_j (ties half)
    return v10, v01


def _delong_variance(v10: np.ndarray, v01: np.ndarray) -> float:
    m, n = len(v10), len(v01)
    return (v10.var(ddof=1) / m if m > 1 else 0.0) + (v01.var(ddof=1) / n if n > 1 else 0.0)


def auc_interval(positive: np.ndarray, negative: np.ndarray, z: float = Z95) -> tuple[float, float, float]:
    """ROC AUC of scores where `positive` should score higher, and its DeLong 95% interval (clipped to [0, 1]).

    AUC = P(X > Y) + P(X = Y)/2 over pairs (X from `positive`, Y from `negative`), the Mann-Whitney
    statistic. DeLong, DeLong & Clarke-Pearson (1988): with the structural components
    V10_i = mean_j psi(X_i, Y_j) and V01_j = mean_i psi(X_i, Y_j), Var(AUC) = s²(V10)/m + s²(V01)/n
    (sample variances); the interval is AUC ± z·sqrt(Var). Computed from midranks, O((m+n) log(m+n)).
    Returns (auc, low, high); NaN when either group is empty.
    """
    if len(positive) == 0 or len(negative) == 0:
        return float("nan"), float("nan"), float("nan")
    v10, v01 = _auc_components(positive, negative)
    auc = float(v10.mean())
    half = z * float(np.sqrt(_delong_variance(v10, v01)))
    return auc, max(0.0, auc - half), min(1.0, auc + half)


def auc_difference_interval(positive_a: np.ndarray, negative_a: np.ndarray, positive_b: np.ndarray,
                            negative_b: np.ndarray, z: float = Z95) -> tuple[float, float, float]:
    """AUC(a) - AUC(b) of two scores of the same examples (row i of `positive_a` and `positive_b` is the same
    positive example, likewise the negatives) and its paired DeLong 95% interval: the variance of the difference is
    s²(V10_a - V10_b)/m + s²(V01_a - V01_b)/n (DeLong et al. 1988: the two AUCs' covariance counted).
    Returns (difference, low, high); NaN when either group is empty or the rows do not pair."""
    m, n = len(positive_a), len(negative_a)
    if m == 0 or n == 0 or len(positive_b) != m or len(negative_b) != n:
        return float("nan"), float("nan"), float("nan")
    a10, a01 = _auc_components(positive_a, negative_a)
    b10, b01 = _auc_components(positive_b, negative_b)
    difference = float(a10.mean() - b10.mean())
    half = z * float(np.sqrt(_delong_variance(a10 - b10, a01 - b01)))
    return difference, difference - half, difference + half


def paired_mean_interval(difference: np.ndarray, z: float = Z95) -> tuple[float, float, float]:
    """Mean of paired per-example differences and its 95% interval, mean ± z·s/√n (s the sample standard
    deviation; the normal approximation to the paired t interval, close to it for n >= 30).
    Returns (mean, low, high); the interval is NaN for n < 2."""
    d = np.asarray(difference, dtype=np.float64)
    d = d[np.isfinite(d)]
    if len(d) == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(d.mean())
    if len(d) < 2:
        return mean, float("nan"), float("nan")
    half = z * float(d.std(ddof=1)) / np.sqrt(len(d))
    return mean, mean - half, mean + half


def mean_difference_interval(a: np.ndarray, b: np.ndarray, z: float = Z95) -> tuple[float, float, float]:
    """mean(a) - mean(b) of two independent samples and its 95% interval, ± z·sqrt(s_a²/n_a + s_b²/n_b) (the normal
    approximation to Welch's interval; non-finite values left out). Returns (difference, low, high); NaN when
    either sample is empty, the interval NaN when either has fewer than 2."""
    a, b = (np.asarray(x, dtype=np.float64) for x in (a, b))
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if not len(a) or not len(b):
        return float("nan"), float("nan"), float("nan")
    difference = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return difference, float("nan"), float("nan")
    half = z * float(np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)))
    return difference, difference - half, difference + half
