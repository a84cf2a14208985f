"""The look shared by the report and the explorer: one stylesheet, token rendering, number formats, and the
one numbering of layers a person reads."""

from __future__ import annotations

import math

from markupsafe import Markup, escape

#: Markup, so that templates insert it as it is: escaped, its quoted font names would break the stylesheet.
CSS = Markup("""
:root { --fg:#1d232b; --muted:#66707c; --line:#dde2e8; --accent:#2f6db5; --bar:#8fb4e3; --mark:#ffe28a;
        --bg:#ffffff; --soft:#f5f7fa; --bad:#b3261e; --good:#1e7b34; }
* { box-sizing: border-box; }
body { font: 15px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, "Liberation Sans", "DejaVu Sans",
       sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 1rem 1.5rem 4rem; }
header.top { background: var(--soft); border-bottom: 1px solid var(--line); padding: .6rem 1.5rem; }
header.top a { margin-right: 1.2rem; font-weight: 600; }
a { color: var(--accent); text-decoration: none; } a:hover { text-decoration: underline; }
h1 { font-size: 1.5rem; margin: 1rem 0 .5rem; } h2 { font-size: 1.2rem; margin: 1.8rem 0 .5rem; }
h3 { font-size: 1.05rem; margin: 1.2rem 0 .4rem; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: .9rem; }
th, td { border-bottom: 1px solid var(--line); padding: .25rem .6rem; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td .ci { display: block; white-space: nowrap; color: var(--muted); font-size: .85em; }
.muted { color: var(--muted); } .small { font-size: .85rem; }
.tok { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; white-space: pre; background: var(--soft);
       border: 1px solid var(--line); border-radius: 3px; padding: 0 .2em; font-size: .88em; }
.example { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: .85rem; white-space: pre-wrap;
           word-break: break-word; }
.example .rest { color: #9aa3ad; } .example mark { background: var(--mark); font-weight: 700; padding: 0 1px; }
.example .next { border-bottom: 2px solid var(--accent); color: var(--fg); }
.bar { display: inline-block; height: .8em; background: var(--bar); vertical-align: middle; min-width: 1px; }
.bar.neg { background: #e39a9d; }
.barcell { width: 130px; white-space: nowrap; }
.finding { background: var(--soft); border-left: 4px solid var(--accent); padding: .5rem .8rem; margin: .5rem 0; }
.reading { border-left: 4px solid var(--good); padding: .5rem .8rem; margin: .5rem 0; }
figure { margin: .5rem 0 1rem; } figure img { max-width: 100%; border: 1px solid var(--line); }
.figure-block { display: grid; grid-template-columns: minmax(0, 3fr) minmax(0, 2fr); gap: 1.2rem; align-items: start; }
@media (max-width: 900px) { .figure-block { grid-template-columns: 1fr; } }
td.pred { white-space: nowrap; } td.pred .target-p { display: block; color: var(--muted); }
/* the trace's memories: chips wrap inside their cell, each with its edit fields */
td.mems { min-width: 24rem; } td.mems .chip { white-space: normal; }
.changed { background: #fff1cc; font-weight: 600; }
.error { border-left: 4px solid var(--bad); padding: .6rem 1rem; background: #fdf0ef; }
.warn { border-left: 4px solid #c98a00; padding: .5rem 1rem; background: #fff8e6; }
.chip { display: inline-block; margin: 0 .35rem .25rem 0; padding: 0 .3rem; border: 1px solid var(--line);
        border-radius: 4px; background: var(--bg); white-space: nowrap; font-size: .85rem; }
.chip input[type=number] { width: 4.2em; }
textarea, input[type=text], select { font: inherit; padding: .3rem; border: 1px solid var(--line); border-radius: 4px; }
textarea { width: 100%; }
button { font: inherit; padding: .3rem .9rem; border: 1px solid var(--accent); background: var(--accent);
         color: white; border-radius: 4px; cursor: pointer; }
.label-shallow { color: #7a4d00; } .label-semantic { color: #1e5c9b; } .label-both { color: #5b2d8c; }
dl.run { display: grid; grid-template-columns: max-content 1fr; gap: .2rem 1rem; }
dl.run dt { font-weight: 600; } dl.run dd { margin: 0; }
/* A wide table scrolls sideways inside its own box, never past the window, its first column in view. A long one
   (.long: a page of a layer's memories) also scrolls down inside a box at most most of the window high, so that its
   header stays in view and its horizontal scrollbar is on screen whenever the table is; a short one shows every row
   on the page itself, none hidden below a box's edge. */
.scroll { overflow-x: auto; max-width: 100%; }
.scroll.long { overflow: auto; max-height: 85vh; }
.scroll table { margin: 0; }
.scroll th { position: sticky; top: 0; z-index: 2; }
.scroll tr > :first-child { position: sticky; left: 0; z-index: 1; background: var(--bg); }
.scroll tr > th:first-child { z-index: 3; background: var(--soft); }
td.desc { min-width: 15rem; max-width: 28rem; } td.toks { white-space: nowrap; }
.cmd { white-space: nowrap; }  /* an option and its value never part across lines */
nav.toc { background: var(--soft); border-left: 4px solid var(--accent); padding: .4rem .8rem; margin: .6rem 0; }
.note { font-size: .85rem; color: var(--muted); margin: .2rem 0 .6rem; }
.pair { display: grid; grid-template-columns: repeat(auto-fit, minmax(300px, 1fr)); gap: 1.2rem; align-items: start; }
.switch a, .switch span { margin-right: .2rem; padding: .1rem .5rem; border: 1px solid var(--line); border-radius: 4px; }
.switch .on { background: var(--accent); color: white; border-color: var(--accent); }
.tokens { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: .85rem; line-height: 1.9;
          white-space: pre-wrap; word-break: break-word; }
.tokens .t { border-radius: 2px; padding: 1px 0; background: rgba(46,120,214,var(--a,0)); }
.tokens .t.neg { background: rgba(214,64,69,var(--a,0)); }
.tokens .t.trig { outline: 2px solid var(--fg); outline-offset: 0; font-weight: 700; }
.tokens .t.nx { text-decoration: underline 2px var(--accent); text-underline-offset: 3px; }
.tokens .t.after { color: #5d6670; }
.tokens .t.part { display: inline-block; min-width: .3em; }
.tokens .gap { color: var(--muted); padding: 0 .2em; }
.tokens .nm { background: repeating-linear-gradient(135deg, transparent 0 3px, rgba(102,112,124,.22) 3px 4px); }
.tokens .nm.after { color: #5d6670; }
.strip { display: flex; flex-wrap: wrap; gap: .2rem; margin: .4rem 0; }
.strip button { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: .85rem; white-space: pre;
                background: var(--soft); color: var(--fg); border: 1px solid var(--line); padding: .1rem .3rem; }
.strip button.on { background: var(--mark); border-color: #c9a100; font-weight: 700; }
th a { color: var(--fg); } th a.on { color: var(--accent); }
mark.hit { background: var(--mark); padding: 0; }
details > summary { cursor: pointer; color: var(--accent); font-size: .85rem; }
.prediction { font-size: 1.05rem; margin: .4rem 0; }
.gen { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: .9rem; white-space: pre-wrap; }
.gen .new { background: #e7f0fb; } .gen .diff { background: #fff1cc; font-weight: 600; }
.fidelity td.yes { color: var(--good); font-weight: 600; } .fidelity td.no { color: var(--bad); font-weight: 600; }
.warning { border-left: 4px solid #c98a00; background: #fff8e6; padding: .4rem .8rem; margin: .4rem 0; font-size: .9rem; }
svg text { font: 11px Arial, "Liberation Sans", "DejaVu Sans", sans-serif; fill: var(--muted); }
.chip.neg { border-color: #e6b8ba; background: #fdf4f4; }
.chip.latent { border-style: dashed; background: #f7f4fc; }
.beside .what { display: block; color: var(--muted); font-size: .8em; }
.beside td.measure { min-width: 13rem; } .beside th.kind { text-align: center; } .beside th { white-space: nowrap; }
.beside td.difference { min-width: 9rem; } .beside td.verdict { min-width: 9rem; }
.fidelity-beside { background: var(--soft); border-left: 4px solid var(--accent); padding: .4rem .8rem; margin: .4rem 0; }
/* the forest figure's colours (latents_beside.draw): orange latents higher, blue neurons higher */
.verdict-latents { color: #b4561b; font-weight: 600; } .verdict-neurons { color: #35568f; font-weight: 600; }
.verdict-none { color: var(--muted); }
""")

#: Layers as a person reads them (figures, the report, the explorer's pages and URLs, CLI output) count
#: from 1, as the paper does; the run's Parquet tables, the notebook API and code count from 0.
FIRST_LAYER = 1


def layer_number(index: int) -> int:
    """The layer a person reads for a 0-based layer index."""
    return int(index) + FIRST_LAYER


#: Control characters drawn visibly: newline, tab and return as arrows, the other C0 controls and DEL as their
#: byte, <0x00>, as byte tokens read (`ffkv.models.tokenizer`; common fonts have no glyph for U+2400-U+2421).
VISIBLE = {**{chr(c): f"<0x{c:02X}>" for c in (*range(32), 127)}, "\n": "↵", "\t": "⇥", "\r": "↵"}
_VISIBLE = str.maketrans(VISIBLE)


def visible(text: str | None) -> str:
    """A token's text with its control characters made visible (`VISIBLE`); other text as it is."""
    return "" if text is None else str(text).translate(_VISIBLE)


def with_code(text: str | None) -> Markup:
    """A line of ffkv's prose (a skipped study's reason, a note) as HTML: escaped, each `backticked` command or
    name set as code, as the command line prints it between backticks."""
    parts = str(text or "").split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: shown as it is
        return Markup(escape(str(text or "")))
    return Markup("".join(f"<code>{escape(p)}</code>" if i % 2 else str(escape(p)) for i, p in enumerate(parts)))


def token_html(text: str | None) -> Markup:
    """A token as a visible chip: escaped, spaces kept, control characters shown (`visible`)."""
    return Markup('<span class="tok">') + escape(visible(text)) + Markup("</span>")


def _as_float(value) -> float | str:
    """value as a float, "" when missing or NaN, or its text when it is not a number."""
    if value is None:
        return ""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "" if math.isnan(value) else value


def number(value, digits: int = 3) -> str:
    """A short readable number (blank for missing)."""
    value = _as_float(value)
    if isinstance(value, str):
        return value
    if value == 0:
        return "0"
    if value.is_integer() and abs(value) < 1e9:
        return f"{int(value):,}"
    if 1000 <= abs(value) < 1e9:  # a rank of 2,360.5 reads 2,360, not 2.36e+03
        return f"{value:,.0f}"
    if abs(value) >= 1e9 or abs(value) < 10 ** -digits:
        return f"{value:.{digits}g}"
    return f"{value:.{digits}f}"


def percent(value, digits: int = 1) -> str:
    """A share as a percentage (blank for missing); shares too small for `digits` keep two significant digits,
    so that 0.00031 reads 0.031%, not 0.0%."""
    value = _as_float(value)
    if isinstance(value, str):
        return value
    if value != 0 and abs(100 * value) < 0.5 * 10 ** -digits:
        return f"{100 * value:.2g}%"
    return f"{100 * value:.{digits}f}%"
