"""docs/run-directory.md lists every metrics table `ffkv analyze` writes, with every column."""

from __future__ import annotations

import re
from pathlib import Path

from ffkv.store.run import RunDir

DOCS = Path(__file__).resolve().parents[2] / "docs" / "run-directory.md"


def documented_tables() -> dict[str, str]:
    """metrics table name -> its section of the docs."""
    text = DOCS.read_text()
    sections = re.split(r"^### metrics/(\w+)\.parquet\s*$", text, flags=re.M)
    return {name: body.split("\n## ")[0] for name, body in zip(sections[1::2], sections[2::2])}


def test_every_metrics_table_and_column_is_documented(analyzed):
    run, _ = analyzed
    docs = documented_tables()
    for name in RunDir(run).metric_names():
        assert name in docs, f"metrics/{name}.parquet is not in docs/run-directory.md"
        for column in RunDir(run).read_metric(name).columns:
            assert f"`{column}`" in docs[name], f"column {column!r} of metrics/{name}.parquet is not documented"
