"""Saving figures: PNG and SVG side by side in RUN/figures/, written atomically (by rank 0 alone), Agg backend."""

from __future__ import annotations

import textwrap
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
    """Layers numbered 1..L on the x axis, as in the paper's figures: at most 16 labels, so that two-digit
    numbers never run together (every other layer of a 30-layer model)."""
    ax.set_xlabel("layer")
    step = max(1, -(-n_layers // 16))
    ax.set_xticks(range(0, n_layers, step))
    ax.set_xticklabels([str(i + 1) for i in range(0, n_layers, step)])


def legend_outside(ax, **kwargs) -> None:
    """The legend below the plot, outside the axes, so that it never covers data (the figure's constrained
    layout makes room for it)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        kwargs.setdefault("fontsize", 9)
        kwargs.setdefault("ncol", min(len(handles), 3))
        kwargs.setdefault("handlelength", 3.5)  # long enough for a dashed or dotted series to read as one
        ax.figure.legend(handles, labels, frameon=False, loc="outside lower center", **kwargs)


def interval_bars(ax, x, table, column: str, scale: float = 100.0) -> None:
    """Error bars of a share's 95% interval (columns COLUMN_ci_low, COLUMN_ci_high), in percent by default."""
    value = scale * table[column].to_numpy(float)
    low = scale * table[f"{column}_ci_low"].to_numpy(float)
    high = scale * table[f"{column}_ci_high"].to_numpy(float)
    below, above = np.clip(value - low, 0, None), np.clip(high - value, 0, None)  # rounding only
    ax.errorbar(x, value, yerr=[np.nan_to_num(below), np.nan_to_num(above)], fmt="none", ecolor="black", elinewidth=0.8, capsize=2)


#: Inches: the width of `new_figure`'s figures. The report and the explorer show every figure in one column, so a
#: wider figure is shown scaled down: `legible` scales its text up by as much first.
STANDARD_WIDTH = 5.5


def legible(fig) -> None:
    """Make a figure's text readable where it is shown: fonts scaled by the figure's width over `STANDARD_WIDTH`
    (a 10-inch figure shown in the same column as a 5.5-inch one), and each axis label longer than its axis
    wrapped onto as many lines as it needs (a y label taller than a short plot is cut off)."""
    from matplotlib.text import Text

    scale = fig.get_figwidth() / STANDARD_WIDTH
    if scale > 1.05:
        for text in fig.findobj(Text):
            text.set_fontsize(text.get_fontsize() * scale)
    fig.draw_without_rendering()  # lays the figure out and sizes its text, without rasterising it
    renderer = fig.canvas.get_renderer()
    for ax in fig.get_axes():
        box = ax.get_window_extent(renderer)
        for label, room, long in ((ax.yaxis.label, box.height, "height"), (ax.xaxis.label, box.width, "width")):
            text = label.get_text()
            length = getattr(label.get_window_extent(renderer), long)
            if text and "\n" not in text and length > room:
                label.set_text(textwrap.fill(text, max(8, int(len(text) * 0.95 * room / length))))


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
    """Write RUN/figures/NAME.png and NAME.svg atomically (`legible` first); close the figure. Returns the paths
    written (none on ranks other than 0 under torchrun: rank 0 alone writes)."""
    run = RunDir(run_path)
    paths = []
    try:
        if is_writer():
            legible(fig)
        for fmt in ("png", "svg") if is_writer() else ():
            path = run.figure_path(name, fmt)
            with atomic.atomic_path(path) as tmp:
                fig.savefig(tmp, format=fmt, dpi=130 if fmt == "png" else None, bbox_inches="tight",
                            metadata={"Date": None} if fmt == "svg" else None)
            paths.append(path)
    finally:
        plt.close(fig)
    return paths


def share_curves(layers, curves, title: str, null: str | None = None):
    """A figure of per-layer shares in % with their 95% intervals: `curves` is (column, label, color) each; with
    `null` (a label) each column's COLUMN_control share, where the table has it, is drawn dashed beside it.
    Returns the figure (not saved)."""
    fig, ax = new_figure()
    x = layers["layer"].to_numpy()
    for column, label, color in curves:
        ax.plot(x, 100 * layers[column], "o-", color=color, label=label, markersize=3)
        interval_bars(ax, x, layers, column)
        if null is not None and f"{column}_control" in layers:
            ax.plot(x, 100 * layers[f"{column}_control"], "--", color=color, alpha=0.6, label=f"{label}, {null}")
    layer_axis(ax, len(layers))
    ax.set_ylabel("% of the layer's memories")
    ax.set_title(title, fontsize=9)
    legend_outside(ax)
    return fig


#: The colours of the two kinds of memories wherever they stand side by side.
KIND_COLORS = {"neurons": "#4C72B0", "latents": "#DD8452"}


def latent_figure(result, name: str, draw) -> dict:
    """{name: draw(table)} for a study's latent table `name` where the result holds it with rows (a run indexed with
    a dictionary), else {}: the figure beside the neurons' that a latent study adds."""
    table = result.tables.get(name)
    return {name: draw(table)} if table is not None and not table.empty else {}


def kinds_beside(table, kinds, ylabel: str, title: str):
    """Neurons and a dictionary's latents on one axis, per layer of `table` (its ``layer`` column, from 0): for
    each kind (name, column, control column, chance column or None), a bar of the share in % with its 95%
    interval (COLUMN_ci_low, COLUMN_ci_high), its random-direction control as a cross and its chance level as a
    dash, each beside its own kind. Returns the figure (not saved)."""
    fig, ax = new_figure()
    x = np.arange(len(table))
    shifts = np.linspace(-0.2, 0.2, len(kinds))
    for shift, (name, column, control, chance) in zip(shifts, kinds):
        ax.bar(x + shift, 100 * table[column], width=0.4, label=name, color=KIND_COLORS.get(name, COLORS["none"]))
        interval_bars(ax, x + shift, table, column)
        if control in table:
            ax.plot(x + shift, 100 * table[control], ls="none", marker="x", ms=7, color="black",
                    label="its random directions" if shift == shifts[0] else None)
        if chance is not None and chance in table:
            ax.plot(x + shift, 100 * table[chance], ls="none", marker="_", ms=14, mew=2, color=COLORS["chance"],
                    label="its chance level" if shift == shifts[0] else None)
    ax.set_xticks(x)
    ax.set_xlim(-1, len(table))
    ax.set_xticklabels([str(int(layer) + 1) for layer in table["layer"]])
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    legend_outside(ax)
    return fig
