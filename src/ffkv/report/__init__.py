"""The HTML report of a run: every figure of `ffkv analyze` next to the paper's finding."""

from ffkv.report.html import write_report

__all__ = ["write_report"]
