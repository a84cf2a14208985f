"""`ffkv report RUN`: one self-contained HTML file, RUN/report.html (SPEC section 10).

Every figure of `ffkv analyze` is embedded (base64), next to the paper's finding for the
same figure and one sentence on this model; every metrics table follows it. The page
loads nothing: no scripts, fonts or images from anywhere, so it opens offline. Links
point into the explorer (`ffkv serve RUN`) where it runs. A run with only the index gets
the run's description and per-layer summaries of its trigger examples.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path

import duckdb
import jinja2
import pandas as pd
from markupsafe import Markup

import ffkv
from ffkv.presentation.findings import paper_finding
from ffkv.presentation.style import CSS, number, percent
from ffkv.presentation.summary import manifest_summary
from ffkv.report.content import order_key, reading
from ffkv.store import atomic
from ffkv.store.annotations import read_labels
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

#: Rows of a metrics table shown in the report (the rest are in the Parquet file).
MAX_ROWS = 40

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<link rel="icon" href="data:,"><title>ffkv report · {{ run_name }}</title><style>{{ css }}</style></head>
<body><main>
<h1>Feed-forward layers as key-value memories: {{ run_name }}</h1>
<p class="muted">ffkv {{ version }} · generated {{ generated }} · after Geva, Schuster, Berant and Levy,
<em>Transformer Feed-Forward Layers Are Key-Value Memories</em> (EMNLP 2021).</p>
<h2>The run</h2>
<dl class="run" id="run">{% for k, v in run_rows %}<dt>{{ k }}</dt><dd>{{ v }}</dd>{% endfor %}</dl>
<p class="small">Explore it: <code>ffkv serve {{ run_path }}</code>, then
<a href="{{ explorer }}/">overview</a> · <a href="{{ explorer }}/search">search</a> · <a href="{{ explorer }}/trace">trace</a> ·
layers {% for l in layers %}<a href="{{ explorer }}/layer/{{ l }}">{{ l }}</a>{% if not loop.last %}, {% endif %}{% endfor %}.</p>
<h2>Layers</h2>
<p class="small muted">From the trigger examples (top-{{ top_k }} per key){% if has_stats %} and the values experiment{% endif %}.</p>
<div class="scroll">{{ layer_table }}</div>
{% if annotations %}<h2>Human labels</h2><p class="small muted">From annotations/labels.parquet (latest label per key and annotator).</p>
<div class="scroll">{{ annotations }}</div>{% endif %}
<h2>Analyses</h2>
{% if not sections %}<p id="no-analyses">No analyses yet: run <code>ffkv analyze {{ run_path }}</code>, then
<code>ffkv report {{ run_path }}</code> again.</p>{% endif %}
{% for s in sections %}<section class="analysis" id="{{ s.anchor }}"><h3>{{ s.name }}{% if s.paper_figure %} <span class="muted small">(paper {{ s.paper_figure }})</span>{% endif %}</h3>
<div class="figure-block">{% if s.image %}<figure><img class="figure" src="{{ s.image }}" alt="figure {{ s.name }}"></figure>{% else %}<div></div>{% endif %}
<div>{% if s.finding %}<div class="finding"><strong>Paper:</strong> {{ s.finding }}</div>{% endif %}
{% if s.reading %}<div class="reading"><strong>This model:</strong> {{ s.reading }}</div>{% endif %}</div></div>
{% if s.table %}<div class="scroll">{{ s.table }}</div>{% if s.more %}<p class="small muted">{{ s.more }}</p>{% endif %}{% endif %}
</section>{% endfor %}
</main></body></html>"""

_ENV = jinja2.Environment(autoescape=True)


def _table_html(table: pd.DataFrame, percent_columns: tuple[str, ...] = ()) -> str:
    """A DataFrame as an escaped HTML table."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = []
    for record in table.itertuples(index=False):
        cells = []
        for column, value in zip(table.columns, record):
            if column in percent_columns:
                text, cls = percent(value), "num"
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                text, cls = number(value), "num"
            else:
                text, cls = ("" if value is None else str(value)), ""
            cells.append(f'<td class="{cls}">{html.escape(text)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table><tr>{head}</tr>{"".join(rows)}</table>'


def _is_categorical(column: pd.Series) -> bool:
    """A column of strings (not of lists or arrays, which cannot be counted as categories)."""
    return column.dtype == object and column.map(lambda v: isinstance(v, str) or v is None).all()


def per_layer_view(table: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """A per-key table (layer, key, ...) summarised per layer: label shares and column means."""
    if not {"layer", "key"} <= set(table.columns) or table.groupby("layer").size().max() <= 1:
        return table, False
    grouped = table.groupby("layer")
    out = grouped.size().rename("keys").to_frame()
    for column in table.columns:
        if column in ("layer", "key"):
            continue
        if column in ("label", "pattern", "auto_label", "human_label") or (
                _is_categorical(table[column]) and table[column].nunique() <= 8):
            shares = grouped[column].value_counts(normalize=True).unstack(fill_value=0)
            out = out.join(shares.add_prefix(f"{column}: "))
        elif pd.api.types.is_numeric_dtype(table[column]):
            out[f"mean {column}"] = grouped[column].mean()
    return out.reset_index(), True


def _data_uri(path: Path) -> str:
    kind = "image/svg+xml" if path.suffix == ".svg" else "image/png"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def layer_summary(run: RunDir) -> pd.DataFrame:
    """Per-layer summary of the trigger examples (and of the values experiment, if it ran)."""
    te = str(run.table("trigger_examples")).replace("'", "''")
    con = duckdb.connect()
    try:
        summary = con.execute(f"""
            SELECT layer, count(DISTINCT key) AS keys,
                   avg(coefficient) FILTER (WHERE rank = 0) AS mean_top1_coefficient,
                   max(coefficient) AS max_coefficient,
                   count(DISTINCT example_id) AS distinct_trigger_examples,
                   avg(CAST(next_token_id = -1 AS DOUBLE)) AS share_prefix_is_whole_example
            FROM read_parquet('{te}') GROUP BY layer ORDER BY layer""").df()
    finally:
        con.close()
    if run.has_metric("values"):
        stats = run.read_metric("values", columns=["layer", "agreement_rate", "mean_top_prob"]).rename(
            columns={"mean_top_prob": "mean_value_confidence"})
        summary = summary.merge(stats.astype({"layer": summary["layer"].dtype}), on="layer", how="left")
    return summary


def _annotations(run: RunDir) -> str | None:
    labels = read_labels(run.path)
    if labels.empty:
        return None
    counts = labels.groupby(["layer", "label"]).size().unstack(fill_value=0).reset_index()
    return _table_html(counts)


def _run_rows(manifest: Manifest) -> list[tuple[str, str]]:
    rows = manifest_summary(manifest)
    rows.append(("versions", ", ".join(f"{k} {v}" for k, v in manifest.versions.items())))
    return rows


def write_report(run_dir: str | Path, explorer_url: str = "http://127.0.0.1:8000") -> Path:
    """Write RUN/report.html (atomically) and return its path.

    Args:
        run_dir: a complete run directory; analyses are optional.
        explorer_url: where `ffkv serve RUN` runs, for the links into the explorer.
    """
    run = RunDir(run_dir)
    manifest = run.require_complete()
    metrics, figures = set(run.metric_names()), run.figure_names()
    sections = []
    for name in sorted(metrics | set(figures), key=order_key):
        table = None
        if name in metrics:
            try:
                table = run.read_metric(name)
            except Exception as exc:  # noqa: BLE001 - one unreadable table must not sink the report
                table = pd.DataFrame({"error": [f"cannot read metrics/{name}.parquet: {exc}"]})
        finding = paper_finding(name) or {}
        more, shown = None, table
        if table is not None:
            shown, summarised = per_layer_view(table)
            if summarised:
                more = f"Per layer: shares of each label and means over the keys; the table of every key is metrics/{name}.parquet."
            elif len(table) > MAX_ROWS:
                more = f"First {MAX_ROWS} of {len(table):,} rows; the whole table is metrics/{name}.parquet."
        sections.append({
            "name": name, "anchor": f"analysis-{name}",
            "image": _data_uri(figures[name]) if name in figures else None,
            "finding": finding.get("finding"), "paper_figure": finding.get("figure"),
            "reading": reading(name, table) if table is not None else None,
            "table": Markup(_table_html(shown.head(MAX_ROWS))) if table is not None else None,
            "more": more,
        })
    summary = layer_summary(run)
    annotations = _annotations(run)
    page = _ENV.from_string(TEMPLATE).render(
        css=CSS, run_name=run.path.name, run_path=str(run.path), version=ffkv.__version__,
        generated=time.strftime("%Y-%m-%d %H:%M"), run_rows=_run_rows(manifest),
        explorer=explorer_url.rstrip("/"), layers=list(range(manifest.model.n_layers)),
        top_k=manifest.top_k, has_stats="agreement_rate" in summary.columns,
        layer_table=Markup(_table_html(
            summary, percent_columns=("share_prefix_is_whole_example", "agreement_rate", "mean_value_confidence"))),
        annotations=Markup(annotations) if annotations else None,
        sections=sections,
    )
    path = run.report_path
    atomic.write_bytes(path, page.encode("utf-8"))
    return path
