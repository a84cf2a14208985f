"""Saving figures: PNG and SVG side by side in RUN/figures/, written atomically (by rank 0 alone), Agg backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display needed; set before pyplot is imported anywhere here
import matplotlib.pyplot as plt  # noqa: E402

from ffkv.parallel import is_writer  # noqa: E402
from ffkv.store import atomic  # noqa: E402
from ffkv.store.run import RunDir  # noqa: E402

plt.rcParams.update({"svg.hashsalt": "ffkv", "figure.dpi": 100, "font.size": 9,
                     "axes.spines.top": False, "axes.spines.right": False})

COLORS = {"shallow": "#4C72B0", "semantic": "#DD8452", "both": "#55A868", "none": "#BBBBBB",
          "first": "#4C72B0", "last": "#C44E52", "random": "#8C8C8C",
          "kept": "#4C72B0", "override": "#C44E52", "composition": "#55A868", "chance": "#8C8C8C"}


def new_figure(width: float = 5.5, height: float = 3.4):
    """A figure and one axis."""
    return plt.subplots(figsize=(width, height), constrained_layout=True)


def layer_axis(ax, n_layers: int) -> None:
    """Layers numbered 1..L on the x axis, as in the paper's figures."""
    ax.set_xlabel("layer")
    step = max(1, n_layers // 16)
    ax.set_xticks(range(0, n_layers, step))
    ax.set_xticklabels([str(i + 1) for i in range(0, n_layers, step)])


def legend_outside(ax, **kwargs) -> None:
    """The legend below the plot, outside the axes, so that it never covers data (the figure's constrained
    layout makes room for it)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        kwargs.setdefault("fontsize", 8)
        kwargs.setdefault("ncol", min(len(handles), 3))
        ax.figure.legend(handles, labels, frameon=False, loc="outside lower center", **kwargs)


def interval_bars(ax, x, table, column: str, scale: float = 100.0) -> None:
    """Error bars of a share's 95% interval (columns COLUMN_ci_low, COLUMN_ci_high), in percent by default."""
    value = scale * table[column].to_numpy(float)
    low = scale * table[f"{column}_ci_low"].to_numpy(float)
    high = scale * table[f"{column}_ci_high"].to_numpy(float)
    below, above = np.clip(value - low, 0, None), np.clip(high - value, 0, None)  # rounding only
    ax.errorbar(x, value, yerr=[np.nan_to_num(below), np.nan_to_num(above)], fmt="none", ecolor="black", elinewidth=0.8, capsize=2)


def chance_line(ax, x, table, column: str, label: str = "chance", scale: float = 100.0) -> None:
    """The chance level of a share (column COLUMN_chance, with its interval COLUMN_chance_ci_low/high) as a
    dashed line with a band, so that every observed bar or point is read against it."""
    if f"{column}_chance" not in table:
        return
    x = np.asarray(x, dtype=float)
    value = scale * table[f"{column}_chance"].to_numpy(float)
    ax.plot(x, value, color="black", ls="--", lw=1.1, marker="_", ms=10, label=label)
    if f"{column}_chance_ci_low" in table:
        ax.fill_between(x, scale * table[f"{column}_chance_ci_low"].to_numpy(float),
                        scale * table[f"{column}_chance_ci_high"].to_numpy(float), color=COLORS["chance"], alpha=0.25,
                        lw=0)


def save_figure(fig, run_path: str | Path, name: str) -> list[Path]:
    """Write RUN/figures/NAME.png and NAME.svg atomically; close the figure. Returns the paths written
    (none on ranks other than 0 under torchrun: rank 0 alone writes)."""
    run = RunDir(run_path)
    paths = []
    try:
        for fmt in ("png", "svg") if is_writer() else ():
            path = run.figure_path(name, fmt)
            with atomic.atomic_path(path) as tmp:
                fig.savefig(tmp, format=fmt, dpi=130 if fmt == "png" else None, bbox_inches="tight",
                            metadata={"Date": None} if fmt == "svg" else None)
            paths.append(path)
    finally:
        plt.close(fig)
    return paths
