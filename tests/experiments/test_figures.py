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
