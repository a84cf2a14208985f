"""Checking what a request asks for, at the door: every bad request gets a 4xx and one clear line."""

from __future__ import annotations

from numbers import Integral
from typing import Mapping

from ffkv.errors import FfkvError
from ffkv.memories.address import quoted, whole_number
from ffkv.store.annotations import LABELS

#: The longest prompt the trace page accepts, in characters (the token limit of the model applies too).
MAX_PROMPT_CHARS = 4000
#: The largest request body read at all (a form with a prompt and the memory switches).
MAX_BODY_BYTES = 256 * 1024
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
    """`text` as an integer in [low, high], or a BadRequest naming the allowed range. Text is read as every
    number a URL gives is (`ffkv.memories.address.whole_number`: ASCII digits, a few of them)."""
    if isinstance(text, Integral) and not isinstance(text, bool):
        value = int(text)
    else:
        try:
            value = whole_number(text, f"{name} must be an integer from {low} to {high}")
        except FfkvError as exc:
            raise BadRequest(str(exc), status) from None
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


def edits(params: dict[str, list[str]], n_layers: int, d_m: int,
          latents: Mapping[int, tuple[str, int]] | None = None) -> dict:
    """The edits a request asks for, written as everywhere (`ffkv.memories.address`, layers from 1): URL
    parameters ``off=L:K``, ``scale=L:K=F``, ``set=L:K=V``, and the trace form's per-memory fields
    ``scale:L:K=F`` and ``set:L:K=V`` (empty ones ignored); with the `latents` of the run's dictionary
    (`MemoryLayout.latents`), a latent's the same way (``off=t4:42``, ``scale:t4:42=2``).

    One edit per memory: a form's field is overridden by a parameter, and "off" (the form's checkbox) wins over
    both. A scale of 1 is no change and is dropped. Returns {memory: edit}, the memory as
    `ffkv.memories.address.edit_ref` names it (a neuron's equal to (layer from 0, key)). Every refusal of
    `parse_edit` (the bound of a factor or value included) is a 422.
    """
    from ffkv.memories.address import edit_ref, parse_edit

    given: list[tuple[str, str]] = []
    for name, values in params.items():
        op, colon, where = name.partition(":")
        if colon and op in ("scale", "set") and values and values[-1].strip() != "":
            given.append((op, f"{where}={values[-1].strip()}"))
    given += [(op, text) for op in ("scale", "set", "off") for text in params.get(op, [])]
    out: dict = {}
    for op, text in given:
        try:
            edit = parse_edit(op, text, n_layers, d_m, latents)
        except FfkvError as exc:
            raise BadRequest(str(exc), 422) from None
        out[edit_ref(edit)] = edit
    if len(out) > MAX_EDITS:
        raise BadRequest(f"an intervention may change at most {MAX_EDITS} memories, got {len(out)}", 422)
    return {ref: e for ref, e in out.items() if not (e.op == "scale" and e.value == 1.0)}


def label(text: str | None) -> str:
    if text not in LABELS:
        raise BadRequest(f"label must be one of {', '.join(LABELS)}, got {quoted(text)}", 422)
    return text


def short_text(text: str | None, name: str, limit: int) -> str:
    text = (text or "").strip()
    if len(text) > limit:
        raise BadRequest(f"{name} has {len(text):,} characters; the limit is {limit:,}", 413)
    return text
