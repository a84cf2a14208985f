"""`ffkv report RUN`: one self-contained HTML file, RUN/report.html (docs/definitions.md).

First the run, then (when `ffkv analyze` wrote metrics/fidelity.parquet) whether this model
reproduces each finding of the paper, then one section per experiment (`ffkv.report.content`):
its warnings, every figure embedded (base64) beside the paper's finding and the sentence on this
model, how the numbers were computed, its per-layer tables and a few rows of its tables for
reading. Layers are counted from 1, tokens shown as text. The page loads nothing: no scripts,
fonts or images from anywhere, so it opens offline. Links point into the explorer (`ffkv serve
RUN`) where it runs. A run with only the index gets the run's description and per-layer
summaries of its trigger examples.
"""

from __future__ import annotations

import base64
import time
import warnings
from pathlib import Path

import duckdb
import jinja2
import pandas as pd
import pyarrow.parquet as pq
from markupsafe import Markup

import ffkv
from ffkv.presentation.findings import finding_heading
from ffkv.presentation.style import CSS, layer_number, with_code
from ffkv.presentation.summary import NUMBERING, fidelity_view, manifest_summary
from ffkv.presentation.tables import table_html, table_view
from ffkv.report.content import build_sections
from ffkv.errors import DamagedRun, FfkvWarning
from ffkv.store import atomic
from ffkv.store.database import confine
from ffkv.store.integrity import Problem, cut_off, survey
from ffkv.store.annotations import read_labels
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<link rel="icon" href="data:,"><title>ffkv report · {{ run_name }}</title><style>{{ css }}
section.analysis { border-top: 1px solid var(--line); margin-top: 2rem; }
.report table { font-size: .85rem; } .report th { white-space: normal; }
.how { display: grid; grid-template-columns: max-content 1fr; gap: .1rem 1rem; font-size: .85rem; color: var(--muted); margin: .4rem 0; }
.how dt { font-weight: 600; } .how dd { margin: 0; }
</style></head>
<body><main class="report">
<h1>Feed-forward layers as key-value memories: {{ run_name }}</h1>
<p class="muted">ffkv {{ version }} · generated {{ generated }} · after Geva, Schuster, Berant and Levy,
<em>Transformer Feed-Forward Layers Are Key-Value Memories</em> (EMNLP 2021).</p>
{% for n in notices %}<div class="warning" id="notice-{{ loop.index }}"><strong>Warning:</strong> {{ n }}</div>{% endfor %}
<h2>The run</h2>
<dl class="run" id="run">{% for k, v in run_rows %}<dt>{{ k }}</dt><dd>{{ v }}</dd>{% endfor %}</dl>
<p class="note" id="numbering">{{ numbering }}</p>
<nav class="toc small" id="contents"><strong>Contents:</strong> <a href="#run">the run</a>{% if fidelity %} · <a href="#fidelity-heading">does this model reproduce the paper?</a>{% endif %} · <a href="#layers">layers</a>{% if annotations %} · <a href="#human-labels">human labels</a>{% endif %}{% for s in sections %} · <a href="#analysis-{{ s.name }}">{{ s.name }}</a>{% endfor %}</nav>
<p class="small">Explore it: <code>ffkv serve {{ run_path }}</code>, then {% if relative_links %}open this report from the explorer's Report link (these links follow it, on any port):{% endif %}
<a href="{{ explorer }}/">overview</a> · <a href="{{ explorer }}/search">search</a> · <a href="{{ explorer }}/trace">trace</a> ·
layers {% for l in layers %}<a href="{{ explorer }}/layer/{{ l }}">{{ l }}</a>{% if not loop.last %}, {% endif %}{% endfor %}.</p>
{% if fidelity %}<h2 id="fidelity-heading">Does this model reproduce the paper?</h2>
<p class="small muted">One row per finding of the paper (metrics/fidelity.parquet): this model's value and whether it reproduces, by the stated rule.</p>
<div class="scroll">{{ fidelity }}</div>{% endif %}
<h2 id="layers">Layers</h2>
<p class="small muted">From the trigger examples (top-{{ top_k }} per key){% if has_stats %} and the values experiment (agreement rate, identity projection){% endif %}.</p>
<div class="scroll">{{ layer_table }}</div>
{% if annotations %}<h2 id="human-labels">Human labels</h2><p class="small muted">From annotations/labels.parquet: keys per label (latest label per key and annotator).</p>
<div class="scroll">{{ annotations }}</div>{% endif %}
<h2>Analyses</h2>
<p class="small muted" id="definitions">What ffkv chose where the paper leaves a choice open (active memories, projections, trigger directions, the studies beyond the paper) is written in <code>docs/definitions.md</code> of ffkv's repository.</p>
{% if not sections %}<p id="no-analyses">No analyses yet: run <code>ffkv analyze {{ run_path }}</code>, then
<code>ffkv report {{ run_path }}</code> again.</p>{% endif %}
{% for s in sections %}<section class="analysis" id="analysis-{{ s.name }}"><h3>{{ s.title }}</h3>
{% if s.skipped %}<div class="warning skipped"><strong>Skipped:</strong> {{ s.skipped|codes }}</div>{% endif %}
{% for m in s.missing %}<div class="warning missing"><strong>Missing:</strong> {{ m }}</div>{% endfor %}
{% for w in s.warnings %}<div class="warning"><strong>Warning:</strong> {{ w }}</div>{% endfor %}
{% for f in s.figures %}<div class="figure-block"><figure><img class="figure" src="{{ images[f.name] }}" alt="figure {{ f.name }}"><figcaption class="small muted">figures/{{ f.name }}.png</figcaption></figure>
<div>{% if f.finding %}<div class="finding"><strong>{{ heading(f.paper_figure) }}:</strong> {{ f.finding }}</div>{% endif %}
{% if f.reading %}<div class="reading"><strong>Measured here:</strong> {{ f.reading }}</div>{% endif %}</div></div>{% endfor %}
{% if s.finding and not s.figures %}<div class="finding"><strong>{{ heading(s.paper_figure) }}:</strong> {{ s.finding }}</div>{% endif %}
{% if s.reading %}<div class="reading"><strong>Measured here:</strong> {{ s.reading }}</div>{% endif %}
{% if s.how %}<dl class="how">{% for k, v in s.how %}<dt>{{ k }}</dt><dd>{{ v }}</dd>{% endfor %}</dl>{% endif %}
{% for t in s.tables %}<h4 class="small">metrics/{{ t.name }}.parquet</h4>
{% if t.finding %}<div class="finding"><strong>{{ heading(t.paper_figure) }}:</strong> {{ t.finding }}</div>{% endif %}{% if t.view is not none %}<div class="scroll">{{ tables[t.name] }}</div>{% endif %}{% if t.note %}<p class="small muted">{{ t.note }}</p>{% endif %}{% endfor %}
{% if s.listed %}<p class="small muted">Also: {% for name, n in s.listed %}<code>metrics/{{ name }}.parquet</code> ({{ "{:,}".format(n) }} rows){% if not loop.last %}, {% endif %}{% endfor %}{% if s.documented %} (docs/run-directory.md says what each row is){% endif %}.</p>{% endif %}
</section>{% endfor %}
</main></body></html>"""

_ENV = jinja2.Environment(autoescape=True)
_ENV.globals.update(heading=finding_heading)
_ENV.filters["codes"] = with_code


def _data_uri(path: Path) -> str:
    kind = "image/svg+xml" if path.suffix == ".svg" else "image/png"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


LAYER_TITLES = {"keys": "keys", "mean_top1_coefficient": "mean top-1 coefficient", "max_coefficient": "largest coefficient",
                "distinct_trigger_examples": "distinct trigger examples",
                "share_prefix_is_whole_example": "share of prefixes that are the whole example",
                "agreement_rate": "agreement rate"}


def layer_summary(run: RunDir) -> pd.DataFrame:
    """Per-layer summary of the trigger examples (and of the values experiment, if it ran); 0-based layers."""
    te = str(run.table("trigger_examples")).replace("'", "''")
    positive = "WHERE direction = 1" if "direction" in pq.read_schema(run.table("trigger_examples")).names else ""
    con = confine(duckdb.connect(), [run.table("trigger_examples")])
    try:
        summary = con.execute(f"""
            SELECT layer, count(DISTINCT key) AS keys,
                   avg(coefficient) FILTER (WHERE rank = 0) AS mean_top1_coefficient,
                   max(coefficient) AS max_coefficient,
                   count(DISTINCT example_id) AS distinct_trigger_examples,
                   avg(CAST(next_token_id = -1 AS DOUBLE)) AS share_prefix_is_whole_example
            FROM read_parquet('{te}') {positive} GROUP BY layer ORDER BY layer""").df()
    finally:
        con.close()
    if run.has_metric("values"):
        # The values' mean max p sits at about 1/|V| on small models: the values section shows it, with its chance.
        stats = run.read_metric("values", columns=["layer", "agreement_rate"])
        summary = summary.merge(stats.astype({"layer": summary["layer"].dtype}), on="layer", how="left")
    return summary


def _annotations(run: RunDir) -> Markup | None:
    labels = read_labels(run.path)
    if labels.empty:
        return None
    counts = labels.groupby(["layer", "label"]).size().unstack(fill_value=0).reset_index()
    return table_html(table_view(counts))


def _run_rows(run: RunDir, manifest: Manifest) -> list[tuple[str, str]]:
    rows = manifest_summary(manifest)
    rows.append(("versions", ", ".join(f"{k} {v}" for k, v in manifest.versions.items())))
    not_run = not_run_row(run, manifest)
    return rows + [not_run] if not_run else rows


def not_run_row(run: RunDir, manifest: Manifest) -> tuple[str, str] | None:
    """("not run", which default studies the run has no record of, and the command that computes them): a study
    left out (by `ffkv demo`, or `analyze --only`) is named, not silently absent. None when every one ran."""
    from ffkv.experiments.registry import default_names

    missing = [name for name in default_names() if name not in manifest.analyses]
    if not missing or not manifest.analyses:  # a run with no analysis at all opens with a notice that says so
        return None
    return ("not run", f"{', '.join(missing)}: `ffkv analyze {run.path} --only {','.join(missing)}` computes "
                       f"{'it' if len(missing) == 1 else 'them'}")


def check_run(run: RunDir, manifest: Manifest) -> tuple[list[Problem], list[str]]:
    """The run's problems the report marks (missing, out of date), and the notices it opens with; a damaged
    table is refused (`DamagedRun`, naming it and the command that rewrites it). Each mark is also a warning."""
    problems = survey(run, manifest)
    damaged = [p for p in problems if p.state == "damaged"]
    if damaged:
        more = f" (and {len(damaged) - 1} more: `ffkv status {run.path}` lists them)" if len(damaged) > 1 else ""
        raise DamagedRun(f"{damaged[0].line(run.path)}{more}; no report was written")
    notices = []
    stopped = cut_off(run, manifest)
    if stopped is not None:
        notices.append(stopped.line(run.path))
    for line in notices:
        warnings.warn(line, FfkvWarning, stacklevel=3)
    for p in problems:
        if p.path.startswith(("metrics/", "figures/")):  # the explorer's tables are no part of the report
            warnings.warn(f"{p.line(run.path)} (marked in the report)", FfkvWarning, stacklevel=3)
    return problems, notices


def write_report(run_dir: str | Path, explorer_url: str | None = None) -> Path:
    """Write RUN/report.html (atomically) and return its path.

    Args:
        run_dir: a complete run directory; analyses are optional.
        explorer_url: where `ffkv serve RUN` runs, for the links into the explorer; None: links relative to the
            report as the explorer serves it (RUN/report.html at /files/report.html), which follow any port.
    """
    run = RunDir(run_dir)
    manifest = run.require_complete()
    problems, notices = check_run(run, manifest)
    sections = build_sections(run, problems, {name: str(info["skipped"]) for name, info in manifest.analyses.items()
                                              if info.get("skipped")})
    images = {f.name: _data_uri(f.path) for s in sections for f in s.figures}
    tables = {t.name: table_html(t.view) for s in sections for t in s.tables if t.view is not None}
    summary = layer_summary(run)
    unreadable = {Path(p.path).stem: p.line(run.path) for p in problems if p.path.startswith("metrics/")}
    fidelity = table_html(fidelity_view(run.read_metric("fidelity"), unreadable), id="fidelity", cls="fidelity") \
        if run.has_metric("fidelity") else None
    annotations = _annotations(run)
    page = _ENV.from_string(TEMPLATE).render(
        css=CSS, run_name=run.path.name, run_path=str(run.path), version=ffkv.__version__,
        generated=time.strftime("%Y-%m-%d %H:%M"), run_rows=_run_rows(run, manifest), numbering=NUMBERING,
        explorer=explorer_url.rstrip("/") if explorer_url else "..", relative_links=not explorer_url, layers=[layer_number(i) for i in range(manifest.model.n_layers)],
        top_k=manifest.top_k, has_stats="agreement_rate" in summary.columns,
        layer_table=table_html(table_view(summary, titles=LAYER_TITLES), id="layers"),
        fidelity=fidelity, annotations=annotations, sections=sections, images=images, tables=tables,
        notices=notices,
    )
    path = run.report_path
    atomic.write_bytes(path, page.encode("utf-8"))
    return path
