"""The words the findings are read in: shares with their 95% intervals, differences in points, fidelity rows.

Each experiment states its own findings, fidelity rules and reading sentences in its module
(`ffkv.experiments.registry`); they are written with these helpers, so that every sentence and every row of
metrics/fidelity.parquet reads a share, an interval and a verdict the same way.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pandas as pd

from ffkv.presentation.style import layer_number, percent


def pct(x: float) -> str:
    """A share as the pages show it (`ffkv.presentation.style.percent`: 1/4,096 reads 0.024%, not 0.0%)."""
    return percent(x) or "n/a"


#: z of a two-sided 95% interval.
Z95 = 1.959963984540054


def wilson_interval(k, n, z: float = Z95) -> tuple[np.ndarray, np.ndarray]:
    """The Wilson score interval of a share k/n of n independent trials (95% by default); nan where n = 0.

    Wilson (1927): centre (k + z²/2) / (n + z²), half-width z·sqrt(k(n-k)/n + z²/4) / (n + z²); unlike the
    normal approximation it stays inside [0, 1] and is not empty at k = 0 or k = n. k and n may be arrays.
    """
    k = np.asarray(k, dtype=float)
    n = np.asarray(n, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        centre = (k + z * z / 2) / (n + z * z)
        half = z * np.sqrt(np.clip(k * (n - k) / n, 0, None) + z * z / 4) / (n + z * z)
        # Exact ends at k = 0 and k = n (the formula gives them up to rounding).
        low = np.where(n > 0, np.where(k <= 0, 0.0, np.clip(centre - half, 0.0, 1.0)), np.nan)
        high = np.where(n > 0, np.where(k >= n, 1.0, np.clip(centre + half, 0.0, 1.0)), np.nan)
    return low, high


def share_ci(share: float, n) -> str:
    """"57.0% (95% CI 54.0-60.0%, n = 1,024)"."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return pct(share)
    lo, hi = wilson_interval(float(share) * int(n), int(n))
    return f"{pct(share)} (95% CI {pct(float(lo))}-{pct(float(hi))}, n = {int(n):,})"


def n_range(values: pd.Series) -> str:
    """"120" or "100-140": the range of an n over the layers."""
    lo, hi = int(values.min()), int(values.max())
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


# ------------------------------------------------------------------ fidelity
#: Columns of metrics/fidelity.parquet (docs/run-directory.md).
FIDELITY_COLUMNS = ("figure", "finding", "measured", "chance", "rule", "verdict", "reproduces", "n", "table",
                    "projection")
#: Below this many examples (or keys) in the layers a rule reads, no verdict is given (its 95% intervals are then
#: wider than about ±10 points): the row says so and how to get more.
MIN_VERDICT_N = 100
#: Below this recall on planted topics (the semantic labeler's calibration on the run's own corpus, at the
#: layer's cut-off), a finding about semantic keys gets no verdict: the detector would miss most of them.
MIN_SEMANTIC_RECALL = 0.5
#: What the held-out findings' too-few verdict tells the user to do.
MORE_EXAMPLES = "pass --eval-corpus or --eval-split all (and --n-eval)"
#: The same in the library's words (`ffkv.analyze`'s arguments).
MORE_EXAMPLES_LIBRARY = "pass eval_corpus= or eval_split=\"all\" (and n_eval=)"


def finding_heading(figure: str | None) -> str:
    """The heading of a finding shown beside a figure or table: ``Paper (Figure 7)`` for the paper's own, the
    figure's text (``Beyond the paper (Voita et al. 2023)``, ``Beyond the paper, beside Figure 7``) for the rest,
    never both."""
    if not figure:
        return "Paper"
    return figure if figure.lower().startswith("beyond") else f"Paper ({figure})"


def layer_ends(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series, pd.Series, str, str]:
    """A per-layer table sorted by layer, its first and last rows, and "layer N" for each (counted from 1)."""
    t = table.sort_values("layer").reset_index(drop=True)
    first, last = t.iloc[0], t.iloc[-1]
    return t, first, last, f"layer {layer_number(first.layer)}", f"layer {layer_number(last.layer)}"


def first_last(t: pd.DataFrame, column: str) -> tuple[float, float]:
    """A column's value in the first and in the last layer."""
    t = t.sort_values("layer")
    return float(t[column].iloc[0]), float(t[column].iloc[-1])


def points(x: float) -> str:
    """A difference of shares in percentage points."""
    return f"{100 * x:+.1f} points"


def diff(row, column: str, against: str = "chance") -> str:
    """"observed - chance +3.1 points (95% CI +1.0 to +5.2)" of a per-layer row."""
    d = f"{column}_minus_{against}"
    return (f"{points(row[d])} (95% CI {points(row[d + '_ci_low'])} to {points(row[d + '_ci_high'])})"
            if d in row and np.isfinite(row[d]) else "n/a")


def n_of(t: pd.DataFrame, *columns: str) -> int | None:
    """The smallest n over the table's layers, from the first of `columns` it has."""
    for c in columns:
        if c in t and len(t):
            return int(pd.to_numeric(t[c]).min())
    return None


def verdict_row(key: str, figure: str, measured: str, rule: str, ok: bool, n: int | None, chance: str = "",
                unit: str = "examples", blocked: str | None = None) -> dict:
    """One fidelity row; the verdict is withheld below `MIN_VERDICT_N` or for the `blocked` reason."""
    if blocked is not None:
        verdict, reproduces = blocked, None
    elif n is not None and n < MIN_VERDICT_N:
        more = f": {MORE_EXAMPLES}" if unit == "examples" else ""
        verdict, reproduces = f"too few {unit} (n = {n:,}, fewer than {MIN_VERDICT_N}){more}", None
    else:
        verdict, reproduces = ("yes" if ok else "no"), bool(ok)
    return {"key": key, "figure": figure, "measured": measured, "chance": chance, "rule": rule, "verdict": verdict,
            "reproduces": reproduces, "n": n}


def rule_frame(t: pd.DataFrame) -> tuple[pd.DataFrame, int, pd.Series | None, pd.Series | None]:
    """What a fidelity rule reads of a per-layer table: the table sorted by layer, its number of layers, and its
    first and last rows (None for an empty table)."""
    tt = t.sort_values("layer").reset_index(drop=True)
    first, last = (tt.iloc[0], tt.iloc[-1]) if len(t) else (None, None)
    return tt, len(t), first, last


def verdict_rows(rows: list[dict], findings: Mapping[str, str], name: str, projection: str, label: str = ""
                 ) -> list[dict]:
    """`verdict_row`s as rows of metrics/fidelity.parquet: each with the paper's finding of its key (`findings`:
    key -> the finding's words), the `table` it was read from and the `projection`; `label` follows the figure."""
    out = []
    for row in rows:
        row = dict(row)
        key = row.pop("key")
        out.append({**row, "figure": row["figure"] + label, "finding": findings[key], "table": name,
                    "projection": projection})
    return out
