"""The one table of the paper's findings: for each figure and table of `ffkv analyze`, what the paper
found, and a one-line reading of this model's numbers.

Keys are the names of RUN/figures/NAME.* and RUN/metrics/NAME.parquet; the report (and the
explorer's overview) puts each finding next to the figure of the same name (`paper_finding`:
the exact name, else the longest key the name starts with).
"""

from __future__ import annotations

import math

import pandas as pd

from ffkv.presentation.style import layer_number, percent

PAPER_FINDINGS: dict[str, dict[str, str]] = {
    "patterns": {"figure": "Figure 2", "finding": (
        "Almost every key has a few clear patterns covering most of its top trigger examples; lower layers "
        "hold mostly shallow patterns (shared last word or n-gram), upper layers mostly semantic ones.")},
    "patterns_human": {"figure": "Figure 2", "finding": (
        "Experts labelled 10 random keys per layer: shallow patterns dominate the lower layers, semantic "
        "patterns the upper layers.")},
    "ablations": {"figure": "Figure 3", "finding": (
        "Removing the last token of a trigger prefix lowers the key's coefficient most; less so in upper "
        "layers. Removing the first or a random token matters much less.")},
    "values": {"figure": "Figure 4", "finding": (
        "The agreement between a value's top token and the next token of its key's top trigger example is "
        "near zero in layers 1-10 and rises to about 3.5% by layer 16, far above the chance rate 1/|V|.")},
    "values_rank": {"figure": "Figure 5", "finding": (
        "The rank of the top trigger example's next token in the value's distribution improves (gets lower) "
        "through the layers.")},
    "values_keys": {"figure": "Figure 4", "finding": "Per key: the value's distribution over the vocabulary."},
    "values_confident": {"figure": "Table 2", "finding": (
        "Of the 100 most confident values (highest max p), almost half have a top trigger example whose next "
        "token is the value's top token.")},
    "composition": {"figure": "Figure 8", "finding": (
        "In at least ~68% of examples in every layer, the FF layer's top prediction differs from that of every "
        "active memory: the output is a composition. The matching cases are mostly stop words.")},
    "composition_active": {"figure": "Figure 7", "finding": (
        "Hundreds of the 4,096 memories of a layer are active (m > 0) for one prefix, with a drop around "
        "layer 10.")},
    "composition_matches": {"figure": "Figure 8", "finding": (
        "Where the FF output's top token equals an active memory's, the token is mostly a stop word.")},
    "refinement": {"figure": "Figure 11", "finding": (
        "The FF layer mostly keeps the residual's prediction; when it changes it, rarely to the FF layer's own "
        "top prediction: the result is a compromise.")},
    "refinement_agreement": {"figure": "Figure 9", "finding": (
        "About a third of the residual's top predictions already equal the model's final prediction in the "
        "bottom layers; the share rises quickly from layer 10.")},
    "refinement_confidence": {"figure": "Figure 10", "finding": (
        "The probability the residual gives to the final prediction rises through the layers.")},
    "refinement_last_layer": {"figure": "Table 3", "finding": (
        "Examples where the last layer changes the residual's prediction: often to a related token or a "
        "compromise, for reading.")},
}


def paper_finding(name: str) -> dict[str, str] | None:
    """{"figure": "Figure 4", "finding": "..."} for a figure or table name, or None."""
    if name in PAPER_FINDINGS:
        return PAPER_FINDINGS[name]
    for key in sorted(PAPER_FINDINGS, key=len, reverse=True):
        if name.startswith(key):
            return PAPER_FINDINGS[key]
    return None


def paper_order(name: str) -> tuple[int, int, str]:
    """Sort key of a figure or table name in the paper's order: its figures by number (Figure 2 first), then
    its tables, then names the paper has no finding for."""
    found = paper_finding(name) or {}
    kind, _, number = found.get("figure", "").partition(" ")
    if number.isdigit():
        return (0 if kind == "Figure" else 1), int(number), name
    return 2, 0, name


def _pct(x: float) -> str:
    """A share as the pages show it (`ffkv.presentation.style.percent`: 1/4,096 reads 0.024%, not 0.0%)."""
    return percent(x) or "n/a"


def wilson_interval(share: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% for z = 1.96) of a share observed on n independent trials."""
    if not n or share is None or (isinstance(share, float) and math.isnan(share)):
        return math.nan, math.nan
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _share_ci(share: float, n) -> str:
    """"57.0% (95% CI 54.0-60.0%, n = 1,024)"."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return _pct(share)
    lo, hi = wilson_interval(float(share), int(n))
    return f"{_pct(share)} (95% CI {_pct(lo)}-{_pct(hi)}, n = {int(n):,})"


def _n_range(values: pd.Series) -> str:
    lo, hi = int(values.min()), int(values.max())
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def reading(name: str, table: pd.DataFrame) -> str | None:
    """One sentence on this model's numbers for a per-layer table: the paper's quantity, with n and a 95%
    confidence interval (Wilson for shares, mean +- 1.96 standard errors for means); None when the table
    is not one of the paper's per-layer tables. Layers are counted from 1."""
    if table is None or table.empty or "layer" not in table:
        return None
    t = table.sort_values("layer").reset_index(drop=True)
    first, last = t.iloc[0], t.iloc[-1]
    n_first, n_last = f"layer {layer_number(first.layer)}", f"layer {layer_number(last.layer)}"
    if name == "values" and "agreement_rate" in t:
        n = "n_keys_with_target" if "n_keys_with_target" in t else "n_keys" if "n_keys" in t else None
        return (f"In this model the agreement rate goes from {_share_ci(first.agreement_rate, first[n] if n else None)} "
                f"in {n_first} to {_share_ci(last.agreement_rate, last[n] if n else None)} in {n_last} "
                f"(n: keys whose top trigger has a next token); chance is {_pct(first.chance_rate)} (1/|V|), "
                f"{_pct(t['chance_rate_shuffled'].mean())} for shuffled pairs.")
    if name == "composition" and "composition_rate" in t:
        low = t.loc[t["composition_rate"].idxmin()]
        n = low["n_examples"] if "n_examples" in t else None
        out = (f"In this model the FF output's top token differs from every active memory's in "
               f"{_pct(t['composition_rate'].min())}-{_pct(t['composition_rate'].max())} of examples per layer; "
               f"the lowest, layer {layer_number(low.layer)}: {_share_ci(low.composition_rate, n)}")
        if "mean_active" in t:
            of = f" of {int(first.d_m):,}" if "d_m" in t else ""
            out += f"; {t['mean_active'].min():.0f}-{t['mean_active'].max():.0f}{of} memories are active on average"
        return out + "."
    if name == "refinement" and "kept" in t:
        n = last["n_examples"] if "n_examples" in t else None
        return (f"In this model, averaged over the {len(t)} layers, the residual's prediction is kept in "
                f"{_pct(t['kept'].mean())} of examples, overridden by the FF's own prediction in "
                f"{_pct(t['override'].mean())}, composed in {_pct(t['composition'].mean())}; in {n_last}: kept "
                f"{_share_ci(last.kept, n)}, overridden {_pct(last.override)}, composed {_pct(last.composition)}.")
    if name == "ablations" and "mean_change_last" in t:
        def variant(v: str) -> str:
            mean, sem = t[f"mean_change_{v}"], t.get(f"sem_{v}")
            ci = f", 95% CIs within ±{_pct(1.96 * sem.max())}" if sem is not None else ""
            return f"{_pct(mean.mean())} (per layer {_pct(mean.min())} to {_pct(mean.max())}{ci})"
        n = f"; n = {_n_range(t['n_last'])} prefixes per layer" if "n_last" in t else ""
        return (f"In this model removing the last token changes the key's coefficient by {variant('last')} on "
                f"average over layers, the first token by {variant('first')}, a random one by "
                f"{variant('random')}{n}.")
    if name == "patterns" and "keys_shallow" in t:
        n = "n_keys" if "n_keys" in t else None

        def shares(row) -> str:
            return (f"{_share_ci(row.keys_shallow + row.keys_both, row[n] if n else None)} of keys have a shallow "
                    f"pattern ({_pct(row.keys_shallow)} shallow only, {_pct(row.keys_both)} both) and "
                    f"{_pct(row.keys_semantic + row.keys_both)} a semantic one ({_pct(row.keys_semantic)} semantic "
                    f"only)")
        return f"In this model, in {n_first}, {shares(first)}; in {n_last}, {shares(last)}."
    return None
