"""The fidelity table: each rule decides as stated, on hand-made per-layer tables."""

from __future__ import annotations

import pandas as pd

from ffkv.presentation.findings import FIDELITY_COLUMNS, fidelity


def refinement(agreement, kept, override, composition, low=None, high=None):
    t = pd.DataFrame({"layer": range(len(agreement)), "residual_agreement": agreement, "mean_confidence": agreement,
                      "kept": kept, "override": override, "composition": composition})
    if low is not None:
        t["residual_agreement_ci_low"], t["residual_agreement_ci_high"] = low, high
    return t


def by_figure(table: pd.DataFrame) -> dict[str, bool]:
    return dict(zip(table["figure"], table["reproduces"]))


def test_rules_decide_as_stated():
    tables = {
        "composition": pd.DataFrame({"layer": [0, 1], "composition_rate": [0.70, 0.90], "share_active": [0.05, 0.1]}),
        "refinement": refinement([0.3, 0.8], [0.8, 0.6], [0.05, 0.1], [0.15, 0.3], [0.25, 0.75], [0.35, 0.85]),
        "values": pd.DataFrame({"layer": [0, 1], "agreement_rate": [0.0, 0.04], "agreement_rate_ci_low": [0.0, 0.02],
                                "chance_rate": [0.001, 0.001], "chance_rate_shuffled": [0.01, 0.005],
                                "rank_median": [900.0, 40.0]}),
    }
    got = by_figure(fidelity(tables, {"refinement": "final-norm"}))
    assert got == {"Figure 4": True, "Figure 5": True, "Figure 7": True, "Figure 8": True, "Figure 9": True,
                   "Figure 10": True, "Figure 11": True}
    # Each rule broken once.
    tables["composition"] = pd.DataFrame({"layer": [0, 1], "composition_rate": [0.67, 0.9], "share_active": [0.6, 0.7]})
    tables["refinement"] = refinement([0.3, 0.35], [0.4, 0.6], [0.3, 0.1], [0.3, 0.3], [0.25, 0.30], [0.35, 0.40])
    tables["values"]["agreement_rate_ci_low"] = [0.0, 0.004]  # the interval reaches chance (0.005)
    got = by_figure(fidelity(tables))
    assert got["Figure 8"] is False and got["Figure 7"] is False
    assert got["Figure 9"] is False  # 35% > 30%, but the intervals overlap
    assert got["Figure 11"] is False and got["Figure 4"] is False


def test_figures_9_to_11_are_also_read_under_the_other_projection():
    chosen = refinement([0.3, 0.8], [0.8, 0.6], [0.05, 0.1], [0.15, 0.3])
    other = refinement([0.5, 0.4], [0.8, 0.6], [0.05, 0.1], [0.15, 0.3])
    both = pd.concat([chosen.assign(projection="final-norm", choice="default"),
                      other.assign(projection="identity", choice="paper")])
    table = fidelity({"refinement": chosen, "refinement_projections": both}, {"refinement": "final-norm"})
    assert list(table.columns) == list(FIDELITY_COLUMNS)
    rows = table.set_index("figure")
    assert rows.loc["Figure 9", "reproduces"] and rows.loc["Figure 9", "projection"] == "final-norm"
    paper = rows.loc["Figure 9 (paper: identity projection)"]
    assert not paper["reproduces"] and paper["projection"] == "identity" and paper["table"] == "refinement_projections"


def test_no_tables_no_rows():
    assert fidelity({}).empty
