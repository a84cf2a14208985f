"""Tables as a person reads them, for the report and the explorer alike.

A metrics table holds 0-based layers, token ids, shares in [0, 1] and lists; a reader
wants layers counted from 1, token text, percentages and no columns that mean nothing
out of context. `table_view` makes that reading from a DataFrame, `table_html` renders it
(escaped), so both surfaces show a table the same way.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import numpy as np
import pandas as pd
from markupsafe import Markup

from ffkv.presentation.style import layer_number, number, percent, token_html, visible

#: Column names whose values are shares in [0, 1], shown as percentages.
SHARE_WORDS = ("rate", "share", "agreement", "agrees", "confidence", "kept", "override", "composition",
               "reproduc", "frequency", "prob")
SHARE_PREFIXES = ("keys_", "prefixes_", "share_")
#: Columns that identify a row of a table but say nothing to a reader of a summary.
ID_COLUMNS = ("example_id", "position", "removed_index", "rank", "seed")
#: Suffixes of the bounds of a column's 95% interval (X, X_ci_low, X_ci_high), shown in X's cell.
INTERVAL_SUFFIXES = ("_ci_low", "_ci_high")


@dataclass
class Column:
    name: str
    title: str
    num: bool = False


@dataclass
class Cell:
    text: str
    cls: str = ""
    token: bool = False
    href: str | None = None
    interval: str = ""  # "[low, high]" of the value's 95% interval, shown under it


@dataclass
class TableView:
    columns: list[Column]
    rows: list[list[Cell]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # columns left out (lists, ids with a text twin)


def is_share(name: str) -> bool:
    """Whether a column name says its values are shares in [0, 1]."""
    low = name.lower()
    return low.startswith(SHARE_PREFIXES) or any(w in low for w in SHARE_WORDS)


def _is_list(series: pd.Series) -> bool:
    return series.dtype == object and series.map(lambda v: isinstance(v, (list, tuple, np.ndarray))).any()


def _is_text_list(series: pd.Series) -> bool:
    """A column of short lists of strings (e.g. a key's first trigger prefixes): shown joined."""
    return _is_list(series) and series.map(
        lambda v: isinstance(v, (list, tuple, np.ndarray)) and len(v) <= 10 and all(isinstance(x, str) for x in v)).all()


def _cell(name: str, value, token: Callable[[int], str] | None, token_columns: set[str]) -> Cell:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return Cell("", "num")
    if name == "layer":
        return Cell(str(layer_number(int(value))), "num")
    if isinstance(value, (list, tuple, np.ndarray)):
        return Cell(" · ".join(visible(str(x)) for x in value), "")
    if isinstance(value, (bool, np.bool_)):
        return Cell("yes" if value else "no", "yes" if value else "no")
    if name.endswith("rank") and isinstance(value, (int, np.integer)) and value < 0:
        return Cell("none", "num")  # -1 marks "no such rank" in the run's tables
    if name in token_columns:
        if token is not None and isinstance(value, (int, np.integer)):
            return Cell(token(int(value)), "", token=True)
        return Cell(str(value), "", token=True)
    if isinstance(value, (int, float, np.integer, np.floating)):
        if is_share(name) and not isinstance(value, (int, np.integer)) and -1.0001 <= float(value) <= 1.0001:
            return Cell(percent(value), "num")
        return Cell(number(value), "num")
    return Cell(visible(str(value)), "")  # token text inside (a rule, a value's top tokens): no invisible bytes


def interval_columns(table: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """Columns X whose 95% interval the table holds as X_ci_low and X_ci_high -> those two names."""
    low, high = INTERVAL_SUFFIXES
    return {c: (c + low, c + high) for c in table.columns if c + low in table.columns and c + high in table.columns}


def _with_interval(cell: Cell, low: Cell, high: Cell) -> Cell:
    """A value's cell with its interval: 5.2% and [4.0%, 6.7%] (the value alone where a bound is missing)."""
    if cell.text and low.text and high.text:
        cell.interval = f"[{low.text}, {high.text}]"
    return cell


def token_id_columns(table: pd.DataFrame) -> dict[str, str]:
    """Integer columns that hold token ids (NAME_id of a token) -> the text column beside them, or ''."""
    out = {}
    for c in table.columns:
        if c.endswith("_id") and c not in ("example_id",) and pd.api.types.is_integer_dtype(table[c]):
            twin = c[:-3]
            out[c] = twin if twin in table.columns else ""
    return out


def title_of(name: str) -> str:
    return name.replace("_", " ")


def table_view(table: pd.DataFrame, token: Callable[[int], str] | None = None,
               titles: Mapping[str, str] | None = None, drop: Iterable[str] = (),
               links: Mapping[str, Callable[[Mapping], str]] | None = None) -> TableView:
    """A DataFrame as a person reads it: layers from 1, token text for token ids, percentages for shares,
    yes/no for booleans, a value's 95% interval in its own cell (X with X_ci_low and X_ci_high: one
    column, 5.2% over [4.0%, 6.7%]); list columns and token-id columns that have a text twin are left out.

    Args:
        token: token id -> text; without it, token ids with no text twin are left out too.
        titles: column name -> header (default: the name with spaces).
        drop: columns to leave out.
        links: column name -> function of the row giving the cell's link.
    """
    titles = dict(titles or {})
    ids = token_id_columns(table)
    dropped = [c for c in table.columns if c in set(drop) or (_is_list(table[c]) and not _is_text_list(table[c]))
               or (c in ids and (ids[c] or token is None))]
    intervals = {c: bounds for c, bounds in interval_columns(table).items() if c not in dropped}
    inside = {b for bounds in intervals.values() for b in bounds}  # shown in their value's cell
    keep = [c for c in table.columns if c not in dropped and c not in inside]
    token_columns = {c for c in keep if c in ids} | {t for t in ids.values() if t}
    columns = [Column(c, titles.get(c, title_of(c[:-3] if c in ids else c)) + (" (95% CI)" if c in intervals else ""),
                      pd.api.types.is_numeric_dtype(table[c]) and not pd.api.types.is_bool_dtype(table[c])
                      and c not in ids) for c in keep]
    rows = []
    for record in table[keep + sorted(inside)].to_dict("records"):
        row = []
        for c in keep:
            cell = _cell(c, record[c], token, token_columns)
            if c in intervals:
                low, high = (_cell(c, record[b], token, token_columns) for b in intervals[c])
                cell = _with_interval(cell, low, high)
            if links and c in links:
                cell.href = links[c](record)
            row.append(cell)
        rows.append(row)
    return TableView(columns, rows, dropped)


def table_html(view: TableView, id: str | None = None, cls: str = "", root: str = "") -> Markup:
    """A `TableView` as an escaped HTML table."""
    head = "".join(f'<th class="num">{html.escape(c.title)}</th>' if c.num else f"<th>{html.escape(c.title)}</th>"
                   for c in view.columns)
    body = []
    for row in view.rows:
        cells = []
        for cell in row:
            if cell.token:
                inner = str(token_html(cell.text))
            else:
                inner = html.escape(cell.text)
            if cell.href:
                inner = f'<a href="{html.escape(root + cell.href)}">{inner}</a>'
            if cell.interval:
                inner += f'<span class="ci">{html.escape(cell.interval)}</span>'
            cells.append(f'<td class="{cell.cls}">{inner}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    attrs = (f' id="{html.escape(id)}"' if id else "") + (f' class="{html.escape(cls)}"' if cls else "")
    return Markup(f"<table{attrs}><tr>{head}</tr>{''.join(body)}</table>")
