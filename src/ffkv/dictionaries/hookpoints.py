"""Hookpoint names -> (FF layer, site): the one place that knows how libraries spell an FF layer's input and output.

A dictionary's files name where it was trained by a hookpoint: sparsify by a module name (``layers.3.mlp``,
``h.3.mlp``: the module's input is the FF input after its norm, its output the FF output), SAELens by a
TransformerLens hook (``blocks.3.hook_mlp_out``; a transcoder reads ``blocks.3.ln2.hook_normalized``).
ffkv reads dictionaries of FF layers only: an attention, residual-stream or FF-hidden hookpoint is refused
with a sentence saying why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffkv.errors import FfkvError
from ffkv.store.untrusted import quoted

#: Where a dictionary reads or writes: the FF input after its norm, or the FF output.
FF_INPUT, FF_OUTPUT = "ff_input", "ff_output"

_WHAT_FFKV_READS = ("ffkv reads dictionaries of FF layers: a transcoder from the FF input (after its norm) to "
                    "the FF output, or an SAE on the FF output")

# Any prefix (``model.``, ``transformer.``, ``gpt_neox.``, ``model.language_model.``), then the block, whose number
# is ASCII digits (``\d`` would take any script's, which `int` reads too) and at most six of them (`int` refuses
# past 4,300 digits, and no model has a million layers).
_BLOCK = r"^(?:[\w.]*?\.)?(?:layers|layer|h|blocks|block)\.(?P<layer>[0-9]{1,6})"
# (what follows the block, site: FF_INPUT / FF_OUTPUT / "module" / what it is instead, for a refusal)
_TAILS: tuple[tuple[str, str], ...] = (
    (r"\.(?:mlp|feed_forward|ffn|ff)", "module"),
    (r"\.hook_mlp_out", FF_OUTPUT),
    (r"\.(?:ln2|ln_2)\.hook_normalized", FF_INPUT),
    (r"\.hook_mlp_in", "the FF input before its norm (ffkv's keys read the FF input after it: use "
                       "blocks.L.ln2.hook_normalized)"),
    (r"\.(?:mlp|feed_forward|ffn|ff)\..*", "inside the FF layer (its hidden coefficients or one of its "
                                           "matrices), not the FF's input or output"),
    (r"\.(?:attn|attention|self_attn|self_attention)(?:\..*)?|\.hook_attn_(?:in|out)|\.hook_[qkv]_input",
     "attention"),
    (r"|\.hook_resid_(?:pre|mid|post)", "the residual stream"),
    (r"\.(?:ln1|ln_1|ln2|ln_2|input_layernorm|post_attention_layernorm)(?:\..*)?",
     "a norm's output (use the FF layer's own hookpoint, e.g. layers.L.mlp or blocks.L.ln2.hook_normalized)"),
)
_PATTERNS = tuple((re.compile(f"{_BLOCK}(?:{tail})$"), site) for tail, site in _TAILS)


@dataclass(frozen=True)
class Site:
    """Where a hookpoint sits: FF layer `layer`, and `site` = FF_INPUT, FF_OUTPUT or "module" (an FF module's
    name: its input is the FF input, its output the FF output)."""

    layer: int
    site: str


def ff_site(hookpoint: str) -> Site:
    """The FF layer and site a hookpoint names, in any of the common spellings; `FfkvError` (one line, saying
    why) for a hookpoint that is not an FF layer's input or output."""
    for pattern, site in _PATTERNS:
        match = pattern.match(hookpoint)
        if match:
            if site in ("module", FF_INPUT, FF_OUTPUT):
                return Site(int(match["layer"]), site)
            raise FfkvError(f"hookpoint {quoted(hookpoint)} is {site}; {_WHAT_FFKV_READS}")
    raise FfkvError(f"hookpoint {quoted(hookpoint)} names no FF layer ffkv knows (e.g. layers.3.mlp, "
                    f"model.layers.3.mlp, transformer.h.3.mlp, blocks.3.hook_mlp_out, blocks.3.ln2.hook_normalized); "
                    f"{_WHAT_FFKV_READS}")


def sites(kind: str, hookpoint: str, hookpoint_out: str | None = None) -> tuple[int, str, str]:
    """(layer, reads, writes) of a dictionary of `kind` trained at `hookpoint` (and `hookpoint_out`, where a
    transcoder names its output apart); `FfkvError` for a pairing ffkv does not read (an SAE on the FF input,
    a transcoder whose output is another layer's)."""
    read = ff_site(hookpoint)
    if kind == "sae":
        if hookpoint_out not in (None, hookpoint):
            raise FfkvError(f"an SAE reads and writes one hookpoint, but this one names {quoted(hookpoint)} and "
                            f"{quoted(hookpoint_out)}")
        if read.site == FF_INPUT:
            raise FfkvError(f"hookpoint {quoted(hookpoint)} is an SAE on the FF input; {_WHAT_FFKV_READS}")
        return read.layer, FF_OUTPUT, FF_OUTPUT
    if read.site == FF_OUTPUT:
        raise FfkvError(f"hookpoint {quoted(hookpoint)} is the FF output, but a transcoder reads the FF input; "
                        f"{_WHAT_FFKV_READS}")
    if hookpoint_out is not None:
        write = ff_site(hookpoint_out)
        if write.site == FF_INPUT or write.layer != read.layer:
            raise FfkvError(f"a transcoder from {quoted(hookpoint)} to {quoted(hookpoint_out)}: {_WHAT_FFKV_READS} "
                            f"of the same layer")
    return read.layer, FF_INPUT, FF_OUTPUT
