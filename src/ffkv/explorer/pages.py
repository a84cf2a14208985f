"""Server-rendered HTML of the explorer's pages, from `ExplorerData` and traces.

The same functions render the pages of `ffkv serve` and the inline HTML of notebook
objects, so both show the same thing.
"""

from __future__ import annotations

import math
from pathlib import Path

import jinja2
import pandas as pd

from ffkv.explorer.data import ExplorerData
from ffkv.explorer.templates import TEMPLATES
from ffkv.explorer.tracing import TraceResult
from ffkv.explorer.validation import MAX_PROMPT_CHARS, BadRequest
from ffkv.presentation.findings import paper_finding
from ffkv.presentation.style import CSS, number, percent, token_html
from ffkv.presentation.summary import manifest_summary
from ffkv.store.annotations import LABELS

ENV = jinja2.Environment(loader=jinja2.DictLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined,
                         trim_blocks=False)
ENV.globals.update(css=CSS, fmt=number, pct=percent, tok=token_html)

#: Layer-page sort keys -> column of `ExplorerData.layer_keys`.
SORTS = {
    "key": "key", "agreement": "agreement", "confidence": "confidence", "pattern": "label",
    "activation frequency": "activation_frequency", "next-token rank": "next_token_rank",
    "shallow share": "shallow_share", "value norm": "value_norm", "human label": "human_label",
}
PAGE_SIZE = 100


def _common(data: ExplorerData, root: str) -> dict:
    return {"root": root, "run_name": data.run.path.name, "has_report": data.run.report_path.exists(),
            "n_layers": data.n_layers, "d_m": data.d_m}


def render(name: str, **context) -> str:
    return ENV.get_template(name).render(**context)


def error_page(status: int, reason: str, message: str, run_name: str = "", root: str = "") -> str:
    return render("error.html", status=status, reason=reason, message=message, run_name=run_name,
                  root=root, has_report=False)


def figures_of(data: ExplorerData) -> list[dict]:
    """Figures of `ffkv analyze` (PNG preferred, else SVG) with the paper's finding for each."""
    out = []
    for name, path in data.run.figure_names().items():
        finding = paper_finding(name)
        out.append({"name": name, "path": path.relative_to(data.run.path).as_posix(),
                    "finding": finding.get("finding") if finding else None,
                    "paper_figure": finding.get("figure") if finding else None})
    return out


def overview(data: ExplorerData, root: str = "") -> str:
    summary = data.layer_summary()
    return render("overview.html", **_common(data, root), run_rows=manifest_summary(data.manifest),
                  summary_columns=list(summary.columns), summary_rows=summary.to_dict("records"),
                  figures=figures_of(data))


def layer_page(data: ExplorerData, layer, sort: str = "key", order: str = "asc", page=0, root: str = "") -> str:
    layer = data.check(layer, 0)[0]
    table = data.layer_keys(layer)
    sort_columns = dict(SORTS)
    if "label" not in table.columns:  # no automatic labels yet: the pattern is the human label
        sort_columns["pattern"] = "human_label"
    sorts = [s for s, c in sort_columns.items() if c in table.columns]
    if sort not in sorts:
        raise BadRequest(f"cannot sort by {sort[:40]!r}; choose from {', '.join(sorts)}", 422)
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be asc or desc, got {order[:20]!r}", 422)
    try:
        page = int(page)
    except (TypeError, ValueError):
        raise BadRequest(f"page must be a number, got {str(page)[:20]!r}", 422) from None
    n_pages = max(1, math.ceil(len(table) / PAGE_SIZE))
    if not 0 <= page < n_pages:
        raise BadRequest(f"page {page} does not exist: this layer has pages 0 to {n_pages - 1}", 404)
    column = sort_columns[sort]
    table = table.sort_values([column, "key"], ascending=[order == "asc", True], na_position="last", kind="stable")
    rows = table.iloc[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]
    columns = ["key", "top_token", "confidence", "agreement", "next_token_rank", "activation_frequency",
               "shallow_share", "common_last_token", "value_norm"]
    columns += [c for c in ("label", "description", "pattern") if c in table.columns]
    columns += [c for c in table.columns if c not in columns and c not in (
        "top_token_id", "logsumexp", "common_last_token_id", "human_label", "human_description")]
    columns += ["human_label", "human_description"]
    records = rows.astype(object).where(pd.notna(rows), None).to_dict("records")
    for r in records:
        if r.get("next_token_rank") is not None and r["next_token_rank"] >= 0:
            r["next_token_rank"] = int(r["next_token_rank"]) + 1
        elif "next_token_rank" in r:
            r["next_token_rank"] = None
        r["agreement"] = "yes" if r.get("agreement") else ""
    return render("layer.html", **_common(data, root), layer=layer, sort=sort, order=order, sorts=sorts,
                  page=page, rows=records, columns=columns, n_keys=len(table), first=page * PAGE_SIZE + 1,
                  last=min((page + 1) * PAGE_SIZE, len(table)), token_columns={"top_token", "common_last_token"},
                  percent_columns={"confidence", "activation_frequency", "shallow_share"})


def memory_fragment(data: ExplorerData, layer, key, root: str = "", standalone: bool = True) -> str:
    return render("memory_fragment.html", **_common(data, root), m=data.memory(layer, key), standalone=standalone)


def memory_page(data: ExplorerData, layer, key, root: str = "") -> str:
    return render("memory.html", **_common(data, root), m=data.memory(layer, key), standalone=False,
                  labels=LABELS)


def search_page(data: ExplorerData, token: str | None = None, q: str | None = None, root: str = "") -> str:
    promoting = data.promoting(token) if token is not None else None
    hits = data.text_search(q) if q is not None else None
    return render("search.html", **_common(data, root), token=token, q=q, promoting=promoting, hits=hits)


def trace_view(data: ExplorerData, base: TraceResult, edited: TraceResult | None = None) -> dict:
    """What the trace table shows: per layer, the original predictions and, if given, the edited ones."""
    tok = data.token
    rows = []
    for i, layer in enumerate(base.layers):
        row = {"layer": layer.layer, "memories": []}
        for part in ("before", "ff", "after"):
            old = getattr(layer, part)
            cell = {"token": tok(old.token_id), "prob": old.prob}
            if edited is not None:
                new = getattr(edited.layers[i], part)
                cell.update(new_token=tok(new.token_id), new_prob=new.prob,
                            changed=new.token_id != old.token_id or abs(new.prob - old.prob) >= 5e-5)
            row[part] = cell
        shown = {m["key"] for m in layer.memories}
        memories = list(layer.memories)
        edits = edited.edits if edited is not None else base.edits
        memories += [{"key": k, "coefficient": float(layer.coefficients[k]), "contribution": float("nan"),
                      "scale": None} for (lay, k) in sorted(edits) if lay == layer.layer and k not in shown]
        for m in memories:
            scale = edits.get((layer.layer, m["key"]))
            row["memories"].append({**m, "scale": scale, "top_token": tok(int(data.top_ids[layer.layer, m["key"], 0]))})
        rows.append(row)
    final = []
    for i, pred in enumerate(base.final):
        item = {"token": tok(pred.token_id), "prob": pred.prob}
        if edited is not None:
            new = edited.final[i]
            item.update(new_token=tok(new.token_id), new_prob=new.prob,
                        changed=new.token_id != pred.token_id or abs(new.prob - pred.prob) >= 5e-5)
        final.append(item)
    return {"rows": rows, "final": final, "position": base.position, "n_tokens": len(base.token_ids),
            "token": tok(base.token_ids[base.position])}


def trace_fragment(data: ExplorerData, base: TraceResult, edited: TraceResult | None = None, root: str = "",
                   standalone: bool = True, interactive: bool = False) -> str:
    return render("trace_fragment.html", **_common(data, root), t=trace_view(data, base, edited),
                  compare=edited is not None, standalone=standalone, interactive=interactive)


def trace_page(data: ExplorerData, prompt: str | None, base: TraceResult | None, edited: TraceResult | None,
               root: str = "") -> str:
    return render("trace.html", **_common(data, root), prompt=prompt, max_chars=MAX_PROMPT_CHARS,
                  t=trace_view(data, base, edited) if base is not None else None, compare=edited is not None,
                  standalone=False, interactive=True)
