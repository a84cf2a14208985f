"""Tables as a person reads them: layers from 1, token text for ids, percentages for shares, no noise columns."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ffkv.presentation.style import number, percent, token_html, visible
from ffkv.presentation.tables import table_html, table_view


def test_table_view_reads_as_a_person_would():
    table = pd.DataFrame({
        "layer": np.array([0, 5], dtype=np.int16), "agreement_rate": [0.035, 0.5], "ff_top_id": [7, 9],
        "top_token_id": [1, 2], "top_token": [" the", " of"], "agrees": [True, False],
        "token_ids": [np.array([1, 2]), np.array([3])], "prefixes": [["a b", "c"], ["d"]],
        "first_agreeing_rank": [3, -1], "mean_entropy": [4.5731, 2.0]})
    view = table_view(table, token=lambda i: f"tok{i}")
    titles = [c.title for c in view.columns]
    assert titles == ["layer", "agreement rate", "ff top", "top token", "agrees", "prefixes", "first agreeing rank",
                      "mean entropy"]
    assert view.dropped == ["top_token_id", "token_ids"]
    first, second = ([c.text for c in row] for row in view.rows)
    assert first == ["1", "3.5%", "tok7", " the", "yes", "a b · c", "3", "4.573"]
    assert second[0] == "6" and second[4] == "no" and second[6] == "none"
    html = table_html(view)
    assert '<span class="tok">tok7</span>' in html and "<td class=\"yes\">yes</td>" in html
    # Without a tokenizer, token ids that have no text beside them are left out rather than shown as numbers.
    assert "ff top" not in [c.title for c in table_view(table).columns]


def test_small_shares_keep_their_digits():
    assert percent(0.00031) == "0.031%" and percent(0.5) == "50.0%" and percent(0) == "0.0%"
    assert percent(0.00031, 2) == "0.03%" and percent(None) == ""


def test_numbers_never_read_in_scientific_notation_below_a_billion():
    assert number(2360.5) == "2,360" and number(1062.25) == "1,062" and number(-1234.56) == "-1,235"
    assert number(2290.0) == "2,290" and number(5.9) == "5.900" and number(3e9) == "3e+09"


def test_control_characters_of_a_token_are_visible():
    assert visible("\x00") == "<0x00>" and visible("\x1f") == "<0x1F>" and visible("\x7f") == "<0x7F>"
    assert visible(" a\n\tb") == " a↵⇥b" and visible(None) == ""
    assert str(token_html("\x00<")) == '<span class="tok">&lt;0x00&gt;&lt;</span>'


def test_control_characters_inside_text_cells_are_visible():
    """A census row's written tokens (" · "-joined text) and a list of prefixes hold token text too: a DEL or NUL
    byte there would be drawn as an empty box by the report's font, so every text cell shows it as its byte."""
    table = pd.DataFrame({"written_top": ["a · \x7f · b"], "prefixes": [["x\x00", "y\n"]]})
    (row,) = table_view(table).rows
    assert [c.text for c in row] == ["a · <0x7F> · b", "x<0x00> · y↵"]
    assert "&lt;0x7F&gt;" in table_html(table_view(table)) and "\x7f" not in table_html(table_view(table))


def test_an_interval_is_shown_in_its_values_cell():
    """X with X_ci_low and X_ci_high reads as one column, 5.2% over [4.0%, 6.7%], formatted as X is; a bound that
    is missing leaves the value alone, and bounds without their value stay columns of their own."""
    table = pd.DataFrame({"layer": [0, 1], "share_dead": [0.052, 0.001], "share_dead_ci_low": [0.04, np.nan],
                          "share_dead_ci_high": [0.067, 0.006], "auc": [0.513, 0.5], "auc_ci_low": [0.488, 0.45],
                          "auc_ci_high": [0.539, 0.55], "orphan_ci_low": [0.1, 0.2]})
    view = table_view(table)
    assert [c.title for c in view.columns] == ["layer", "share dead (95% CI)", "auc (95% CI)",
                                               "orphan ci low"]
    first, second = ([(c.text, c.interval) for c in row] for row in view.rows)
    assert first == [("1", ""), ("5.2%", "[4.0%, 6.7%]"), ("0.513", "[0.488, 0.539]"), ("0.100", "")]
    assert second[1] == ("0.1%", "") and second[2] == ("0.500", "[0.450, 0.550]")
    assert all(c.num for c in view.columns[1:3])
    assert '<td class="num">5.2%<span class="ci">[4.0%, 6.7%]</span></td>' in table_html(view)
    # Dropping the value drops its interval's merge: the bounds then stay as they are.
    assert [c.title for c in table_view(table, drop=["auc"]).columns][-3:] == ["auc ci low", "auc ci high",
                                                                                 "orphan ci low"]


def test_prose_sets_backticked_commands_as_code_and_escapes_the_rest():
    """A new user saw the report's "Skipped" note print its command between literal backticks."""
    from ffkv.presentation.style import with_code

    assert str(with_code("add with `ffkv analyze RUN --only pruning`, or <b>not</b>")) == \
        "add with <code>ffkv analyze RUN --only pruning</code>, or &lt;b&gt;not&lt;/b&gt;"
    assert str(with_code("`<script>`")) == "<code>&lt;script&gt;</code>"
    assert str(with_code("an unpaired ` stays")) == "an unpaired ` stays"
    assert str(with_code(None)) == ""
