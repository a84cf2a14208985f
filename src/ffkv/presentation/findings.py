"""The one table of the paper's findings: for each figure and table of `ffkv analyze`, what the paper
found, and a one-line reading of this model's numbers.

Keys are the names of RUN/figures/NAME.* and RUN/metrics/NAME.parquet; the report (and the
explorer's overview) puts each finding next to the figure of the same name (`paper_finding`:
the exact name, else the longest key the name starts with).
"""

from __future__ import annotations

import math

import pandas as pd

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


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def reading(name: str, table: pd.DataFrame) -> str | None:
    """One sentence on this model's numbers for a per-layer table, or None (the report's default then)."""
    if table is None or table.empty or "layer" not in table:
        return None
    t = table.sort_values("layer")
    first, last = t.iloc[0], t.iloc[-1]
    if name == "values" and "agreement_rate" in t:
        return (f"In this model the agreement rate goes from {_pct(first.agreement_rate)} (layer 1) to "
                f"{_pct(last.agreement_rate)} (layer {len(t)}); chance is {_pct(first.chance_rate)}, "
                f"{_pct(t['chance_rate_shuffled'].mean())} for shuffled pairs.")
    if name == "composition" and "composition_rate" in t:
        return (f"In this model the FF output differs from every active memory's top token in "
                f"{_pct(t['composition_rate'].min())}-{_pct(t['composition_rate'].max())} of examples per layer; "
                f"{t['mean_active'].min():.0f}-{t['mean_active'].max():.0f} memories are active on average.")
    if name == "refinement" and "kept" in t:
        return (f"In this model the residual's prediction is kept in {_pct(t['kept'].mean())} of cases on average, "
                f"overridden by the FF's own prediction in {_pct(t['override'].mean())}, composed in "
                f"{_pct(t['composition'].mean())}.")
    if name == "ablations" and "mean_change_last" in t:
        return (f"In this model removing the last token changes the coefficient by {_pct(t['mean_change_last'].mean())} "
                f"on average, the first by {_pct(t['mean_change_first'].mean())}, a random one by "
                f"{_pct(t['mean_change_random'].mean())}.")
    if name == "patterns" and "keys_shallow" in t:
        shallow = t["keys_shallow"] + t["keys_both"]
        semantic = t["keys_semantic"] + t["keys_both"]
        return (f"In this model {_pct(shallow.iloc[0])} of layer-1 keys and {_pct(shallow.iloc[-1])} of top-layer keys "
                f"are shallow; {_pct(semantic.iloc[0])} and {_pct(semantic.iloc[-1])} semantic.")
    return None
