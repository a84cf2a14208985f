"""`write_report`: one self-contained HTML file with every figure and table beside the paper's finding."""

from __future__ import annotations

import re

import pytest

from ffkv.errors import FfkvError
from ffkv.presentation.findings import PAPER_FINDINGS, paper_finding
from ffkv.report import write_report
from ffkv.report.content import reading
from ffkv.store.run import RunDir


def test_index_only_run_gets_a_report(index_only):
    path = write_report(index_only)
    assert path == index_only / "report.html"
    page = path.read_text()
    assert 'id="no-analyses"' in page and "ffkv analyze" in page
    assert "tiny-gpt2" in page and "index_seconds" in page  # model and timings
    assert page.count("<tr>") >= 4  # header + one row per layer
    assert not list(index_only.glob(".report.html.*"))  # atomic write leaves nothing behind


def test_every_figure_and_table_is_embedded_beside_its_finding(analyzed):
    run, _ = analyzed
    page = write_report(run).read_text()
    images = re.findall(r'<img class="figure" src="([^"]+)"', page)
    figures = RunDir(run).figure_names()
    assert len(images) == len(figures) >= 9  # every figure of every experiment
    assert all(src.startswith(("data:image/png;base64,", "data:image/svg+xml;base64,")) for src in images)
    for name in list(figures) + RunDir(run).metric_names():
        assert f'id="analysis-{name}"' in page, name
    for figure in ("Figure 2", "Figure 3", "Figure 4", "Figure 5", "Figure 7", "Figure 8", "Figure 9", "Figure 10",
                   "Figure 11", "Table 2", "Table 3"):
        assert figure in page, figure
    values = RunDir(run).read_metric("values")
    first, last = values["agreement_rate"].iloc[0], values["agreement_rate"].iloc[-1]
    assert "This model:" in page and f"goes from {100 * first:.1f}% (layer 1) to {100 * last:.1f}% (layer 3)" in page
    # Per-key tables are summarised per layer, with the label shares of the paper's Figure 2.
    assert re.search(r"label: (shallow|semantic|both|none)", page)
    # Nothing is fetched: no external sources, and a CSP that forbids them.
    assert not re.search(r'(src|href)="(?!data:|http://127\.0\.0\.1:8000|#)', page.replace('href="http://127.0.0.1:8000', ""))
    assert "default-src 'none'" in page
    assert "<script" not in page


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
    names = set(RunDir(run).figure_names()) | set(RunDir(run).metric_names())
    assert all(paper_finding(name) for name in names), [n for n in names if not paper_finding(n)]
    assert paper_finding("composition")["figure"] == "Figure 8"
    assert paper_finding("values_rank") is PAPER_FINDINGS["values_rank"]
    assert paper_finding("something_else") is None
    assert reading("x", None) is None


def test_report_refuses_what_is_not_a_complete_run(tmp_path):
    with pytest.raises(FfkvError, match="not an ffkv run directory"):
        write_report(tmp_path)


def test_per_layer_view_skips_list_columns():
    import numpy as np
    import pandas as pd

    from ffkv.report.html import per_layer_view

    table = pd.DataFrame({"layer": [0, 0, 1, 1], "key": [0, 1, 0, 1], "label": ["a", "b", "a", "a"],
                          "tokens": [np.array([1, 2]), np.array([3]), np.array([4]), np.array([5])],
                          "score": [1.0, 3.0, 2.0, 2.0]})
    out, summarised = per_layer_view(table)
    assert summarised
    assert list(out["mean score"]) == [2.0, 2.0]
    assert list(out["label: a"]) == [0.5, 1.0]
    assert not any(c.startswith("tokens") for c in out.columns)
