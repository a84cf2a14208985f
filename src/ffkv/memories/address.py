"""How a memory and an edit on it are written, everywhere a person reads or types one.

A memory is written ``LAYER:KEY``: LAYER counted from 1 (as the paper, the report, the explorer and the command
count layers), KEY the 0-based index of the key in its layer. In code and in the run's tables layers count from
0. `MemoryRef.parse` and `str(MemoryRef)` are the one place the two meet.

An edit (`Intervention`) is one of three operations, written the same way in the command line, the explorer's
URLs and forms, and the library:

- ``off`` ``L:K``: switch the memory off (m' = 0);
- ``scale`` ``L:K=F``: multiply its coefficient by F (m' = F·m);
- ``set`` ``L:K=V``: set its coefficient to V at every position (m' = V).

`ffkv intervene RUN --off 3:17 --scale 2:5=2 --set 1:0=4` and the explorer's
``/trace?prompt=...&off=3:17&scale=2:5=2&set=1:0=4`` mean the same edits; `edit_text` prints them back.

A latent of a sparse dictionary (`ffkv.dictionaries`) is a memory of its own, written with its kind's prefix:
``tLAYER:LATENT`` for a transcoder's latent, ``sLAYER:LATENT`` for an SAE's (layer from 1, latent from 0), e.g.
``t4:1234``. `LatentRef` writes one; `MemoryLayout.parse` reads either kind against the memories a model and
its dictionaries have.

Every number a person or a URL gives for a layer, a key or a latent is read by `whole_number`: the ASCII digits
0-9 and nothing else (Python's ``int()`` would also take ``1_0`` and other scripts' digits, ``４``), at most
`MAX_DIGITS` of them; a refusal quotes what was given cut short (`quoted`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from ffkv.errors import FfkvError
from ffkv.memories.interventions import OPERATIONS, Intervention

#: The most digits a layer, key or latent number may have as written: no model has a billion layers or memories
#: a layer, and a longer number is refused before it is read.
MAX_DIGITS = 9
#: The most characters of what was given that a refusal quotes.
QUOTED_CHARS = 40


def quoted(text: object, limit: int = QUOTED_CHARS) -> str:
    """`text` as a refusal quotes it: its repr, of at most `limit` characters of it, "…" marking a cut."""
    text = str(text)
    return repr(text[:limit]) + ("…" if len(text) > limit else "")


def whole_number(text: object, must: str, given: object = None) -> int:
    """A whole number written by a person or a URL: ASCII digits only (no sign, no underscore, no other script's
    digits), at most `MAX_DIGITS`, space around it ignored. Else a refusal that begins with `must` ("KEY must be
    an integer") and quotes `given` (default: `text`), cut short."""
    digits = str(text).strip()
    if not (0 < len(digits) <= MAX_DIGITS and digits.isascii() and digits.isdigit()):
        raise FfkvError(f"{must} written in the digits 0-9 (at most {MAX_DIGITS}), got "
                        f"{quoted(text if given is None else given)}")
    return int(digits)


class MemoryRef(NamedTuple):
    """One memory: layer (from 0, as in code) and key. Equal to the plain tuple (layer, key)."""

    layer: int
    key: int

    def __str__(self) -> str:
        """``LAYER:KEY`` with the layer counted from 1, as readers count."""
        return f"{self.layer + 1}:{self.key}"

    @classmethod
    def parse(cls, text: str, n_layers: int, d_m: int) -> "MemoryRef":
        """``LAYER:KEY`` (LAYER from 1, KEY from 0) -> the memory, with the layer from 0; a memory this model
        does not have is refused."""
        parts = str(text).strip().split(":")
        if len(parts) != 2:
            raise FfkvError(f"a memory is written LAYER:KEY (layers from 1, keys from 0), e.g. 3:17; got "
                            f"{quoted(text)}")
        layer, key = (whole_number(part, "LAYER and KEY of a memory must be integers", text) for part in parts)
        return cls.check(layer - 1, key, n_layers, d_m)

    @classmethod
    def check(cls, layer: int, key: int, n_layers: int, d_m: int) -> "MemoryRef":
        """(layer from 0, key) of this model, or a refusal that counts layers as readers do."""
        if not 0 <= layer < n_layers:
            raise FfkvError(f"layer {layer + 1} does not exist: this model has layers 1..{n_layers} (counted from 1)")
        if not 0 <= key < d_m:
            raise FfkvError(f"key {key} does not exist: each layer has keys 0..{d_m - 1}")
        return cls(int(layer), int(key))


#: The prefix of a latent's address, by the kind of its dictionary (`ffkv.dictionaries.KINDS`).
LATENT_PREFIX = {"transcoder": "t", "sae": "s"}


class LatentRef(NamedTuple):
    """One latent of a sparse dictionary: layer (from 0, as in code), latent, and its dictionary's kind."""

    layer: int
    latent: int
    kind: str

    def __str__(self) -> str:
        """``tLAYER:LATENT`` (transcoder) or ``sLAYER:LATENT`` (SAE), the layer counted from 1."""
        return f"{LATENT_PREFIX[self.kind]}{self.layer + 1}:{self.latent}"


def latent_kind(text: str) -> str | None:
    """The kind of dictionary whose latents `text` names by its prefix (``t4:42``: "transcoder"), None for text
    that does not begin with one (a neuron's ``4:17``)."""
    return next((k for k, prefix in LATENT_PREFIX.items() if str(text)[:1].lower() == prefix), None)


def latent_address(text: str) -> tuple[str, int, int]:
    """``tLAYER:LATENT`` or ``sLAYER:LATENT`` -> (kind, layer from 0, latent), read as written, whatever model:
    `MemoryLayout.parse` checks that its model has it."""
    text = str(text).strip()
    kind = latent_kind(text)
    parts = text[1:].split(":")
    if kind is None or len(parts) != 2:
        prefix = LATENT_PREFIX.get(kind, "t")
        raise FfkvError(f"a latent is written {prefix}LAYER:LATENT (layers from 1, latents from 0), e.g. {prefix}3:17; "
                        f"got {quoted(text)}")
    layer, latent = (whole_number(part, "LAYER and LATENT of a latent must be integers", text) for part in parts)
    return kind, layer - 1, latent


@dataclass(frozen=True)
class MemoryLayout:
    """The memories one can name in a model: its neurons, and the latents of the dictionaries attached to it.

    Attributes:
        n_layers: the model's FF layers.
        d_m: neurons (keys) per layer.
        latents: FF layer (from 0) -> (kind, number of latents) of its dictionary; empty without one.
    """

    n_layers: int
    d_m: int
    latents: Mapping[int, tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def recorded(cls, n_layers: int, d_m: int, dictionary: Mapping[str, Mapping] | None) -> "MemoryLayout":
        """The layout of a run's model and the dictionary its manifest records (``index.dictionary``: FF layer ->
        its kind and n_latents; None or empty: no dictionary), read without opening the dictionary."""
        return cls(n_layers, d_m, {int(layer): (str(d["kind"]), int(d["n_latents"]))
                                   for layer, d in (dictionary or {}).items()})

    def parse(self, text: str) -> "MemoryRef | LatentRef":
        """``LAYER:KEY`` (a neuron, `MemoryRef.parse`) or ``tLAYER:LATENT`` / ``sLAYER:LATENT`` (a latent); a
        memory this model and its dictionaries do not have is refused, in one line."""
        text = str(text).strip()
        if latent_kind(text) is None:
            return MemoryRef.parse(text, self.n_layers, self.d_m)
        kind, layer, latent = latent_address(text)
        return self.check_latent(layer, latent, kind)

    def check_latent(self, layer: int, latent: int, kind: str | None = None) -> LatentRef:
        """(layer from 0, latent) of a dictionary this model has (of `kind`, if given), or a refusal that counts
        layers as readers do and says which layers have one."""
        if not self.latents:
            raise FfkvError("no sparse dictionary is attached: a latent exists only in a run indexed with "
                            "--dictionary")
        have = ", ".join(f"{LATENT_PREFIX[k]}{lay + 1}" for lay, (k, _) in sorted(self.latents.items()))
        if layer not in self.latents:
            raise FfkvError(f"layer {layer + 1} has no dictionary: latents exist at {have} (layers from 1)")
        own, n = self.latents[layer]
        if kind is not None and kind != own:
            raise FfkvError(f"layer {layer + 1}'s dictionary is a {own}, not a {kind}: write its latents "
                            f"{LATENT_PREFIX[own]}{layer + 1}:LATENT")
        if not 0 <= latent < n:
            raise FfkvError(f"latent {latent} does not exist: {LATENT_PREFIX[own]}{layer + 1} has latents 0..{n - 1}")
        return LatentRef(int(layer), int(latent), own)


def parse_edit(op: str, text: str, n_layers: int, d_m: int,
               latents: Mapping[int, tuple[str, int]] | None = None) -> Intervention:
    """One edit as written: ``off`` ``L:K``, ``scale`` ``L:K=F`` or ``set`` ``L:K=V`` (layers from 1); with the
    `latents` of an attached dictionary (`MemoryLayout.latents`), also of a latent: ``off`` ``t4:42``. F and V
    are bounded where every edit is made (`ffkv.memories.interventions.MAX_EDIT_VALUE`)."""
    if op not in OPERATIONS:
        raise FfkvError(f"unknown edit {quoted(op)}; choose from {', '.join(OPERATIONS)}")
    layout = MemoryLayout(n_layers, d_m, latents or {})
    if op == "off":
        if "=" in text:
            raise FfkvError(f"off: a memory is switched off as LAYER:KEY, without a value; got {quoted(text)}")
        return _edit(layout.parse(text), "off", 0.0)
    head, eq, value = str(text).partition("=")
    if not eq:
        raise FfkvError(f"{op}: expected LAYER:KEY=VALUE (layers from 1), e.g. 3:17=2; got {quoted(text)}")
    memory = layout.parse(head)
    try:
        number = float(value)
    except ValueError:
        raise FfkvError(f"{op}: VALUE must be a number, got {quoted(value)} in {quoted(text)}") from None
    return _edit(memory, op, number)  # `Intervention` bounds the number


def _edit(memory: "MemoryRef | LatentRef", op: str, value: float) -> Intervention:
    kind = memory.kind if isinstance(memory, LatentRef) else "neuron"
    if op == "scale":
        return Intervention.scaled(memory[0], memory[1], value, kind)
    return Intervention(memory[0], memory[1], op, value if op == "set" else 0.0, kind)


def edit_ref(edit: Intervention) -> "MemoryRef | LatentRef":
    """The memory an edit rewrites, as its address."""
    return MemoryRef(edit.layer, edit.key) if edit.kind == "neuron" else LatentRef(edit.layer, edit.key, edit.kind)


def parse_edits(off: Sequence[str] = (), scale: Sequence[str] = (), set_: Sequence[str] = (), *,
                n_layers: int, d_m: int, latents: Mapping[int, tuple[str, int]] | None = None) -> list[Intervention]:
    """The edits as written (`parse_edit`), one per memory: a memory named twice is refused."""
    edits = [parse_edit(op, text, n_layers, d_m, latents)
             for op, texts in (("off", off), ("scale", scale), ("set", set_)) for text in texts]
    return one_per_memory(edits)


def one_per_memory(edits: Iterable[Intervention]) -> list[Intervention]:
    """`edits` unchanged, or a refusal naming the first memory given two edits."""
    out, seen = [], set()
    for edit in edits:
        memory = edit_ref(edit)
        if memory in seen:
            raise FfkvError(f"memory {memory} is named twice; give one edit per memory")
        seen.add(memory)
        out.append(edit)
    return out


def edit_text(edit: Intervention) -> tuple[str, str]:
    """(operation, text) of an edit as `parse_edit` reads it: ("off", "3:17"), ("scale", "3:17=2"),
    ("off", "t4:42")."""
    memory = str(edit_ref(edit))
    return (edit.op, memory) if edit.op == "off" else (edit.op, f"{memory}={_number(edit.value)}")


def _number(value: float) -> str:
    """The shortest text that reads back as `value` ("2", "0.1", "-1.5")."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def edit_label(edit: Intervention | None) -> str:
    """How a page shows an edit beside its memory: "off", "×2", "=4" ("" for none)."""
    if edit is None:
        return ""
    return "off" if edit.op == "off" else f"×{_number(edit.value)}" if edit.op == "scale" else f"={_number(edit.value)}"
