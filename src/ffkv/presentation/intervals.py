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


def auc_interval(positive: np.ndarray, negative: np.ndarray, z: float = Z95) -> tuple[float, float, float]:
    """ROC AUC of scores where `positive` should score higher, and its DeLong 95% interval (clipped to [0, 1]).

    AUC = P(X > Y) + P(X = Y)/2 over pairs (X from `positive`, Y from `negative`), the Mann-Whitney
    statistic. DeLong, DeLong & Clarke-Pearson (1988): with the structural components
    V10_i = mean_j psi(X_i, Y_j) and V01_j = mean_i psi(X_i, Y_j), Var(AUC) = s²(V10)/m + s²(V01)/n
    (sample variances); the interval is AUC ± z·sqrt(Var). Computed from midranks, O((m+n) log(m+n)).
    Returns (auc, low, high); NaN when either group is empty.
    """
    x = np.asarray(positive, dtype=np.float64)
    y = np.asarray(negative, dtype=np.float64)
    m, n = len(x), len(y)
    if m == 0 or n == 0:
        return float("nan"), float("nan"), float("nan")
    all_ranks = _midranks(np.concatenate([x, y]))
    rx, ry = _midranks(x), _midranks(y)
    v10 = (all_ranks[:m] - rx) / n          # share of negatives below X_i (ties half)
    v01 = 1.0 - (all_ranks[m:] - ry) / m    # share of positives above Y_j (ties half)
    auc = float(v10.mean())
    var = (v10.var(ddof=1) / m if m > 1 else 0.0) + (v01.var(ddof=1) / n if n > 1 else 0.0)
    half = z * float(np.sqrt(var))
    return auc, max(0.0, auc - half), min(1.0, auc + half)


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
