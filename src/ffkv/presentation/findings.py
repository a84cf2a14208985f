"""The one table of the paper's findings: for each figure and table of `ffkv analyze`, what the paper
found, and a one-line reading of this model's numbers.

Keys are the names of RUN/figures/NAME.* and RUN/metrics/NAME.parquet; the report (and the
explorer's overview) puts each finding next to the figure of the same name (`paper_finding`:
the exact name, else the longest key the name starts with).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
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
    "values_negative": {"figure": "Figure 4", "finding": (
        "(Not in the paper, whose ReLU coefficients are never negative.) The same agreement for the most negative "
        "trigger examples: the top token of p(-v_i), what a negative coefficient writes, against the next token "
        "of the key's most negative trigger example.")},
    "values_negative_rank": {"figure": "Figure 5", "finding": (
        "(Not in the paper.) The rank of the most negative trigger example's next token in p(-v_i).")},
    "values_confident": {"figure": "Table 2", "finding": (
        "Of the 100 most confident values (highest max p), almost half have a top trigger example whose next "
        "token is the value's top token.")},
    "composition": {"figure": "Figure 8", "finding": (
        "In at least ~68% of examples in every layer, the FF layer's top prediction differs from that of every "
        "active memory: the output is a composition. The matching cases are mostly stop words.")},
    "composition_active": {"figure": "Figure 7", "finding": (
        "Hundreds of the 4,096 memories of a layer are active (m > 0) for one prefix, with a drop around "
        "layer 10.")},
    "composition_tau": {"figure": "Figure 7", "finding": (
        "(Not in the paper, whose ReLU coefficients are zero when inactive.) For signed coefficients 'active' needs a "
        "threshold |m_i| > tau·s_l: the share counted active and the share of the FF output the others write, over "
        "tau; the verdict of Figure 7 uses the rule's tau.")},
    "composition_scale": {"figure": "Figure 7", "finding": (
        "(Not in the paper.) s_l, the scale of the active rule, per layer, with the positions that carry massive "
        "activations (Sun et al. 2024) left out, beside what every position would give.")},
    "composition_massive": {"figure": "Figure 7", "finding": (
        "(Not in the paper.) Positions whose coefficients are massive (their RMS more than 20 times the median "
        "position's; Sun et al. 2024 found such first-token outliers in most large models): named, and left out of "
        "the active rule's scale.")},
    "census_control": {"figure": "Voita et al. 2023", "finding": (
        "(Not in the paper.) Each census class beside the same rules applied to random key directions of the layer: "
        "a class is a finding about trained keys only where it is more common among them.")},
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
    "membership": {"figure": "Section 8", "finding": (
        "(Beyond the paper, which names it as future work.) Memories that store training text should fire "
        "differently on training examples than on unseen ones: a membership signal, compared here with the "
        "standard loss-based baseline on the same examples.")},
    "refinement_last_layer": {"figure": "Table 3", "finding": (
        "Examples where the last layer changes the residual's prediction: often to a related token or a "
        "compromise, for reading.")},
    # Beyond the paper (SPEC section 9): the references' findings, not the paper's.
    "census": {"figure": "Voita et al. 2023", "finding": (
        "(Not in the paper.) In OPT models over 70% of the neurons of some early layers never activate; many live "
        "early-layer neurons detect a token or n-gram and their values remove that token from the residual "
        "stream; some fire by position alone.")},
    "census_values": {"figure": "Gurnee et al. 2024", "finding": (
        "(Not in the paper.) In GPT-2, prediction neurons (the value pushes a few tokens up) rise in later "
        "layers and suppression neurons (a few tokens pushed down) take over in the last layers.")},
    "suppressed": {"figure": "Beyond the paper", "finding": (
        "(Not in the paper, which names it as open.) Where the model's prediction is wrong, how often an active "
        "memory's own sub-update ranked the gold next token first, and how much it moved the gold token's "
        "probability.")},
    "pruning": {"figure": "Beyond the paper", "finding": (
        "(Not in the paper, which leaves pruning open.) Held-out perplexity as a growing share of every layer's "
        "keys is removed, one curve per criterion; the seeded random removal is the baseline a criterion must "
        "beat.")},
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


def _share_ci(share: float, n) -> str:
    """"57.0% (95% CI 54.0-60.0%, n = 1,024)"."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return _pct(share)
    lo, hi = wilson_interval(float(share) * int(n), int(n))
    return f"{_pct(share)} (95% CI {_pct(float(lo))}-{_pct(float(hi))}, n = {int(n):,})"


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
    if name == "membership" and "auc" in t and "loss_auc" in t:
        best = t.loc[(t["auc"] - 0.5).abs().idxmax()]
        n = f"n = {int(first.n_member):,} training + {int(first.n_nonmember):,} held-out examples"
        return (f"In this model the coefficient statistic's ROC AUC is furthest from 0.5 in layer "
                f"{layer_number(best.layer)}: {best.auc:.3f} (95% DeLong CI {best.auc_ci_low:.3f}-"
                f"{best.auc_ci_high:.3f}); the loss baseline's AUC is {first.loss_auc:.3f} "
                f"({first.loss_auc_ci_low:.3f}-{first.loss_auc_ci_high:.3f}); {n}.")
    if name == "values" and "agreement_rate" in t:
        n = "n_keys_with_target" if "n_keys_with_target" in t else "n_keys" if "n_keys" in t else None
        control = (f"; random key directions with the same values agree in {_pct(first.agreement_rate_control)} "
                   f"({n_first}) and {_pct(last.agreement_rate_control)} ({n_last})"
                   if "agreement_rate_control" in t else "")
        return (f"In this model the agreement rate goes from {_share_ci(first.agreement_rate, first[n] if n else None)} "
                f"in {n_first} to {_share_ci(last.agreement_rate, last[n] if n else None)} in {n_last} "
                f"(n: keys whose top trigger has a next token); chance is {_pct(first.chance_rate)} (1/|V|), "
                f"{_pct(t['chance_rate_shuffled'].mean())} for shuffled pairs{control}.")
    if name == "composition" and "composition_rate" in t:
        low = t.loc[t["composition_rate"].idxmin()]
        n = low["n_examples"] if "n_examples" in t else None
        out = (f"In this model the FF output's top token differs from every active memory's in "
               f"{_pct(t['composition_rate'].min())}-{_pct(t['composition_rate'].max())} of examples per layer; "
               f"the lowest, layer {layer_number(low.layer)}: {_share_ci(low.composition_rate, n)}")
        if "composition_rate_chance" in t:
            out += (f"; with another example's FF output (chance) "
                    f"{_pct(t['composition_rate_chance'].min())}-{_pct(t['composition_rate_chance'].max())}")
        if "mean_active" in t:
            of = f" of {int(first.d_m):,}" if "d_m" in t else ""
            out += f"; {t['mean_active'].min():.0f}-{t['mean_active'].max():.0f}{of} memories are active on average"
            if "mean_negative" in t and t["mean_negative"].max() > 0:
                out += (f" ({t['mean_positive'].min():.0f}-{t['mean_positive'].max():.0f} with m > 0, "
                        f"{t['mean_negative'].min():.0f}-{t['mean_negative'].max():.0f} with m < 0)")
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
    if name == "census" and {"class", "key"} <= set(t.columns):
        def share(kind: str, g: pd.DataFrame) -> str:
            return _share_ci(float((g["class"] == kind).mean()), len(g))
        lo, hi = t[t["layer"] == first.layer], t[t["layer"] == last.layer]
        return (f"In this model {share('dead', lo)} of the keys of {n_first} are dead and {share('detector', lo)} "
                f"are token or n-gram detectors; in {n_last}: dead {share('dead', hi)}, detectors "
                f"{share('detector', hi)} (n: keys per layer; positions: every token of the held-out sample).")
    if name == "suppressed" and "suppressed_rate" in t:
        top = t.loc[t["suppressed_rate"].idxmax()]
        return (f"In this model, where the prediction is wrong, an active memory's sub-update ranks the gold token "
                f"first in {_share_ci(first.suppressed_rate, first.n_wrong)} of examples in {n_first} and "
                f"{_share_ci(last.suppressed_rate, last.n_wrong)} in {n_last} (highest: layer "
                f"{layer_number(top.layer)}, {_pct(top.suppressed_rate)}).")
    if name == "patterns" and "keys_shallow" in t:
        n = "n_keys" if "n_keys" in t else None

        def shares(row) -> str:
            return (f"{_share_ci(row.keys_shallow + row.keys_both, row[n] if n else None)} of keys have a shallow "
                    f"pattern ({_pct(row.keys_shallow)} shallow only, {_pct(row.keys_both)} both) and "
                    f"{_pct(row.keys_semantic + row.keys_both)} a semantic one ({_pct(row.keys_semantic)} semantic "
                    f"only)")
        out = f"In this model, in {n_first}, {shares(first)}; in {n_last}, {shares(last)}"
        if "keys_any_semantic_control" in t:
            out += (f". Random key directions of the same layers: a shallow pattern in "
                    f"{_pct(first.keys_any_shallow_control)} and {_pct(last.keys_any_shallow_control)}, a semantic one "
                    f"in {_pct(first.keys_any_semantic_control)} and {_pct(last.keys_any_semantic_control)} (the "
                    "semantic label admits at most 5% of them by construction)")
        if "n_dead" in t and int(t["n_dead"].sum()):
            out += f"; {int(t['n_dead'].sum()):,} dead keys are left out"
        return out + "."
    return None


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


def _first_last(t: pd.DataFrame, column: str) -> tuple[float, float]:
    t = t.sort_values("layer")
    return float(t[column].iloc[0]), float(t[column].iloc[-1])


def _points(x: float) -> str:
    """A difference of shares in percentage points."""
    return f"{100 * x:+.1f} points"


def _diff(row, column: str, against: str = "chance") -> str:
    """"observed - chance +3.1 points (95% CI +1.0 to +5.2)" of a per-layer row."""
    d = f"{column}_minus_{against}"
    return (f"{_points(row[d])} (95% CI {_points(row[d + '_ci_low'])} to {_points(row[d + '_ci_high'])})"
            if d in row and np.isfinite(row[d]) else "n/a")


def _n_of(t: pd.DataFrame, *columns: str) -> int | None:
    """The smallest n over the table's layers, from the first of `columns` it has."""
    for c in columns:
        if c in t and len(t):
            return int(pd.to_numeric(t[c]).min())
    return None


def _row(key: str, figure: str, measured: str, rule: str, ok: bool, n: int | None, chance: str = "",
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


def _rows_for(name: str, t: pd.DataFrame, projection: str, label: str = "") -> list[dict]:
    """Fidelity rows for one per-layer table: what it measured, its chance or control level, the rule and the
    verdict (`_row`)."""
    rows: list[dict] = []
    tt = t.sort_values("layer").reset_index(drop=True)
    L = len(t)
    first, last = (tt.iloc[0], tt.iloc[-1]) if L else (None, None)
    if name == "patterns" and {"keys_shallow", "keys_semantic", "keys_both"} <= set(t.columns):
        sh = tt["keys_shallow"] + tt["keys_both"]
        se = tt["keys_semantic"] + tt["keys_both"]
        controlled = "keys_any_semantic_minus_control" in tt
        rule = ("the shallow share of live keys is larger in layer 1 than in the top layer, and the semantic share "
                "larger in the top layer than in layer 1")
        ok = bool(sh.iloc[0] > sh.iloc[-1] and se.iloc[-1] > se.iloc[0])
        chance, blocked = "", None
        if controlled:
            rule += (", and layer 1's shallow share and the top layer's semantic share each lie above their random "
                     "key directions' (95% interval of the difference above 0)")
            ok = ok and float(last["keys_any_semantic_minus_control_ci_low"]) > 0
            if "keys_any_shallow_minus_control_ci_low" in tt:
                ok = ok and float(first["keys_any_shallow_minus_control_ci_low"]) > 0
            chance = (f"random key directions: shallow {_pct(first.keys_any_shallow_control)} (layer 1), semantic "
                      f"{_pct(last.keys_any_semantic_control)} (layer {L}); layer 1's shallow share minus theirs "
                      f"{_diff(first, 'keys_any_shallow', 'control')}, top layer's semantic share minus theirs "
                      f"{_diff(last, 'keys_any_semantic', 'control')}")
        else:
            blocked = "no verdict: the run holds no random-key control (index again with ffkv's current version)"
        recall = float(last["semantic_recall"]) if "semantic_recall" in tt else math.nan
        if blocked is None and np.isfinite(recall) and recall < MIN_SEMANTIC_RECALL:
            blocked = (f"no verdict: on this corpus the semantic labeler finds only {_pct(recall)} of planted topics "
                       f"at the top layer's cut-off (its calibration); a 'no' would say little")
        dead = f"; dead keys left out: {int(tt['n_dead'].sum()):,}" if "n_dead" in tt else ""
        rows.append(_row("patterns", "Figure 2",
                         f"shallow keys (labelled shallow or both) {_pct(sh.iloc[0])} (layer 1) -> {_pct(sh.iloc[-1])} (layer {L}); semantic "
                         f"(semantic or both) {_pct(se.iloc[0])} -> {_pct(se.iloc[-1])}{dead}", rule, ok,
                         _n_of(tt, "n_keys"), chance, "live keys", blocked))
    if name == "ablations" and {"mean_change_last", "mean_change_first", "mean_change_random"} <= set(t.columns):
        last_, first_, rand = (float(t[c].mean()) for c in ("mean_change_last", "mean_change_first",
                                                              "mean_change_random"))
        rows.append(_row("ablations", "Figure 3",
                         f"mean change removing the last token {_pct(last_)}, the first {_pct(first_)}, a random one "
                         f"{_pct(rand)} (mean over layers)",
                         "removing the last token lowers the coefficient more than removing the first or a random one "
                         "(means over layers)", bool(last_ < first_ and last_ < rand), _n_of(tt, "n_last"),
                         "removing the first or a random token is the comparison", "trigger prefixes"))
    if name == "values" and {"agreement_rate", "chance_rate_shuffled"} <= set(t.columns):
        a0, a1 = _first_last(t, "agreement_rate")
        low = float(last["agreement_rate_ci_low"]) if "agreement_rate_ci_low" in tt else a1
        chance_level = max(float(t["chance_rate_shuffled"].max()), float(t["chance_rate"].max()))
        rule = ("the top layer's agreement exceeds layer 1's, and its 95% interval lies above chance (1/|V| and "
                "shuffled pairs)")
        ok = bool(a1 > a0 and low > chance_level)
        chance = f"chance at most {_pct(chance_level)} (1/|V|, shuffled pairs)"
        if "agreement_rate_minus_control" in tt:
            rule += ", and above the random key directions' agreement (95% interval of the difference above 0)"
            ok = ok and float(last["agreement_rate_minus_control_ci_low"]) > 0
            chance += (f"; random key directions {_pct(last.agreement_rate_control)} in layer {L}, difference "
                       f"{_diff(last, 'agreement_rate', 'control')}")
        rows.append(_row("values", "Figure 4", f"agreement {_pct(a0)} (layer 1) -> {_pct(a1)} (layer {L}); top "
                         f"layer's 95% interval from {_pct(low)}", rule, ok,
                         _n_of(tt, "n_keys_with_target", "n_keys"), chance, "keys"))
    if name == "values" and "rank_median" in t:
        r0, r1 = _first_last(t, "rank_median")
        rule = "the median rank of the trigger's next token is lower in the top layer than in layer 1"
        ok, chance = bool(r1 < r0), ""
        if "rank_median_control" in tt and np.isfinite(float(last["rank_median_control"])):
            rule += ", and lower than the random key directions' median rank there"
            ok = ok and r1 < float(last["rank_median_control"])
            chance = f"random key directions: median rank {float(last['rank_median_control']):g} in layer {L}"
        rows.append(_row("values_rank", "Figure 5", f"median rank {r0:g} (layer 1) -> {r1:g} (layer {L})", rule, ok,
                         _n_of(tt, "n_keys_with_target", "n_keys"), chance, "keys"))
    if name == "values_confident" and "any_trigger_agrees" in t:
        share = float(t["any_trigger_agrees"].mean()) if len(t) else math.nan
        rows.append(_row("values_confident", "Table 2", f"{_pct(share)} of the {len(t)} most confident values",
                         "at least a quarter of the most confident values have a trigger example whose target is the "
                         "value's top token (paper: almost half)", bool(share >= 0.25), None))
    if name == "composition" and "share_active" in t:
        low, high = float(t["share_active"].min()), float(t["share_active"].max())
        rows.append(_row("composition_active", "Figure 7", f"{_pct(low)}-{_pct(high)} of the memories active per layer",
                         "a minority of memories is active: under 50% of the layer's memories on average in every layer "
                         "(paper: hundreds of 4,096, 2-10%)", bool(high < 0.5), _n_of(tt, "n_examples")))
    if name == "composition" and "composition_rate" in t:
        low = float(t["composition_rate"].min())
        rule = ("the FF output's top token differs from every active memory's in at least 68% of examples in every "
                "layer (the paper's lowest layer)")
        ok, chance = bool(low >= 0.68), ""
        if "composition_rate_minus_chance" in tt:
            rule += (", and in no layer is it a single memory's more often than an unrelated example's top token would "
                     "be (the 95% interval of observed - chance reaches 0 or above)")
            ok = ok and bool((tt["composition_rate_minus_chance_ci_high"] >= 0).all())
            worst = tt.loc[tt["composition_rate_minus_chance"].idxmin()]
            chance = (f"chance {_pct(tt['composition_rate_chance'].min())}-{_pct(tt['composition_rate_chance'].max())}"
                      f" per layer (FF output of another example); observed - chance lowest in layer "
                      f"{layer_number(worst.layer)}: {_diff(worst, 'composition_rate')}")
        rows.append(_row("composition", "Figure 8", f"composition in {_pct(low)}-{_pct(t['composition_rate'].max())} "
                         "of examples per layer", rule, ok, _n_of(tt, "n_examples"), chance))
    if name == "refinement" and "residual_agreement" in t:
        a0, a1 = _first_last(t, "residual_agreement")
        separated = ("residual_agreement_ci_high" not in t
                     or float(last["residual_agreement_ci_low"]) > float(first["residual_agreement_ci_high"]))
        rule = "the top layer's residual agreement exceeds layer 1's, the 95% intervals apart"
        ok, chance = bool(a1 > a0 and separated), ""
        if "residual_agreement_minus_chance" in tt:
            rule += ", and lies above chance there (95% interval of observed - chance above 0)"
            ok = ok and float(last["residual_agreement_minus_chance_ci_low"]) > 0
            chance = (f"chance {_pct(first.residual_agreement_chance)} (layer 1), "
                      f"{_pct(last.residual_agreement_chance)} (layer {L}; another example's final prediction); "
                      f"top layer observed - chance {_diff(last, 'residual_agreement')}")
        rows.append(_row("refinement_agreement", "Figure 9",
                         f"residual agreement {_pct(a0)} (layer 1) -> {_pct(a1)} (layer {L})", rule, ok,
                         _n_of(tt, "n_examples"), chance))
    if name == "refinement" and "mean_confidence" in t:
        c0, c1 = _first_last(t, "mean_confidence")
        rule = "the residual's mean probability of the final prediction is higher in the top layer than in layer 1"
        ok, chance = bool(c1 > c0), ""
        if "mean_confidence_minus_chance" in tt:
            rule += ", and above chance there (95% interval of observed - chance above 0)"
            ok = ok and float(last["mean_confidence_minus_chance_ci_low"]) > 0
            chance = (f"chance {float(last.mean_confidence_chance):.3f} in layer {L} (another example's final "
                      "prediction)")
        rows.append(_row("refinement_confidence", "Figure 10",
                         f"mean p(final prediction) {c0:.3f} (layer 1) -> {c1:.3f} (layer {L})", rule, ok,
                         _n_of(tt, "n_examples"), chance))
    if name == "refinement" and {"kept", "override", "composition"} <= set(t.columns):
        kept = float(t["kept"].min())
        over, comp = float(t["override"].mean()), float(t["composition"].mean())
        chance = ""
        if "override_chance" in tt:
            chance = (f"override at chance {_pct(float(tt['override_chance'].mean()))} on average (another example's "
                      f"FF prediction); observed - chance in layer {L}: {_diff(last, 'override')}")
        rows.append(_row("refinement", "Figure 11",
                         f"kept in at least {_pct(kept)} per layer; on average override {_pct(over)}, composition "
                         f"{_pct(comp)}",
                         "the residual's prediction is kept in at least half the examples in every layer, and where it "
                         "changes, a compromise (y ∉ {r, f}) is at least as common as the FF's own prediction",
                         bool(kept >= 0.5 and comp >= over), _n_of(tt, "n_examples"), chance))
    out = []
    for row in rows:
        key = row.pop("key")
        out.append({**row, "figure": row["figure"] + label, "finding": PAPER_FINDINGS[key]["finding"], "table": name,
                    "projection": projection})
    return out


def fidelity(tables: Mapping[str, pd.DataFrame], projections: Mapping[str, str] | None = None) -> pd.DataFrame:
    """metrics/fidelity.parquet: one row per finding of the paper that this model's tables measure.

    Args:
        tables: metrics tables by name (any of patterns, ablations, values, values_confident, composition,
            refinement, refinement_projections); the others are ignored.
        projections: table name -> the projection its numbers were read under (for the `projection` column).

    Each row: the paper's `figure` and `finding`, what this model `measured`, its `chance` or control level
    (a permutation chance level or the random key directions, SPEC section 3 Controls), the `rule` that decides
    whether it reproduces (stated with the row, so that a reader can disagree with it), the `verdict` (yes, no,
    or why none is given: fewer than `MIN_VERDICT_N` examples or keys, no control, a detector with too little
    recall), `reproduces` (True, False, or null without a verdict), the smallest `n` over the layers read, the
    `table` it was read from and the `projection`. Figures 9-11 are also given under the other residual
    projection, from refinement_projections, labelled with it.
    """
    projections = dict(projections or {})
    rows: list[dict] = []
    for name in ("patterns", "ablations", "values", "values_confident", "composition", "refinement"):
        t = tables.get(name)
        if t is not None and len(t):
            rows += _rows_for(name, t, projections.get(name, ""))
    both = tables.get("refinement_projections")
    if both is not None and len(both) and "projection" in both:
        chosen = projections.get("refinement")
        for projection, t in both.groupby("projection", sort=True):
            if projection == chosen:
                continue
            choice = str(t["choice"].iloc[0]) if "choice" in t else projection
            for row in _rows_for("refinement", t.drop(columns=["projection", "choice"], errors="ignore"), projection,
                                 f" ({choice}: {projection} projection)"):
                rows.append({**row, "table": "refinement_projections"})
    table = pd.DataFrame(rows, columns=list(FIDELITY_COLUMNS))
    table["reproduces"] = table["reproduces"].astype("boolean")
    table["n"] = table["n"].astype("Int64")
    return table
