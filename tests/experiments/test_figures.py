"""Figures are legible where they are shown: wide figures' text scaled up, axis labels never longer than their axis."""

from __future__ import annotations

from ffkv.experiments.figures import STANDARD_WIDTH, legible, new_figure, plt, save_figure


def test_a_wide_figures_text_is_scaled_to_the_column_it_is_shown_in():
    fig, axes = plt.subplots(1, 2, figsize=(2 * STANDARD_WIDTH, 3.4), constrained_layout=True)
    axes[0].set_title("title")
    axes[0].set_ylabel("% keys")
    before = axes[0].title.get_fontsize(), axes[0].yaxis.label.get_fontsize()
    legible(fig)
    after = axes[0].title.get_fontsize(), axes[0].yaxis.label.get_fontsize()
    assert after[0] == before[0] * 2 and after[1] == before[1] * 2
    plt.close(fig)
    fig, ax = new_figure()
    ax.set_ylabel("short")
    size = ax.yaxis.label.get_fontsize()
    legible(fig)
    assert ax.yaxis.label.get_fontsize() == size  # a standard figure is left as it is
    plt.close(fig)


def test_a_y_label_longer_than_its_axis_is_wrapped_and_stays_inside_the_saved_figure(tmp_path):
    """values_rank's y label ran past its short plot; wrapped, it lies inside the figure."""
    from ffkv.store.run import RunDir

    (tmp_path / "figures").mkdir()
    fig, ax = new_figure(5.5, 2.4)
    ax.plot([1, 2, 3])
    label = "rank of the trigger's next token in p_i (1 = top), over every key of the layer"
    ax.set_ylabel(label)
    legible(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert "\n" in ax.yaxis.label.get_text() and ax.yaxis.label.get_text().replace("\n", " ") == label
    assert ax.yaxis.label.get_window_extent(renderer).height <= ax.get_window_extent(renderer).height
    paths = save_figure(fig, tmp_path, "long_label")
    assert [p.name for p in paths] == ["long_label.png", "long_label.svg"] and RunDir(tmp_path).figure_names()


def test_figure_2_with_its_control_stays_legible(tmp_path):
    """Figure 2 (patterns) beside its random-key control, as `legible` leaves it: no panel collapses (each at
    least 1.5 inches wide where the figure is shown, a column STANDARD_WIDTH wide), no two titles overlap, and
    a legend names the bars' label colours. Three panels in a row, their text scaled by 2.5, collapsed."""
    import numpy as np
    import pandas as pd
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    from ffkv.experiments import patterns
    from ffkv.experiments.registry import Result

    table = {"layer": np.arange(6)}
    for prefix in ("keys", "prefixes"):
        for label, share in (("shallow", 0.5), ("both", 0.1), ("semantic", 0.05), ("none", 0.35)):
            table[f"{prefix}_{label}"] = np.full(6, share)
    for kind in ("shallow", "semantic"):
        for suffix, share in (("", 0.5), ("_ci_low", 0.45), ("_ci_high", 0.55)):
            table[f"keys_any_{kind}_control{suffix}"] = np.full(6, share)
    seen = {}
    # draw is pure: the figure by name, from the result alone (no run, no file written)
    figures = patterns.draw(Result(6, tables={"patterns": pd.DataFrame(table)}))
    assert list(figures) == ["patterns"] and not list(tmp_path.iterdir())
    fig = figures["patterns"]
    legible(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = STANDARD_WIDTH / fig.get_figwidth()
    seen["widths"] = [ax.get_window_extent(renderer).width / fig.dpi * shown for ax in fig.get_axes()]
    titles = {ax.get_title(loc) for ax in fig.get_axes() for loc in ("left", "center")} - {""}
    seen["titles"] = [t.get_window_extent(renderer) for t in fig.findobj(Text) if t.get_text() in titles]
    seen["legend"] = {t.get_text() for legend in fig.findobj(Legend) for t in legend.get_texts()}
    plt.close(fig)
    assert len(seen["widths"]) == 3 and min(seen["widths"]) >= 1.5, seen["widths"]
    titles = seen["titles"]
    assert len(titles) == 2 and not titles[0].overlaps(titles[1])
    assert {"shallow", "both", "semantic", "none"} <= seen["legend"]


def test_a_30_layer_axis_has_at_most_16_labels_that_never_touch():
    """SmolLM2's 30 layers were labelled 1..30 every layer, two-digit numbers running together."""
    from ffkv.experiments.figures import layer_axis

    for n_layers in (12, 16, 24, 30, 32, 80):
        fig, ax = new_figure()
        layer_axis(ax, n_layers)
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels[0] == "1" and len(labels) <= 16 and (n_layers > 16 or len(labels) == n_layers)
        fig.canvas.draw()
        boxes = [t.get_window_extent() for t in ax.get_xticklabels()]
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), n_layers
        plt.close(fig)


def test_the_explanation_figure_shows_the_layers_scored_and_each_explainer_apart():
    import pandas as pd

    from ffkv.experiments.explanations import BY_LAYER, draw
    from ffkv.experiments.registry import Result

    rows = []
    for layer in (0, 14, 29):
        for explainer in ("local:a@1", "openai:http://b/v1#m"):
            row = {"layer": layer, "explainer": explainer}
            for column in ("score", "shuffled", "control", "score_minus_shuffled"):
                row.update({column: 0.1, f"{column}_ci_low": 0.0, f"{column}_ci_high": 0.2, f"n_{column}": 10})
            rows.append(row)
    table = pd.DataFrame(rows)
    for part, n_series in ((table[table["explainer"] == "local:a@1"], 4), (table, 8)):
        fig = draw(Result(30, inputs={BY_LAYER: part}))["explanation_scores"]
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "15", "30"]
        labels = ax.get_legend_handles_labels()[1]
        assert len(labels) == n_series and "own - shuffled (paired by memory)" in labels[3]
        assert (n_series == 4) == all("(" not in label or "paired" in label for label in labels)
        plt.close(fig)
