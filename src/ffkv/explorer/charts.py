"""Small inline SVG charts of the explorer's pages (no scripts, no images to fetch)."""

from __future__ import annotations

import math

from markupsafe import Markup, escape

from ffkv.presentation.style import number


def histogram_svg(counts: list[int], lo: float, hi: float, width: int = 560, height: int = 150,
                  label: str = "m") -> Markup:
    """Bars of `counts` over equal bins from lo to hi, heights on a log scale (log10(1 + count)),
    with the axis at m = 0 marked when it falls inside. Hover a bar for its range and count."""
    if not counts:
        return Markup("")
    left, bottom, top = 44, 26, 8
    plot_w, plot_h = width - left - 10, height - bottom - top
    peak = math.log10(1 + max(counts)) or 1.0
    bar_w = plot_w / len(counts)
    step = (hi - lo) / len(counts) if len(counts) else 0.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="histogram of {escape(label)}" class="histogram">']
    for i, c in enumerate(counts):
        h = plot_h * math.log10(1 + c) / peak
        x = left + i * bar_w
        a, b = lo + i * step, lo + (i + 1) * step
        parts.append(f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{max(bar_w - 1, 1):.1f}" height="{h:.1f}" '
                     f'fill="#8fb4e3"><title>{escape(label)} in [{number(a)}, {number(b)}): {c:,} positions</title></rect>')
    if lo < 0 < hi:
        x0 = left + (0 - lo) / (hi - lo) * plot_w
        parts.append(f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{top}" y2="{top + plot_h}" stroke="#1d232b" '
                     'stroke-dasharray="3 2" stroke-width="1"/>')
        parts.append(f'<text x="{x0:.1f}" y="{height - 4}" text-anchor="middle">0</text>')
    parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#66707c"/>')
    parts.append(f'<text x="{left}" y="{height - 4}" text-anchor="start">{escape(number(lo))}</text>')
    parts.append(f'<text x="{left + plot_w}" y="{height - 4}" text-anchor="end">{escape(number(hi))}</text>')
    parts.append(f'<text x="{left - 4}" y="{top + 10}" text-anchor="end">{max(counts):,}</text>')
    parts.append(f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
