"""`write_report`: one self-contained HTML file with every figure and table beside the paper's finding."""

from __future__ import annotations

import re

import pytest

from ffkv.errors import FfkvError
from ffkv.experiments import registry, values
from ffkv.experiments.registry import paper_finding
from ffkv.report import write_report
from ffkv.report.content import SHOWN_APART
from ffkv.store.run import RunDir


def test_index_only_run_gets_a_report(index_only):
    path = write_report(index_only)
    assert path == index_only / "report.html"
    page = path.read_text()
    assert 'id="no-analyses"' in page and "ffkv analyze" in page
    assert "tiny-gpt2" in page and "index_seconds" in page  # model and timings
    assert page.count("<tr>") >= 4  # header + one row per layer
    assert not list(index_only.glob(".report.html.*"))  # atomic write leaves nothing behind


def test_every_figure_is_embedded_beside_its_finding(analyzed):
    run, _ = analyzed
    rd = RunDir(run)
    page = write_report(run).read_text()
    images = re.findall(r'<img class="figure" src="([^"]+)"', page)
    figures = rd.figure_names()
    assert len(images) == len(figures) >= 9  # every figure of every experiment
    assert all(src.startswith(("data:image/png;base64,", "data:image/svg+xml;base64,")) for src in images)
    for experiment in ("patterns", "ablations", "values", "composition", "refinement"):
        assert f'id="analysis-{experiment}"' in page, experiment
    for figure in ("Figure 2", "Figure 3", "Figure 4", "Figure 5", "Figure 7", "Figure 8", "Figure 9", "Figure 10",
                   "Figure 11", "Table 3"):
        assert figure in page, figure
    # Nothing is fetched: no external sources, and a CSP that forbids them.
    assert not re.search(r'(src|href)="(?!data:|\.\./|#)', page)  # the explorer's links relative to /files/
    assert 'href="../layer/1"' in page and 'id="contents"' in page and 'href="#analysis-values"' in page
    assert "default-src 'none'" in page
    assert "<script" not in page


def test_sentences_come_from_the_findings_and_tables_say_true_things(analyzed):
    from html import unescape

    run, _ = analyzed
    rd = RunDir(run)
    page = write_report(run).read_text()
    # Every sentence on this model is the findings' reading of a table; none is made up from an arbitrary column.
    sentences = [unescape(t) for t in re.findall(r'<strong>Measured here:</strong> ([^<]+)</div>', page)]
    readings = {registry.reading(name, rd.read_metric(name)) for name in rd.metric_names()} - {None}
    assert sentences and set(sentences) <= readings and readings <= set(sentences)
    assert "This model: This model" not in page and "example_id" not in page and "example id" not in page
    # One numbering: layers counted from 1 in every table, said once.
    assert 'id="numbering"' in page and "counted from 1" in page
    first_cells = re.findall(r'<table id="layers">.*?</table>', page, flags=re.S)[0]
    assert re.findall(r'<tr><td class="num">(\d+)</td>', first_cells) == ["1", "2", "3"]
    # Tokens as text, not ids: the most confident values show their top token, not its id.
    confident = re.search(r"metrics/values_confident\.parquet</h4>.*?</table>", page, flags=re.S).group(0)
    assert '<span class="tok">' in confident and "token id" not in confident
    # Each section says how its numbers were computed (projection, n).
    values = re.search(r'id="analysis-values".*?</section>', page, flags=re.S).group(0)
    assert "<dt>projection</dt><dd>identity</dd>" in values
    composition = re.search(r'id="analysis-composition".*?</section>', page, flags=re.S).group(0)
    assert "<dt>n examples</dt><dd>48</dd>" in composition
    # 48 < 100 held-out examples: the section is marked, and names its projection, rule and interval.
    assert 'class="warning"' in composition and "n = 48 examples, fewer than 100" in composition
    assert "<dt>interval</dt><dd>95% Wilson score interval</dd>" in composition
    assert "|m_i| &gt; tau·s_l" in composition and "sign kept" in composition
    # Each rate's interval is in the rate's own cell of the per-layer table, not in two more columns.
    assert "composition rate (95% CI)" in composition and "composition rate ci low" not in composition
    assert re.search(r'<td class="num">\d+\.\d+%<span class="ci">\[\d+\.\d+%, \d+\.\d+%\]</span></td>', composition)
    refinement = re.search(r'id="analysis-refinement".*?</section>', page, flags=re.S).group(0)
    assert "<dt>projection</dt><dd>final-norm</dd>" in refinement and "<dt>projection choice</dt><dd>default</dd>" in refinement
    # The fidelity table ffkv analyze wrote comes first.
    assert page.index('<table id="fidelity"') < page.index("<h2>Analyses</h2>")


def test_warnings_and_the_fidelity_table(fresh_run):
    import pandas as pd

    run, _ = fresh_run
    rd = RunDir(run)
    values = rd.read_metric("values")
    rd.write_metric("values", values, {**rd.metric_description("values"),
                                      "warnings": ["agreement computed on 29 keys, fewer than the 50 stated"]})
    rd.write_metric("fidelity", pd.DataFrame({
        "finding": ["lower layers mostly shallow", "the last token matters most"], "figure": ["Figure 2", "Figure 3"],
        "value": [0.62, -1.07], "reproduces": [True, False], "rule": ["shallow share > 50% in layer 1", "..."]}), {})
    page = write_report(run).read_text()
    values_section = re.search(r'id="analysis-values".*?</section>', page, flags=re.S).group(0)
    assert "agreement computed on 29 keys, fewer than the 50 stated" in values_section
    fidelity = re.search(r'<table id="fidelity" class="fidelity">.*?</table>', page, flags=re.S).group(0)
    assert page.index("Does this model reproduce the paper?") < page.index("<h2>Analyses</h2>")
    assert '<td class="yes">yes</td>' in fidelity and '<td class="no">no</td>' in fidelity
    assert "lower layers mostly shallow" in fidelity and "fidelity" not in [s for s in re.findall(
        r'id="analysis-(\w+)"', page)]


def test_table_text_is_escaped(index_only, tmp_path):
    import shutil

    import pandas as pd

    run = tmp_path / "run"
    shutil.copytree(index_only, run)
    (run / "metrics").mkdir()
    pd.DataFrame({"layer": [0, 1], "case": ["<script>alert(1)</script>", "a & b"]}).to_parquet(
        run / "metrics" / "refinement_last_layer.parquet")
    page = write_report(run).read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a &amp; b" in page
    assert "Table 3" in page  # its paper finding, by name


def test_every_name_analyze_writes_has_one_paper_finding(analyzed):
    run, _ = analyzed
    # fidelity is shown apart, first: it is the table of the findings itself.
    names = set(RunDir(run).figure_names()) | set(RunDir(run).metric_names()) - set(SHOWN_APART)
    assert "fidelity" in RunDir(run).metric_names()
    assert all(paper_finding(name) for name in names), [n for n in names if not paper_finding(n)]
    assert paper_finding("composition")["figure"] == "Figure 8"
    assert paper_finding("values_rank") == values.FINDINGS["values_rank"].as_dict()
    assert paper_finding("something_else") is None


def test_report_refuses_what_is_not_a_complete_run(tmp_path):
    with pytest.raises(FfkvError, match="not an ffkv run directory"):
        write_report(tmp_path)


def test_the_layer_table_has_no_near_uniform_confidence_column(analyzed):
    """The values' mean max p sits at about 1/|V| on small models: the layer table leaves it to the values section."""
    run, _ = analyzed
    page = write_report(run).read_text()
    layers = page.split('id="layers"')[1].split("</table>")[0]
    assert "agreement rate" in layers and "confidence" not in layers


def test_the_report_cites_what_ships_and_names_shallow_keys_one_way(analyzed):
    """No "SPEC" (not shipped): the paper's sections, or docs/definitions.md. The fidelity row's "shallow keys"
    says it counts keys labelled shallow or both."""
    run, _ = analyzed
    page = write_report(run).read_text()
    assert "SPEC" not in page and "docs/definitions.md" in page
    if "shallow keys" in page:
        assert "shallow keys (labelled shallow or both)" in page


def test_no_bare_table_and_no_self_contradicting_heading(tmp_path, analyzed):
    """Issue 43: on the demo (a ReLU model) composition_tau, _scale and _massive had 0 rows and rendered as bare header
    rows; headings read "Paper (Beyond the paper): (Not in the paper.)" and "Paper (Figure 7): (Not in the paper.)";
    the overview's Figure 2 row had a blank reproduces cell. On a ReLU model's real run (OPT) and the GELU fixture."""
    from html import unescape

    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    relu, loaded = make_run(tmp_path / "opt", "opt", n=60)
    analyze(relu, only="composition", n_eval=30, loaded=loaded, progress=False)
    for run in (relu, analyzed[0]):
        page = unescape(write_report(run).read_text())
        for name in ("composition_tau", "composition_scale", "composition_massive"):
            if RunDir(run).read_metric(name).empty:
                block = page.split(f"metrics/{name}.parquet</h4>", 1)[1].split("<h4", 1)[0]
                assert "<table" not in block and "No rows: " in block, (run, name, block[:300])
        assert "Not in the paper" not in page and "Paper (Beyond" not in page
        assert "(Beyond the paper" not in page
        fidelity = page.split('id="fidelity-heading"', 1)[1].split("</table>", 1)[0]
        header = re.findall(r"<th[^>]*>(.*?)</th>", fidelity)
        assert "reproduces" not in [h.lower() for h in header]  # the verdict column says it, once
        column = [h.lower() for h in header].index("verdict")
        rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in fidelity.split("<tr>")[2:]]
        assert rows and all(r[column] in ("yes", "no") or r[column].startswith(("no verdict", "too few", "not shown"))
                            for r in rows), [r[column] for r in rows]
    relu_page = unescape(write_report(relu).read_text())
    block = relu_page.split("metrics/composition_tau.parquet</h4>", 1)[1].split("<h4", 1)[0]
    assert "not applicable to this model: its coefficients are never negative (ReLU)" in block
    assert "Beyond the paper, beside Figure 7:" in block


def test_the_report_names_the_default_studies_a_run_has_not_run(analyzed):
    """A study left out (`ffkv demo` leaves pruning out; `analyze --only`) is named with the command that runs it,
    never silently absent."""
    run, _ = analyzed
    manifest = RunDir(run).manifest()
    missing = [n for n in registry.default_names() if n not in manifest.analyses]
    page = write_report(run).read_text()
    if missing:
        assert f"<dt>not run</dt><dd>{', '.join(missing)}: `ffkv analyze {run} --only {','.join(missing)}`" in page
    else:
        assert "<dt>not run</dt>" not in page
    from ffkv.report.html import not_run_row

    manifest.analyses.pop("values")
    row = not_run_row(RunDir(run), manifest)
    assert row[0] == "not run" and "values" in row[1] and "--only" in row[1]
