"""Checking what a request asks for, at the door: every bad request gets a 4xx and one clear line."""

from __future__ import annotations

import math

from ffkv.errors import FfkvError
from ffkv.store.annotations import LABELS

#: The longest prompt the trace page accepts, in characters (the token limit of the model applies too).
MAX_PROMPT_CHARS = 4000
#: The largest request body read at all (a form with a prompt and the memory switches).
MAX_BODY_BYTES = 256 * 1024
#: Largest |scale| an intervention may apply to a memory.
MAX_SCALE = 1e4
#: Most memories one intervention may touch.
MAX_EDITS = 4096
#: Most tokens the trace page generates.
MAX_NEW_TOKENS = 64


class BadRequest(FfkvError):
    """A request the explorer cannot answer; `status` is the HTTP status to send (4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def integer(text: str | int | None, name: str, low: int, high: int, status: int = 404) -> int:
    """`text` as an integer in [low, high], or a BadRequest naming the allowed range."""
    try:
        value = int(str(text).strip())
    except (TypeError, ValueError):
        raise BadRequest(f"{name} must be an integer from {low} to {high}, got {str(text)[:40]!r}", status) from None
    if not low <= value <= high:
        raise BadRequest(f"{name} {value} does not exist: this run has {name}s {low} to {high}", status)
    return value


def layer_key(layer: str | int, key: str | int, n_layers: int, d_m: int, status: int = 404) -> tuple[int, int]:
    """(layer index, key) from a layer as pages and URLs write it, counted from 1, and a key (0-based id)."""
    return (integer(layer, "layer", 1, n_layers, status) - 1, integer(key, "key", 0, d_m - 1, status))


def prompt(text: str | None) -> str:
    """A prompt for the trace page: not empty, not longer than MAX_PROMPT_CHARS."""
    if text is None or not text.strip():
        raise BadRequest("the prompt is empty: type some text to trace", 422)
    if len(text) > MAX_PROMPT_CHARS:
        raise BadRequest(f"the prompt has {len(text):,} characters; the limit is {MAX_PROMPT_CHARS:,}", 413)
    return text


def scale(text: str, where: str) -> float:
    """A finite scale factor for a memory."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise BadRequest(f"scale of memory {where} must be a number, got {str(text)[:40]!r}", 422) from None
    if not math.isfinite(value) or abs(value) > MAX_SCALE:
        raise BadRequest(f"scale of memory {where} must be a finite number within ±{MAX_SCALE:g}", 422)
    return value


def edits(off: list[str], scaled: list[str], fields: dict[str, str], n_layers: int, d_m: int
          ) -> dict[tuple[int, int], float]:
    """Interventions from a request: `off=L:K`, `scale=L:K:S`, and form fields `scale:L:K=S` (L counted from 1).

    Returns {(layer index, key): scale}; a scale of 1 is no change and is dropped, 0 switches a memory off.
    """
    out: dict[tuple[int, int], float] = {}

    def parse_lk(text: str) -> tuple[int, int]:
        parts = text.split(":")
        if len(parts) != 2:
            raise BadRequest(f"a memory is written LAYER:KEY (layers from 1), e.g. 3:17; got {text[:40]!r}", 422)
        return layer_key(parts[0], parts[1], n_layers, d_m, 422)

    for name, value in fields.items():
        if name.startswith("scale:") and value.strip() != "":
            where = name[len("scale:"):]
            out[parse_lk(where)] = scale(value, where)
    for text in scaled:
        head, _, value = text.rpartition(":")
        lk = parse_lk(head)
        out[lk] = scale(value, head)
    for text in off:
        out[parse_lk(text)] = 0.0
    if len(out) > MAX_EDITS:
        raise BadRequest(f"an intervention may change at most {MAX_EDITS} memories, got {len(out)}", 422)
    return {lk: s for lk, s in out.items() if s != 1.0}


def label(text: str | None) -> str:
    if text not in LABELS:
        raise BadRequest(f"label must be one of {', '.join(LABELS)}, got {str(text)[:40]!r}", 422)
    return text


def short_text(text: str | None, name: str, limit: int) -> str:
    text = (text or "").strip()
    if len(text) > limit:
        raise BadRequest(f"{name} has {len(text):,} characters; the limit is {limit:,}", 413)
    return text
