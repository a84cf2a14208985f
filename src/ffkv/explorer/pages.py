"""Server-rendered HTML of the explorer's pages, from `ExplorerData` and traces.

The same functions render the pages of `ffkv serve` and the inline HTML of notebook
objects, so both show the same thing. Functions take 0-based layer indices (as the run's
tables); pages, links and URLs show layers counted from 1 (`layer_number`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jinja2
import pandas as pd
from markupsafe import Markup, escape

from ffkv.errors import FfkvError
from ffkv.explorer.beside import FIGURE as BESIDE_FIGURE, beside_of
from ffkv.explorer.charts import histogram_svg
from ffkv.explorer.data import ExplorerData
from ffkv.explorer.templates import TEMPLATES
from ffkv.explorer import validation
from ffkv.explorer.validation import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, BadRequest
from ffkv.experiments.census import CLASSES as CENSUS_CLASSES, VALUE_TYPES as CENSUS_VALUE_TYPES
from ffkv.experiments.patterns import CONTROL_PASS, SHALLOW_SHARE
from ffkv.experiments.semantic import SEMANTIC_Z
from ffkv.experiments.registry import key_columns, paper_finding, paper_order
from ffkv.memories.address import edit_label, whole_number
from ffkv.presentation.findings import finding_heading
from ffkv.presentation.style import CSS, layer_number, number, percent, token_html, visible
from ffkv.presentation.summary import NUMBERING, fidelity_view, manifest_summary, massive_view
from ffkv.presentation.tables import TableView, table_html, table_view
from ffkv.store.annotations import LABELS
from ffkv.store.integrity import file_problems
from ffkv.tools.matches import match_of

if TYPE_CHECKING:  # the model-side module imports torch; pages that read tables never need it
    from ffkv.explorer.latents import LatentData
    from ffkv.explorer.tracing import TraceResult

#: A cell of the intervention view is highlighted when its top token changes or its probability moves by this much.
CHANGE_THRESHOLD = 0.01
#: Layer page: rows per page.
PAGE_SIZE = 100
#: Search: memory chips shown before "more".
CHIPS_SHOWN = 5
SEARCH_LIMIT = 50


def heat_style(shade: float) -> str:
    """The inline style of a token shaded by a signed coefficient (shade = m / the key's largest |m|): the shade's
    opacity as the custom property ``--a``, which the page's CSS (`ffkv.presentation.style.CSS`, ``.tokens .t``)
    makes a blue background, red on a token of class ``neg`` (`heat_class`); "" for none. A memory page holds
    thousands of tokens: 16 bytes each, where a whole ``background: rgba(...)`` took 42."""
    if not shade or not math.isfinite(shade):
        return ""
    return f"--a:{min(1.0, abs(shade)) * 0.75:.2f}"


def heat_class(shade: float) -> str:
    """" neg" for a token shaded red (a negative coefficient, `heat_style`), else ""."""
    return " neg" if shade and math.isfinite(shade) and shade < 0 else ""


#: The title of a run of tokens whose coefficients the build did not store (outside the window around the trigger, or
#: an example beyond the strongest ranks stored); the note above the examples says which. Short: a page of 200
#: examples at an 8B model's shape holds about 400 of them.
OUTSIDE_TITLE = "no coefficient stored"


def strip_html(tokens: list[dict]) -> Markup:
    """A trigger example's tokens (`ExplorerData.memory`'s ``tokens``) as spans shaded by the key's coefficient:
    the trigger boxed, the next token underlined, the leading bytes of a split character narrow. Tokens whose
    coefficient was not stored (``outside`` the stored window) are shown as text, each run of them in one span
    marked ``nm`` (hatched: no coefficient, not m = 0). Built here rather than in a template: a memory page holds
    thousands of them."""
    out = ['<span class="tokens">']
    outside: list[str] = []  # the current run of tokens outside the stored window
    after = False

    def close_outside() -> None:
        if outside:
            out.append(f'<span class="nm{" after" if after else ""}" title="{OUTSIDE_TITLE}">'
                       f'{escape("".join(outside))}</span>')
            outside.clear()

    for t in tokens:
        if t.get("outside"):
            if outside and t["after"] != after:
                close_outside()
            after = t["after"]
            outside.append(visible(t["text"]))
            continue
        close_outside()
        if t.get("gap"):
            out.append(f'<span class="gap" title="{t["omitted"]:,} tokens not shown">…</span>')
            continue
        heat = heat_class(t["shade"])
        cls = "t" + (" trig" if t["trigger"] else "") + (" nx" if t["next"] else "") \
            + (" after" if t["after"] else "") + ("" if t["text"] else " part") + heat
        title = "" if t["m"] is None else \
            f' title="m = {number(t["m"], 3)}{"" if t["text"] else " (first bytes of the character that follows)"}"'
        text, style = visible(t["text"]), heat_style(t["shade"])
        style = f' style="{style}"' if style else ""
        body = text.lstrip()
        if body and body != text and (t["trigger"] or t["next"]):
            # A boxed or underlined token's leading space stays outside its mark: where the line wraps at that
            # space, the mark would otherwise leave an empty box at the end of the line.
            out.append(f'<span class="t{heat}"{style}>{escape(text[:len(text) - len(body)])}</span>')
            text = body
        out.append(f'<span class="{cls}"{style}{title}>{escape(text)}</span>')
    close_outside()
    out.append("</span>")
    return Markup("".join(out))


def memory_chip(mem: dict, root: str) -> Markup:
    """A link to a memory that an example triggers (LAYER:KEY, its coefficient, and the token it fired on where the
    search knows it), as search results show it; a latent's (``address``: t4:42) is marked as one, with its
    activation."""
    at = ""
    if mem.get("token") is not None:
        at = (f' <span class="small muted at" title="fired on token {int(mem["position"]) + 1} of the example">on'
              f'</span> {token_html(mem["token"])}')
    if mem.get("address"):
        return Markup(f'<a class="chip latent" href="{escape(root)}/memory/{escape(mem["address"])}" title="latent: rank '
                      f'{mem["rank"] + 1} of its trigger examples">{escape(mem["address"])} <span class="small muted">'
                      f'a={escape(number(mem["coefficient"], 2))}</span>{at}</a>')
    layer = layer_number(mem["layer"])
    return Markup(f'<a class="chip" href="{escape(root)}/memory/{layer}/{mem["key"]}" title="rank {mem["rank"] + 1} of '
                  f'this memory\'s trigger examples">{layer}:{mem["key"]} <span class="small muted">m='
                  f'{escape(number(mem["coefficient"], 2))}</span>{at}</a>')


def pages_nav(url: str, page: int, n_pages: int, element_id: str) -> Markup:
    """Links to the pages of a list (`url` with ``&page=N``): previous, the first and last three, those within three
    of this one, next; nothing for a list of one page."""
    if n_pages <= 1:
        return Markup("")
    link = lambda n, text: f'<a href="{escape(url)}&amp;page={n}">{text}</a>'  # noqa: E731
    parts = [link(page - 1, "← previous")] if page > 1 else []
    shown = [n for n in range(1, n_pages + 1) if n <= 3 or n > n_pages - 3 or abs(n - page) <= 3]
    for before, n in zip([0, *shown], shown):
        if n - before > 1:
            parts.append("…")
        parts.append(f"<strong>{n}</strong>" if n == page else link(n, str(n)))
    if page < n_pages:
        parts.append(link(page + 1, "next →"))
    return Markup(f'<p class="pages" id="{escape(element_id)}">{" ".join(parts)}</p>')


def value_format(value: float) -> str:
    """A probability or logit with three significant digits (0.000312, not 0.0003)."""
    return f"{value:.3g}"


ENV = jinja2.Environment(loader=jinja2.DictLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined,
                         trim_blocks=False)
ENV.globals.update(css=CSS, fmt=number, pct=percent, tok=token_html, ln=layer_number, heat=heat_style,
                   show=visible, value_fmt=value_format, table=table_html, strip=strip_html,
                   chip=memory_chip, heading=finding_heading, pages_nav=pages_nav)


def warm() -> None:
    """Compile the page templates (a process's first page would otherwise wait for them)."""
    for name in TEMPLATES:
        ENV.get_template(name)


def _common(data: ExplorerData, root: str) -> dict:
    latents = data.latents
    return {"root": root, "run_name": data.run.path.name, "has_report": data.run.report_path.exists(),
            "n_layers": data.n_layers, "d_m": data.d_m, "encoder": data.encoder, "has_latents": latents is not None,
            # the dictionaries' names (t4), linked beside the layers in every page's header
            "latent_layers": [latents.name(layer) for layer in latents.layers] if latents is not None else []}


def render(name: str, **context) -> str:
    return ENV.get_template(name).render(**context)


def error_page(status: int, reason: str, message: str, run_name: str = "", root: str = "", n_layers: int = 0) -> str:
    return render("error.html", status=status, reason=reason, message=message, run_name=run_name,
                  root=root, has_report=False, n_layers=n_layers)


def figures_of(data: ExplorerData) -> list[dict]:
    """Figures of `ffkv analyze` (PNG preferred, else SVG) with the paper's finding for each, in the paper's order;
    a figure whose bytes are not those recorded when it was drawn has ``problem`` (the line naming it and the
    command that draws it again) and is not shown."""
    problems = {p.path: p.line(data.run.path) for p in file_problems(data.run, data.run.manifest())}
    out = []
    for name, path in sorted(data.run.figure_names().items(), key=lambda item: paper_order(item[0])):
        finding = paper_finding(name)
        rel = path.relative_to(data.run.path).as_posix()
        out.append({"name": name, "path": rel, "problem": problems.get(rel),
                    "finding": finding.get("finding") if finding else None,
                    "paper_figure": finding.get("figure") if finding else None})
    return out


#: "Shallow keys" elsewhere (the fidelity table, the report) count the keys labelled shallow or both; here each
#: label's own share is shown, named so.
LAYER_SUMMARY_TITLES = {"keys": "keys", "keys_with_target": "keys with a target", "agreement_rate": "agreement",
                        "mean_activation_frequency": "active", "share_shallow": "shallow only",
                        "share_semantic": "semantic only", "share_both": "both (shallow and semantic)",
                        "share_none": "none", "annotated_keys": "annotated keys"}


def fidelity_of(data: ExplorerData) -> TableView | None:
    """The fidelity table (None before `ffkv analyze`), each row read from a table that is damaged or missing now
    marked so, with that table's file and the command that rewrites it (checked at each view: a table may be
    damaged after the explorer started)."""
    if not data.run.has_metric("fidelity"):
        return None
    table = data.run.read_metric("fidelity")
    manifest = data.run.manifest()
    unreadable = {}
    for name in table["table"].dropna().unique() if "table" in table.columns else ():
        found = data.run.table_problem(f"metrics/{name}.parquet", manifest)
        if found is not None:
            unreadable[str(name)] = found.line(data.run.path)
    return fidelity_view(table, unreadable)


def overview(data: ExplorerData, root: str = "") -> str:
    summary = data.layer_summary()
    layers = table_view(summary, titles=LAYER_SUMMARY_TITLES,
                        links={"layer": lambda r: f"/layer/{layer_number(r['layer'])}"})
    fidelity = fidelity_of(data)
    massive = massive_view(data.run.read_metric("composition_massive")) \
        if data.run.has_metric("composition_massive") else None
    positions = data.lookup_info.get("activation_sample", {}).get("positions", 0)
    figures = figures_of(data)
    beside = beside_of(data)
    # the forest figure of latents_beside is shown in its section, beside its table, not again among the figures
    beside_figure = next((f for f in figures if f["name"] == BESIDE_FIGURE), None) if beside is not None else None
    return render("overview.html", **_common(data, root), run_rows=manifest_summary(data.manifest),
                  numbering=NUMBERING, layers=layers, fidelity=fidelity, massive=massive,
                  figures=[f for f in figures if f is not beside_figure], has_labels=data.key_metrics is not None,
                  sample_positions=f"{positions:,}", uniform=1.0 / data.vocab_size,
                  dictionaries=data.latents.summary() if data.latents is not None else [],
                  beside=beside, beside_figure=beside_figure)


# ------------------------------------------------------------------------ layer page
#: Layer page columns: (column of `ExplorerData.layer_keys`, header, sort name in the URL or None). Columns a run
#: lacks (no census, no negative trigger examples) are left out.
LAYER_COLUMNS = (
    ("key", "key", "key"),
    ("label", "pattern", "pattern"),
    ("description", "description", "description"),
    # beside the description, where a reader sorting or filtering by the score sees them without scrolling
    ("explanation", "explanation", "explanation"),
    ("explanation_score", "explanation score", "explanation score"),
    ("shallow_score", "shallow score", "shallow score"),
    ("semantic_score", "semantic score", "semantic score"),
    ("top_tokens", "value's top tokens", "top token"),
    ("agreement", "agrees", "agreement"),
    ("activation_frequency", "active", "activation frequency"),
    ("top_coefficient", "largest m", "largest m"),
    ("negative_strength", "strength m < 0", "negative strength"),
    ("census_class", "census", "census"),
    ("census_value_type", "value type", "value type"),
    ("census_eraser", "eraser", "eraser"),
    ("census_two_way", "fires both ways", "both ways"),
    ("census_detects", "detects", "detects"),
    ("human_label", "human label", "human label"),
)
#: Layer page filter `?census=`: name -> (the column it keeps rows by, the value kept). Each filter's column is
#: shown (`LAYER_COLUMNS`), so what a filter keeps is what its column says (`ffkv.experiments.census`).
#: The census owns its vocabulary (`ffkv.experiments.census.CLASSES`, `VALUE_TYPES`); the page only names it.
CENSUS_FILTERS = {
    **{c: ("census_class", c) for c in CENSUS_CLASSES},
    **{v: ("census_value_type", v) for v in CENSUS_VALUE_TYPES},
    "eraser": ("census_eraser", True), "two_way": ("census_two_way", True),
}
#: How the filters are grouped and named on the page: (group title, [(filter, label)]).
CENSUS_FILTER_GROUPS = (("class", [(f, f) for f in CENSUS_CLASSES]),
                        ("value type", [(f, f) for f in CENSUS_VALUE_TYPES]),
                        ("", [("eraser", "eraser"), ("two_way", "fires both ways")]))
PERCENT_COLUMNS = {"shallow_score", "activation_frequency"}


def layer_columns() -> tuple[tuple[str, str, str], ...]:
    """`LAYER_COLUMNS` with the per-key columns the registered experiments declare (`ffkv.experiments.registry
    .KeyColumn`) before the human label."""
    declared = tuple((c.name, c.header, c.sort or c.header) for c in key_columns())
    return LAYER_COLUMNS[:-1] + declared + LAYER_COLUMNS[-1:]
FLAG_COLUMNS = {"agreement", "census_eraser", "census_two_way"}


def _min_score(text: str | None) -> float | None:
    """The layer page's ``min_score=`` (an explanation's simulation score, a correlation in [-1, 1]), or None."""
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"min_score must be a number from -1 to 1, got {text[:20]!r}", 422) from None
    if not -1 <= value <= 1:
        raise BadRequest(f"min_score must be a number from -1 to 1 (a correlation), got {text[:20]!r}", 422)
    return value


def _filtered(table: pd.DataFrame, census: str | None, min_score: float | None) -> pd.DataFrame:
    """The layer's keys kept by the page's filters: one census class, value type or flag (`CENSUS_FILTERS`), and
    an explanation score of at least `min_score` (`ffkv score`)."""
    if min_score is not None and ("explanation_score" not in table.columns or table["explanation_score"].isna().all()):
        raise BadRequest("no memory of this layer has a scored explanation: `ffkv explain RUN`, then `ffkv score RUN`",
                         404)
    if census:
        if census not in CENSUS_FILTERS:
            raise BadRequest(f"census filter must be one of {', '.join(CENSUS_FILTERS)}, got {census[:40]!r}", 422)
        if "census_class" not in table.columns:
            raise BadRequest("this run has no census yet: `ffkv analyze --only census`", 404)
        column, value = CENSUS_FILTERS[census]
        table = table[(table[column] == value).to_numpy(bool)]
    if min_score is not None:
        table = table[(table["explanation_score"] >= min_score).to_numpy(bool)]
    return table



def sorted_page(table: pd.DataFrame, column: str, order: str, page, what: str) -> tuple[pd.DataFrame, int, int]:
    """Rows `PAGE_SIZE` of a layer page's table sorted by `column` (`order` asc or desc; ties by key, missing
    values last): (those rows, the page as a number, the number of pages); a bad order or page is refused
    (`what` names the table in the message)."""
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be asc or desc, got {order[:20]!r}", 422)
    try:
        page = whole_number(page, "page must be a number")
    except FfkvError as exc:
        raise BadRequest(str(exc), 422) from None
    n_pages = max(1, math.ceil(len(table) / PAGE_SIZE))
    if not 1 <= page <= n_pages:
        raise BadRequest(f"page {page} does not exist: {what} has pages 1 to {n_pages}", 404)
    table = table.sort_values([column, "key"], ascending=[order == "asc", True], na_position="last", kind="stable")
    return table.iloc[(page - 1) * PAGE_SIZE:page * PAGE_SIZE], page, n_pages

def layer_page(data: ExplorerData, layer, sort: str = "key", order: str = "asc", page="1", root: str = "",
               census: str | None = None, min_score: str | None = None) -> str:
    """A layer's keys, curated columns, sortable by each, `PAGE_SIZE` per page. `layer` counts from 1.
    `census` keeps only the keys of one census class, value type, or the erasers (`CENSUS_FILTERS`);
    `min_score` only the memories whose explanation scores at least that (`ffkv explain`, `ffkv score`)."""
    layer = data.check(layer, 0)[0]
    threshold = _min_score(min_score)
    table = data.layer_keys(layer)
    table["top_token"] = [t[0] if t else "" for t in table["top_tokens"]]
    # a declared column with nothing for this model (the GLU class of a model without a gate), or scores before
    # `ffkv score`, are left out
    optional = {c.name for c in key_columns()} | {"explanation_score"}
    present = [c for c in layer_columns() if c[0] in table.columns
               and not (c[0] in optional and table[c[0]].isna().all())]
    scored = any(c[0] == "explanation_score" for c in present)
    table = _filtered(table, census, threshold)
    sort_column = {s: (c if c != "top_tokens" else "top_token") for c, _, s in present if s}
    if sort not in sort_column:
        hint = "; pattern labels come from `ffkv analyze --only patterns`" if sort == "pattern" else ""
        raise BadRequest(f"cannot sort by {sort[:40]!r}; choose from {', '.join(sort_column)}{hint}", 422)
    shown, page, n_pages = sorted_page(table, sort_column[sort], order, page, "this layer")
    rows = []
    for r in shown.to_dict("records"):
        row = []
        for name, _, _ in present:
            value = r.get(name)
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            cell = {"text": "", "cls": "", "href": None, "tokens": None, "label": None}
            if name == "key":
                cell.update(text=str(value), cls="num", href=f"/memory/{layer_number(layer)}/{value}")
            elif name == "top_tokens":
                cell.update(tokens=value, cls="toks")
            elif name in ("description", "explanation") and not missing:
                cell.update(text=str(value), cls="desc")
            elif name in ("label", "human_label", "census_class"):
                cell.update(label=None if missing else value)
            elif name in FLAG_COLUMNS:
                cell.update(text="" if missing else "yes" if value else "no")  # blank: not computed
            elif missing:
                pass
            elif name in PERCENT_COLUMNS:
                cell.update(text=percent(value), cls="num")
            elif isinstance(value, (int, float)):
                cell.update(text=number(value), cls="num")
            else:
                cell.update(text=str(value))
            row.append(cell)
        rows.append(row)
    numeric = PERCENT_COLUMNS | {"key", "top_coefficient", "negative_strength"} | {
        c.name for c in key_columns() if c.name in table and pd.api.types.is_numeric_dtype(table[c.name])}
    columns = [{"title": title, "sort": s, "num": name in numeric or name.endswith("score")}
               for name, title, s in present]
    # the filters every link of the page keeps (census is one of CENSUS_FILTERS' names here: no escaping needed)
    kept = (f"&census={census}" if census else "") + ("" if threshold is None else f"&min_score={threshold:g}")
    latents = data.latents
    latent_name = latents.name(layer) if latents is not None and layer in latents.layout.latents else None
    return render("layer.html", **_common(data, root), layer=layer, sort=sort, order=order, page=page,
                  latent_name=latent_name,
                  n_pages=n_pages, rows=rows, columns=columns, n_keys=len(table), census=census or "",
                  census_filters=CENSUS_FILTER_GROUPS if data.census is not None else (), kept=kept,
                  min_score="" if threshold is None else f"{threshold:g}",
                  scored=scored,
                  signed="negative_strength" in table.columns,
                  first=(page - 1) * PAGE_SIZE + 1, last=min(page * PAGE_SIZE, len(table)))


# ------------------------------------------------------------------------ memory page
#: How the memory page offers to read a value: (projection, shown, label). The projection is one of ffkv's
#: (`ffkv.memories.projection.PROJECTIONS`); shown, the tokens' probabilities or their raw logits.
READINGS = (("final-norm", "p", "final norm: softmax(N(v)·Eᵀ)"), ("identity", "p", "identity: softmax(v·Eᵀ)"),
            ("identity", "logit", "raw logits v·Eᵀ"))
#: What each reading is, and how the two projections differ (the page opens in the model's own, `reading_projection`).
_BETWEEN = ("The model reads what its layers add through its final normalization N before the unembedding E, so this "
            "page opens in that projection; the paper read values with the identity, softmax(v·Eᵀ), and the run's "
            "agreement and rank columns (the layer page, Figures 4 and 5) keep the paper's.")
READING_NOTES = {
    ("identity", "p"): "p = softmax(v·Eᵀ), the value projected with the identity, as in the paper (and in the run's "
                       "agreement and rank columns). On a pre-norm model the value never reaches E without N: under "
                       "the identity a value's distribution is often near uniform.",
    ("final-norm", "p"): "p = softmax(N(v)·Eᵀ): the value through the model's final normalization first (the logit "
                         "lens). " + _BETWEEN,
    ("identity", "logit"): "The raw logits v·Eᵀ (identity projection, no softmax): how much the value adds to each "
                           "token's logit.",
    ("final-norm", "logit"): "The raw logits N(v)·Eᵀ (final-norm projection, no softmax).",
}
#: Pattern scores shown on the memory page: column of patterns_keys -> (name, percent?).
PATTERN_SCORES = {"shallow_score": ("shallow score", True), "shallow_score_2": ("last 2 tokens", True),
                  "shallow_score_3": ("last 3 tokens", True), "shared_suffix_text": ("shared ending", False),
                  "semantic_score": ("semantic score", False),
                  "semantic_z": ("semantic z", False),
                  "mean_pairwise_cosine": ("mean pairwise cosine", False),
                  "n_triggers": ("prefixes read", False), "n_embedded": ("prefixes embedded", False)}


def _pattern_scores(auto: dict) -> list[tuple[str, str, bool]]:
    """(name, value, shown as a token) of the automatic pattern's scores, each score a label reads beside the
    cut-off it was read against."""
    cutoffs = label_cutoffs(auto)
    out = []
    for column, (name, share) in PATTERN_SCORES.items():
        if column in auto:
            value = auto[column]
            text = value if isinstance(value, str) else percent(value) if share else number(value)
            if column in cutoffs:
                text += f" (cut-off {percent(cutoffs[column]) if share else number(cutoffs[column])})"
            out.append((name, text, isinstance(value, str)))
    return out


def label_cutoffs(auto: dict) -> dict[str, float]:
    """The cut-off each score of the automatic label was read against (`ffkv.experiments.patterns`): shallow at a
    shallow score >= `SHALLOW_SHARE`; semantic at z >= `SEMANTIC_Z` and z above the layer's control cut-off."""
    cutoffs = {"shallow_score": SHALLOW_SHARE}
    cut = auto.get("semantic_cutoff")
    if cut is not None and not (isinstance(cut, float) and math.isnan(cut)):
        cutoffs["semantic_z"] = max(SEMANTIC_Z, float(cut))
    return cutoffs


def label_reasons(auto: dict) -> list[str]:
    """Why the key got its automatic label: each test, its score, its cut-off and by how much it passed or failed."""
    if auto.get("dead"):
        return ["dead: never active on the held-out text, so no pattern is read"]
    reasons, cutoffs = [], label_cutoffs(auto)
    shallow = auto.get("shallow_score")
    if shallow is not None and not math.isnan(float(shallow)):
        passed = shallow >= SHALLOW_SHARE
        reasons.append(f"shallow {'passed' if passed else 'failed'}: {percent(shallow)} of its top prefixes share "
                       f"their last tokens, {'at or above' if passed else 'below'} the cut-off "
                       f"{percent(SHALLOW_SHARE)} (by {abs(shallow - SHALLOW_SHARE) * 100:.1f} points)")
    z = auto.get("semantic_z")
    if z is not None and not math.isnan(float(z)) and "semantic_z" in cutoffs:
        cut, layer_cut = cutoffs["semantic_z"], float(auto["semantic_cutoff"])
        passed = z >= SEMANTIC_Z and z > layer_cut  # patterns.semantic_label
        reasons.append(f"semantic {'passed' if passed else 'failed'}: z {number(z)} "
                       f"{'above' if passed else 'not above'} {number(cut)} (by {number(abs(z - cut))}); the cut-off "
                       f"is the larger of {SEMANTIC_Z:g} (beyond random corpus prefixes) and this layer's control "
                       f"cut-off {number(layer_cut)} (z of its random key directions, {1 - CONTROL_PASS:.0%} "
                       "quantile)")
    return reasons


def memory_context(data: ExplorerData, layer: int, key: int, projection: str | None = None, shown: str = "p") -> dict:
    """What the memory templates need for layer index `layer` and key `key`, its value read as `shown` under
    `projection`."""
    m = data.memory(layer, key, projection, shown=shown)
    hist = m["histogram"]
    # The trigger example of largest |m|, with its sign (a gated key's strongest may be its most negative one).
    top = max([e["coefficient"] for g in m["triggers"] for e in g["examples"]] or [0.0], key=abs)
    extreme = {d: [e["coefficient"] for g in m["triggers"] if g["direction"] == d for e in g["examples"]] for d in (1, -1)}
    strongest = {"positive": max(extreme[1], default=None), "negative": min(extreme[-1], default=None)}
    return {"m": m, "pattern_scores": _pattern_scores(m["auto"]), "label_reasons": label_reasons(m["auto"]),
            "projections": READINGS,
            "signed": bool(extreme[-1]), "strongest": strongest,
            "projection_note": READING_NOTES[(m["projection"], m["value"]["shown"])],
            "histogram": histogram_svg(hist["counts"], hist["lo"], hist["hi"]), "top_coefficient": top,
            "target_name": "masked token" if data.encoder else "next token", "uniform": 1.0 / data.vocab_size,
            "match": match_of(data.run.path, layer, key)}


def memory_fragment(data: ExplorerData, layer: int, key: int, root: str = "", standalone: bool = True,
                    projection: str | None = None, shown: str = "p") -> str:
    return render("memory_fragment.html", **_common(data, root), **memory_context(data, layer, key, projection, shown),
                  standalone=standalone)


def memory_page(data: ExplorerData, layer, key, root: str = "", projection: str | None = None, shown: str = "p") -> str:
    """The memory page; `layer` counts from 1, as in its URL."""
    layer, key = data.check(layer, key)
    return render("memory.html", **_common(data, root), **memory_context(data, layer, key, projection, shown),
                  standalone=False, labels=LABELS)


def _plain(value):
    """A value as JSON holds it (numpy scalars and arrays to Python)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def memory_json(data: ExplorerData, layer, key, projection: str | None = None, root: str = "", shown: str = "p") -> dict:
    """The memory page as data (`/memory/LAYER/KEY.json`). ``layer`` and ``rank`` are 0-based as in the run's
    tables; ``layer_number`` is the layer as pages and URLs count it (from 1); a token's ``target_rank`` in the
    value's distribution counts from 1 (the top token), as the values table's does."""
    layer, key = data.check(layer, key)
    m = data.memory(layer, key, projection, shown=shown)
    number_ = layer_number(layer)
    return {
        "layer": layer, "layer_number": number_, "key": key, "url": f"{root}/memory/{number_}/{key}",
        "run": data.run.path.name, "model": data.manifest.model.id,
        "pattern": {k: _plain(v) for k, v in m["auto"].items()},
        "human_labels": [{k: _plain(v) for k, v in h.items()} for h in m["human"]],
        "value": {"projection": m["projection"], "shown": m["value"]["shown"],
                  # under this projection: the top token's p or logit, and the top-1 trigger target's rank (1: the top)
                  "top_value": m["value"]["top_value"], "target_rank": m["value"]["target_rank"],
                  # the distribution's entropy over log|V|, and whether it reads as uniform (docs/definitions.md)
                  "entropy_share": m["value"]["entropy_share"], "uniform": m["value"]["uniform"],
                  "top": [{"token_id": t["token_id"], "token": t["token"], m["value"]["shown"]: t["value"]}
                          for t in m["value"]["top"]],
                  "bottom": [{"token_id": t["token_id"], "token": t["token"], m["value"]["shown"]: t["value"]}
                             for t in m["value"]["bottom"]]},
        "explanations": m["explanations"],
        "statistics": {k: _plain(v) for k, v in m["stats"].items() if k != "activation_histogram"},
        "activation_histogram": m["histogram"],
        # [before, after]: where the run stored coefficients only for a window of tokens around each trigger
        # (a real model's index), those it stored; a trigger example's coefficients are null outside it
        "stored_window": m["window"],
        # where the run stored coefficients for each direction's strongest examples only (an index of more than
        # `ffkv.experiments.trigger_contexts.MAX_ROWS` rows), how many; the others' are null but at the trigger
        "stored_ranks": m["stored_ranks"],
        "trigger_examples": [
            {"direction": e["direction"], "rank": e["rank"], "coefficient": e["coefficient"],
             "example_id": e["example_id"], "position": e["position"], "next_token_id": e["next_token_id"],
             "text": e["text"], "first_position": e["first"],  # tokens[0]'s position (a long example is cut)
             "tokens": [t["text"] for t in e["tokens"] if not t.get("gap")],
             # null outside the stored window (``stored_window``)
             "coefficients": [t["m"] for t in e["tokens"] if not t.get("gap")]}
            for g in m["triggers"] for e in g["examples"]],
    }


# ------------------------------------------------------------------------ latents
#: How a latent page reads its value d_j (the readings of `READINGS`, in a decoder row's words).
LATENT_READING_NOTES = {
    ("identity", "p"): "p = softmax(d·Eᵀ), the decoder row projected with the identity, as the paper reads a value.",
    ("final-norm", "p"): "p = softmax(N(d)·Eᵀ): the decoder row through the model's final normalization first, as "
                         "the model reads what its layers add (the page opens here; the paper's reading is the "
                         "identity, which the run's agreement and rank columns keep).",
    ("identity", "logit"): "The raw logits d·Eᵀ (identity projection, no softmax): how much the latent adds to each "
                           "token's logit per unit of activation.",
    ("final-norm", "logit"): "The raw logits N(d)·Eᵀ (final-norm projection, no softmax).",
}
#: Latent layer page columns: (column of `LatentData.layer_table`, header, sort name in the URL). The explanation
#: columns are shown once `ffkv explain --latents` ran (its score once `ffkv score` did), as on a neuron layer page.
LATENT_COLUMNS = (
    ("key", "latent", "latent"),
    ("explanation", "explanation", "explanation"),
    ("explanation_score", "explanation score", "explanation score"),
    ("top_tokens", "value's top tokens", "top token"),
    ("agreement", "agrees", "agreement"),
    ("activation_frequency", "active", "activation frequency"),
    ("top_coefficient", "largest a", "largest a"),
    ("n_triggers", "trigger examples", "trigger examples"),
    ("common_last_token", "common last token", "common last token"),
    ("shallow_share", "its share", "shallow share"),
    ("confidence", "top p", "top p"),
    ("value_norm", "‖d‖", "value norm"),
)
LATENT_PERCENT = {"activation_frequency", "shallow_share", "confidence"}
#: `READINGS` as a latent page offers them: its value is the decoder row d.
LATENT_READINGS = tuple((p, s, label.replace("v·", "d·").replace("(v)", "(d)")) for p, s, label in READINGS)


def latents_of(data: ExplorerData) -> "LatentData":
    """The run's `ffkv.explorer.latents.LatentData`, or a 404 for a run indexed without a dictionary."""
    if data.latents is None:
        raise BadRequest("this run was indexed without a sparse dictionary: it has no latents (index with "
                         "`ffkv index ... --dictionary PATH`)", 404)
    return data.latents


def latent_context(data: ExplorerData, address: str, projection: str | None = None, shown: str = "p") -> dict:
    """What the latent templates need for the latent at `address` (``t4:42``), its value read as `shown` under
    `projection`."""
    latents = latents_of(data)
    lat = latents.latent(latents.check(address), projection, shown)
    hist = lat["histogram"]
    return {"l": lat, "projections": LATENT_READINGS,
            "projection_note": LATENT_READING_NOTES[(lat["projection"], lat["value"]["shown"])],
            "histogram": histogram_svg(hist["counts"], hist["lo"], hist["hi"], label="a"),
            "top_coefficient": max([e["coefficient"] for e in lat["examples"]] or [0.0]),
            "target_name": "masked token" if data.encoder else "next token", "uniform": 1.0 / data.vocab_size}


def latent_page(data: ExplorerData, address: str, root: str = "", projection: str | None = None,
                shown: str = "p") -> str:
    """A latent's page (``/memory/t4:42``): its value, activation histogram and trigger examples shaded by its
    activation at every token."""
    return render("latent.html", **_common(data, root), **latent_context(data, address, projection, shown),
                  standalone=False, labels=LABELS)


def latent_json(data: ExplorerData, address: str, projection: str | None = None, root: str = "",
                shown: str = "p") -> dict:
    """The latent page as data (``/memory/t4:42.json``): ``layer`` 0-based as in the run's tables, ``layer_number``
    from 1; ``latent`` its index in the layer's dictionary; a trigger example's ``coefficients`` are the latent's
    activation at each of its ``tokens`` (null outside the stored window)."""
    latents = latents_of(data)
    lat = latents.latent(latents.check(address), projection, shown)
    value = lat["value"]
    return {
        "address": lat["address"], "kind": lat["kind"], "layer": lat["layer"], "layer_number": layer_number(lat["layer"]),
        "latent": lat["key"], "n_latents": lat["n_latents"], "url": f"{root}/memory/{lat['address']}",
        "run": data.run.path.name, "model": data.manifest.model.id,
        "value": {"projection": lat["projection"], "shown": value["shown"], "top_value": value["top_value"],
                  "target_rank": value["target_rank"],
                  "top": [{"token_id": t["token_id"], "token": t["token"], value["shown"]: t["value"]}
                          for t in value["top"]],
                  "bottom": [{"token_id": t["token_id"], "token": t["token"], value["shown"]: t["value"]}
                             for t in value["bottom"]]},
        "explanations": lat["explanations"],
        "statistics": {k: _plain(v) for k, v in lat["stats"].items() if k != "activation_histogram"},
        "activation_histogram": lat["histogram"], "stored_window": lat["window"],
        "stored_ranks": lat["stored_ranks"],
        "trigger_examples": [
            {"rank": e["rank"], "coefficient": e["coefficient"], "example_id": e["example_id"],
             "position": e["position"], "next_token_id": e["next_token_id"], "text": e["text"],
             "first_position": e["first"], "tokens": [t["text"] for t in e["tokens"] if not t.get("gap")],
             "coefficients": [t["m"] for t in e["tokens"] if not t.get("gap")]}
            for e in lat["examples"]],
    }


def latent_layer_page(data: ExplorerData, name: str, sort: str | None = None, order: str = "asc", page="1",
                      root: str = "") -> str:
    """A dictionary's latents (``/layer/t4``), `LATENT_COLUMNS`, sortable by each, `PAGE_SIZE` per page."""
    latents = latents_of(data)
    layer = latents.check_layer(name)
    name = latents.name(layer)
    sort = sort or "latent"
    table = latents.layer_table(layer)
    # the explanation before `ffkv explain --latents`, its score before `ffkv score`, are left out (`layer_page`)
    present = [c for c in LATENT_COLUMNS if c[0] in table.columns
               and not (c[0] == "explanation_score" and table[c[0]].isna().all())]
    sort_column = {s: (c if c != "top_tokens" else "top_token") for c, _, s in present}
    if sort not in sort_column:
        hint = "; explanations come from `ffkv explain RUN --latents`, their scores from `ffkv score RUN`" \
            if sort in ("explanation", "explanation score") else ""
        raise BadRequest(f"cannot sort by {sort[:40]!r}; choose from {', '.join(sort_column)}{hint}", 422)
    shown, page, n_pages = sorted_page(table, sort_column[sort], order, page, name)
    rows = []
    for r in shown.to_dict("records"):
        row = []
        for column_name, _, _ in present:
            value = r.get(column_name)
            cell = {"text": "", "cls": "", "href": None, "tokens": None, "token": None}
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            if column_name == "key":
                cell.update(text=f"{name}:{value}", cls="num", href=f"/memory/{name}:{value}")
            elif column_name == "top_tokens":
                cell.update(tokens=value)
            elif column_name == "common_last_token":
                cell.update(token=value if r["n_triggers"] else None)
            elif column_name == "agreement":
                cell.update(text="yes" if value else "no")
            elif missing:
                pass
            elif column_name == "explanation":
                cell.update(text=str(value))
            elif column_name in LATENT_PERCENT:
                cell.update(text=percent(value), cls="num")
            else:
                cell.update(text=number(value), cls="num")
            row.append(cell)
        rows.append(row)
    columns = [{"title": title, "sort": s,
                "num": c not in ("top_tokens", "common_last_token", "agreement", "explanation")}
               for c, title, s in present]
    return render("latent_layer.html", **_common(data, root), layer=layer, dictionary=name, kind=latents.kind(layer),
                  dictionaries=latents.summary(), sort=sort, order=order, page=page, n_pages=n_pages, rows=rows,
                  columns=columns, n_keys=len(table), first=(page - 1) * PAGE_SIZE + 1,
                  last=min(page * PAGE_SIZE, len(table)), explained=any(c[0] == "explanation" for c in present))


# ------------------------------------------------------------------------ search
def highlight(text: str, query: str) -> list[tuple[str, bool]]:
    """`text` cut into (part, is_match) pieces at every case-insensitive occurrence of `query`."""
    low, q = text.lower(), query.lower()
    parts, start = [], 0
    while q:
        i = low.find(q, start)
        if i < 0:
            break
        if i > start:
            parts.append((text[start:i], False))
        parts.append((text[i:i + len(q)], True))
        start = i + len(q)
    if start < len(text):
        parts.append((text[start:], False))
    return parts


def search_page(data: ExplorerData, token: str | None = None, q: str | None = None, root: str = "",
                page: int | str = 1) -> str:
    """Memories promoting a token (`token`): neurons, and the latents of a run indexed with a dictionary; trigger
    examples containing a text (`q`), each with the neurons and the latents it triggers, memories whose
    explanation holds every word of it, and the memory `q` names when it is an address (``3:17``, ``t4:42``).
    Each list says how many matched; the neurons promoting a token and the examples holding a text page through all
    of them, `SEARCH_LIMIT` a page (`page`)."""
    page = validation.integer(page, "page", 1, 10**6, 422)
    # a form sent empty asks for nothing: the page with its forms, as before a search (a token may be a space)
    token = token or None
    q = q if q and q.strip() else None
    promoting = data.promoting(token, SEARCH_LIMIT, page) if token is not None else None
    latents_promoting = data.latents.promoting(promoting["token_ids"], SEARCH_LIMIT) \
        if promoting is not None and data.latents is not None else None
    n_hits = data.text_matches(q) if q is not None else 0
    hit_pages = max(1, -(-n_hits // SEARCH_LIMIT))
    if q is not None and page > hit_pages:
        raise BadRequest(f"page {page} does not exist: {n_hits:,} trigger examples hold this text, "
                         f"{hit_pages} page{'s' if hit_pages != 1 else ''} of {SEARCH_LIMIT}", 404)
    hits = data.text_search(q, limit=SEARCH_LIMIT, page=page) if q is not None else None
    if hits:
        found = data.latents.of_examples([h["example_id"] for h in hits]) if data.latents is not None else {}
        for h in hits:
            h["parts"] = highlight(h["text"], q)
            h["latents"], h["n_latents"] = found.get(h["example_id"], ([], 0))
    explained = data.explanation_search(q, limit=SEARCH_LIMIT) if q is not None else None
    return render("search.html", **_common(data, root), token=token, q=q, promoting=promoting, hits=hits,
                  latents_promoting=latents_promoting, named=named_memory(data, q),
                  explained=explained, any_explained=not data.explanations.empty, shown=CHIPS_SHOWN,
                  limit=SEARCH_LIMIT, page=page, n_hits=n_hits, hit_pages=hit_pages)


def named_memory(data: ExplorerData, text: str | None) -> dict | None:
    """The memory a search text names as an address (``3:17``: a neuron; ``t4:42``: a latent of the run's
    dictionary), with its page's path and what it is; None when the text is not one this run has."""
    from ffkv.memories.address import MemoryLayout, MemoryRef

    text = (text or "").strip()
    if ":" not in text or len(text) > 40:
        return None
    layout = data.latents.layout if data.latents is not None else MemoryLayout(data.n_layers, data.d_m)
    try:
        found = layout.parse(text)
    except FfkvError:
        return None
    if isinstance(found, MemoryRef):
        return {"address": str(found), "href": f"/memory/{found.layer + 1}/{found.key}", "what": "neuron",
                "top_token": data.token(int(data.top_ids[found.layer, found.key, 0]))}
    return {"address": str(found), "href": f"/memory/{found}", "what": f"latent ({found.kind})",
            "top_token": data.token(int(data.latents.top_ids[found.layer][found.latent, 0]))}


# ------------------------------------------------------------------------ trace
def _changed(old_id: int, old_p: float, new_id: int, new_p: float) -> bool:
    return new_id != old_id or abs(new_p - old_p) >= CHANGE_THRESHOLD


#: How the trace's residual columns are read (`ffkv.explorer.tracing.LENSES`), in the page's words.
LENS_TEXT = {"final-norm": "the final normalization (the logit lens)",
             "translator": "the run's fitted translator of each layer, then the final normalization (the tuned lens)"}
#: The trace form's choice of lens: (value, label).
LENS_CHOICES = (("final-norm", "logit lens (final norm)"), ("translator", "tuned lens (the run's translators)"))


def trace_view(data: ExplorerData, base: TraceResult, edited: TraceResult | None = None,
               target_text: str = "") -> dict:
    """What the trace table shows: per layer, the original predictions and, if given, the edited ones."""
    tok = data.token
    edits = edited.edits if edited is not None else base.edits
    latent_edits = edited.latent_edits if edited is not None else base.latent_edits
    rows = []
    for i, layer in enumerate(base.layers):
        row = {"layer": layer.layer, "memories": []}
        for part in ("before", "ff", "after"):
            old = getattr(layer, part)
            cell = {"token": tok(old.token_id), "prob": old.prob, "target_prob": old.target_prob if target_text else None}
            if edited is not None:
                new = getattr(edited.layers[i], part)
                cell.update(new_token=tok(new.token_id), new_prob=new.prob, new_target_prob=new.target_prob,
                            changed=_changed(old.token_id, old.prob, new.token_id, new.prob))
            row[part] = cell
        # An edited memory's chip shows its coefficient as the edited pass computed it, beside the original.
        now = edited.layers[i] if edited is not None else None
        edited_latents = {x["key"]: x["coefficient"] for x in now.latents} if now is not None else {}
        memories = list(layer.memories) + list(layer.suppressing) + list(layer.edited)
        for m in memories:
            edit = edits.get((layer.layer, m["key"]))
            row["memories"].append({**m, "edit_op": edit.op if edit else None, "edit_value": edit.value if edit else None,
                                    "edit_label": edit_label(edit),
                                    "edited_coefficient": float(now.coefficients[m["key"]]) if edit and now else None,
                                    "top_token": tok(int(data.top_ids[layer.layer, m["key"], 0]))})
        row["latents"] = []
        for x in (layer.latents if data.latents is not None else []):
            edit = latent_edits.get((layer.layer, x["key"]))
            row["latents"].append({**x, "edit_op": edit.op if edit else None,
                                   "edit_value": edit.value if edit else None, "edit_label": edit_label(edit),
                                   "edited_coefficient": edited_latents.get(x["key"]) if edit else None,
                                   "top_token": tok(int(data.latents.top_ids[layer.layer][x["key"], 0]))})
        rows.append(row)
    final = []
    for i, pred in enumerate(base.final):
        item = {"token": tok(pred.token_id), "prob": pred.prob}
        if edited is not None:
            new = edited.final[i]
            item.update(new_token=tok(new.token_id), new_prob=new.prob,
                        changed=_changed(pred.token_id, pred.prob, new.token_id, new.prob))
        final.append(item)
    strip = [{"index": j, "text": text} for j, text in enumerate(data.sequence(base.token_ids))]
    return {"rows": rows, "final": final, "position": base.position, "n_tokens": len(base.token_ids),
            "token": tok(base.token_ids[base.position]), "strip": strip, "target": tok(base.target),
            "target_text": target_text, "lens": base.lens, "lens_text": LENS_TEXT[base.lens]}


def generation_view(data: ExplorerData, prompt_ids: list[int], original: list[int], edited: list[int] | None) -> dict:
    """Generated text with and without interventions, and where the two part."""
    decode = data.loaded.tokenizer.decode
    common = 0
    if edited is not None:
        while common < min(len(original), len(edited)) and original[common] == edited[common]:
            common += 1
    return {"n": len(original), "prompt": decode(prompt_ids), "original": decode(prompt_ids + original)[len(decode(prompt_ids)):],
            "edited": None if edited is None else decode(prompt_ids + edited),
            "same": "" if edited is None else decode(prompt_ids + edited[:common])[len(decode(prompt_ids)):],
            "edited_rest": "" if edited is None else decode(prompt_ids + edited)[len(decode(prompt_ids + edited[:common])):],
            "common": common, "differs": edited is not None and edited != original}


def trace_fragment(data: ExplorerData, base: TraceResult, edited: TraceResult | None = None, root: str = "",
                   standalone: bool = True, interactive: bool = False, generation: dict | None = None) -> str:
    return render("trace_fragment.html", **_common(data, root), t=trace_view(data, base, edited),
                  compare=edited is not None, standalone=standalone, interactive=interactive, generation=generation,
                  threshold_pp=f"{100 * CHANGE_THRESHOLD:g}")


def trace_page(data: ExplorerData, prompt: str | None, base: TraceResult | None, edited: TraceResult | None,
               root: str = "", generation: dict | None = None, target_text: str = "", n_generate: int = 20) -> str:
    t = trace_view(data, base, edited, target_text) if base is not None else None
    lenses = LENS_CHOICES if data.translators_file.is_file() else ()  # offered once the run has translators
    return render("trace.html", **_common(data, root), prompt=prompt, max_chars=MAX_PROMPT_CHARS, t=t, lenses=lenses,
                  compare=edited is not None, standalone=False, interactive=True, generation=generation,
                  threshold_pp=f"{100 * CHANGE_THRESHOLD:g}", can_generate=not data.encoder,
                  max_new=MAX_NEW_TOKENS, n_generate=n_generate)



# ------------------------------------------------------------------------ concepts
#: Concepts shown on the page (largest first); all of them are in `ffkv.tools.concepts.concepts`.
CONCEPTS_SHOWN = 100
#: "all layers" is offered while the run has at most this many values (the page compares every pair).
CONCEPTS_ALL_LIMIT = 16384


def warm_up() -> None:
    """Import the concepts page's module (`ffkv.tools.concepts`) ahead of its first request."""
    from ffkv.tools import concepts  # noqa: F401


def concepts_page(data: ExplorerData, layer: str | None = None, root: str = "") -> str:
    """Values clustered by shared top tokens (`ffkv.tools.concepts`), for one layer (from 1) or all."""
    from ffkv.tools import concepts as method
    from ffkv.explorer.validation import integer

    all_ok = data.n_layers * data.d_m <= CONCEPTS_ALL_LIMIT
    if layer == "all":
        if not all_ok:
            raise BadRequest(f"this run has {data.n_layers * data.d_m:,} values, more than {CONCEPTS_ALL_LIMIT:,} "
                             "to cluster at once; pick one layer", 422)
        layers = list(range(data.n_layers))
    else:
        layers = [integer(layer if layer not in (None, "") else data.n_layers, "layer", 1, data.n_layers, 422) - 1]
    method.check_request(layers, data.n_layers, data.d_m)
    tops = [data.value_top_ids(x, method.TOP) for x in layers]  # the lookup table's: no projection of the values
    if any(t is None for t in tops):
        found, members = method.concepts(data.loaded, layers)
    else:
        found, members = method.concepts_of_tops(tops, layers, data.loaded.tokenizer)
    shown = []
    for row in found.head(CONCEPTS_SHOWN).itertuples():
        mem = members[members["concept"] == row.concept]
        shown.append({"concept": row.concept, "size": row.size, "tokens": row.tokens,
                      "layers": [layer_number(x) for x in row.layers],
                      "memories": [{"layer": int(m.layer), "key": int(m.key), "top": list(m.top_tokens)}
                                   for m in mem.itertuples()]})
    return render("concepts.html", **_common(data, root), concepts=shown, n_concepts=len(found),
                  layer=("all" if layer == "all" else layer_number(layers[0])), all_ok=all_ok,
                  top=method.TOP, min_shared=method.MIN_SHARED, run_path=str(data.run.path))
