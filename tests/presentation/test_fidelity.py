"""The fidelity table: each rule decides as stated, on hand-made per-layer tables."""

from __future__ import annotations

import pandas as pd

from ffkv.experiments.fidelity import fidelity
from ffkv.presentation.findings import FIDELITY_COLUMNS


def refinement(agreement, kept, override, composition, low=None, high=None):
    t = pd.DataFrame({"layer": range(len(agreement)), "residual_agreement": agreement, "mean_confidence": agreement,
                      "kept": kept, "override": override, "composition": composition})
    if low is not None:
        t["residual_agreement_ci_low"], t["residual_agreement_ci_high"] = low, high
    return t


def by_figure(table: pd.DataFrame) -> dict[str, bool | None]:
    """figure -> True, False, or None where no verdict is given."""
    return {f: (None if pd.isna(r) else bool(r)) for f, r in zip(table["figure"], table["reproduces"])}


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


def with_chance(table: pd.DataFrame, column: str, chance, minus_low, minus_high) -> pd.DataFrame:
    return table.assign(**{f"{column}_chance": chance, f"{column}_minus_chance": (pd.Series(minus_low) + minus_high) / 2,
                           f"{column}_minus_chance_ci_low": minus_low, f"{column}_minus_chance_ci_high": minus_high})


def test_chance_levels_decide_beside_the_papers_thresholds():
    """Figure 8 at 90% in every layer still fails when the output is a single memory's more often than chance
    (observed - chance entirely below 0); Figure 9 fails when the top layer is not above its chance level."""
    comp = pd.DataFrame({"layer": [0, 1], "composition_rate": [0.9, 0.9], "share_active": [0.05, 0.1],
                         "n_examples": [500, 500]})
    at_chance = with_chance(comp, "composition_rate", [0.9, 0.9], [-0.02, -0.03], [0.02, 0.01])
    below = with_chance(comp, "composition_rate", [0.97, 0.95], [-0.09, -0.07], [-0.05, -0.03])
    assert by_figure(fidelity({"composition": at_chance}))["Figure 8"] is True
    assert by_figure(fidelity({"composition": below}))["Figure 8"] is False
    row = fidelity({"composition": below}).set_index("figure").loc["Figure 8"]
    assert "chance 95.0%-97.0%" in row["chance"] and "observed - chance" in row["rule"]
    ref = refinement([0.3, 0.8], [0.8, 0.6], [0.05, 0.1], [0.15, 0.3], [0.25, 0.75], [0.35, 0.85]).assign(n_examples=500)
    assert by_figure(fidelity({"refinement": with_chance(ref, "residual_agreement", [0.3, 0.7], [0.0, 0.05],
                                                         [0.05, 0.15])}))["Figure 9"] is True
    assert by_figure(fidelity({"refinement": with_chance(ref, "residual_agreement", [0.3, 0.79], [0.0, -0.03],
                                                         [0.05, 0.05])}))["Figure 9"] is False


def test_no_verdict_below_the_minimum_n_naming_the_fix():
    comp = pd.DataFrame({"layer": [0, 1], "composition_rate": [0.9, 0.9], "share_active": [0.05, 0.1],
                         "n_examples": [4, 4]})
    row = fidelity({"composition": comp}).set_index("figure").loc["Figure 8"]
    assert pd.isna(row["reproduces"]) and row["n"] == 4
    assert row["verdict"].startswith("too few examples (n = 4") and "--eval-corpus or --eval-split all" in row["verdict"]


def patterns_table(semantic_top, control_top, control_low, recall=0.8, n=200, shallow_low=0.3):
    return pd.DataFrame({"layer": [0, 1], "keys_shallow": [0.5, 0.1], "keys_both": [0.0, 0.0],
                         "keys_semantic": [0.1, semantic_top], "keys_none": [0.4, 0.9 - semantic_top],
                         "n_keys": [n, n], "n_dead": [3, 0], "semantic_recall": [recall, recall],
                         "keys_any_shallow_control": [0.1, 0.1], "keys_any_semantic_control": [0.04, control_top],
                         "keys_any_semantic_minus_control": [0.06, semantic_top - control_top],
                         "keys_any_semantic_minus_control_ci_low": [0.01, control_low],
                         "keys_any_semantic_minus_control_ci_high": [0.1, 0.3],
                         "keys_any_shallow_minus_control": [0.4, 0.0], "keys_any_shallow_minus_control_ci_low": [
                             shallow_low, -0.05], "keys_any_shallow_minus_control_ci_high": [0.5, 0.05]})


def test_figure_2_is_read_against_random_key_directions_and_the_labelers_recall():
    assert by_figure(fidelity({"patterns": patterns_table(0.3, 0.05, 0.1)}))["Figure 2"] is True
    # More semantic keys at the top than at the bottom, but no more than random directions give there.
    assert by_figure(fidelity({"patterns": patterns_table(0.3, 0.28, -0.05)}))["Figure 2"] is False
    # Shallow keys at the bottom, but random directions of layer 1 end their prefixes alike as often (stories260K).
    assert by_figure(fidelity({"patterns": patterns_table(0.3, 0.05, 0.1, shallow_low=-0.02)}))["Figure 2"] is False
    row = fidelity({"patterns": patterns_table(0.3, 0.05, 0.1, recall=0.06)}).set_index("figure").loc["Figure 2"]
    assert pd.isna(row["reproduces"]) and "finds only 6.0% of planted topics" in row["verdict"]
    no_control = patterns_table(0.3, 0.05, 0.1).drop(columns=[c for c in patterns_table(0, 0, 0) if "control" in c])
    row = fidelity({"patterns": no_control}).set_index("figure").loc["Figure 2"]
    assert pd.isna(row["reproduces"]) and "no random-key control" in row["verdict"]
    assert "dead keys left out: 3" in row["measured"]
