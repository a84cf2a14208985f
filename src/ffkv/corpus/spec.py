"""What corpus to read and how to cut it into examples: one frozen, validated value.

A `CorpusSpec` is written into the run manifest (`to_dict`) and read back
(`from_dict`), so every option that changes the examples lives here (docs/definitions.md).
"""

from __future__ import annotations

import codecs
import os
from dataclasses import asdict, dataclass, fields, replace
from os import PathLike
from typing import Any

from ffkv.errors import FfkvError

FORMATS = ("auto", "text", "wikitext", "jsonl", "parquet", "hf")
UNITS = ("sentence", "line", "document", "window")
SPLITS = ("all", "train", "heldout")
HF_PREFIX = "hf:"
#: The default `max_tokens`; `ffkv index` cuts it to the model's positions when they are fewer.
DEFAULT_MAX_TOKENS = 512


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CorpusSpec:
    """A corpus source and the options that turn it into examples.

    Attributes:
        source: a file, a directory of files (read in sorted path order), or
            ``hf:<dataset id>[:<config>]`` for a Hugging Face dataset.
        format: auto | text | wikitext | jsonl | parquet | hf. ``auto`` decides per
            file from its name (``wiki.*.tokens`` / ``wiki.*.raw`` → wikitext,
            ``.jsonl`` → jsonl, ``.parquet`` → parquet, anything else → text).
        unit: sentence | line | document | window (the example unit, docs/definitions.md).
        window: tokens per window, for ``unit="window"``.
        text_field: the text column/field of jsonl, parquet and hf records.
        split: all | train | heldout. A deterministic hash of the example id puts a
            ``heldout_fraction`` of the examples in ``heldout`` and the rest in ``train``.
        heldout_fraction: share of examples in the held-out split, in (0, 1).
        hf_split: the split of a Hugging Face dataset to read.
        shuffle_seed: with ``max_examples``, keep a seeded uniform random subset
            instead of the first ``max_examples``; on its own it changes nothing
            (examples are always yielded in ascending id order).
        max_examples: keep at most this many examples.
        max_tokens: truncate each example's token ids to this length (the default,
            `DEFAULT_MAX_TOKENS`, is cut to the model's positions by `ffkv index`).
        min_tokens: skip examples with fewer tokens (their ids are not reused).
        wikitext_detokenize: undo WikiText's ``@-@`` escapes and spaces before
            punctuation, so subword tokenizers see normal text; turn it off to keep
            the text verbatim for word-level models trained on WikiText.
        encoding: the text encoding of text, WikiText and JSONL files (a Python codec
            name such as ``utf-8`` or ``latin-1``).
    """

    source: str
    format: str = "auto"
    unit: str = "sentence"
    window: int = 128
    text_field: str = "text"
    split: str = "all"
    heldout_fraction: float = 0.05
    hf_split: str = "train"
    shuffle_seed: int | None = None
    max_examples: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 1
    wikitext_detokenize: bool = True
    encoding: str = "utf-8"

    def __post_init__(self) -> None:
        if isinstance(self.source, PathLike):
            object.__setattr__(self, "source", str(self.source))
        if not isinstance(self.source, str) or not self.source.strip():
            raise FfkvError("corpus source is empty: give a file, a directory, or hf:<dataset id>[:<config>]")
        _choice("format", self.format, FORMATS)
        _choice("unit", self.unit, UNITS)
        _choice("split", self.split, SPLITS)
        if self.source.startswith(HF_PREFIX):
            if self.format not in ("auto", "hf"):
                raise FfkvError(f"corpus source {self.source!r} is a Hugging Face dataset but format is "
                                f"{self.format!r}: use format 'auto' or 'hf'")
            if not self.source[len(HF_PREFIX):].split(":")[0].strip():
                raise FfkvError(f"corpus source {self.source!r} names no dataset: write hf:<dataset id>[:<config>]")
        _positive_int("window", self.window)
        _positive_int("max_tokens", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise FfkvError(f"corpus min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise FfkvError(f"corpus min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens}): "
                            "no example could pass; lower min_tokens or raise max_tokens")
        if self.unit == "window" and self.window > self.max_tokens:
            raise FfkvError(f"corpus window ({self.window}) exceeds max_tokens ({self.max_tokens}): "
                            "windows would be truncated; lower window or raise max_tokens")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise FfkvError(f"corpus text_field must be a non-empty field name, got {self.text_field!r}")
        if not isinstance(self.hf_split, str) or not self.hf_split:
            raise FfkvError(f"corpus hf_split must be a non-empty split name such as 'train', got {self.hf_split!r}")
        if (isinstance(self.heldout_fraction, bool) or not isinstance(self.heldout_fraction, (int, float))
                or not 0.0 < float(self.heldout_fraction) < 1.0):
            raise FfkvError(f"corpus heldout_fraction must be a number strictly between 0 and 1, "
                            f"got {self.heldout_fraction!r}")
        object.__setattr__(self, "heldout_fraction", float(self.heldout_fraction))
        if self.shuffle_seed is not None and (not _is_int(self.shuffle_seed) or self.shuffle_seed < 0):
            raise FfkvError(f"corpus shuffle_seed must be a non-negative integer or None, got {self.shuffle_seed!r}")
        if self.max_examples is not None:
            _positive_int("max_examples", self.max_examples)
        if not isinstance(self.wikitext_detokenize, bool):
            raise FfkvError(f"corpus wikitext_detokenize must be true or false, got {self.wikitext_detokenize!r}")
        try:
            codec = codecs.lookup(self.encoding) if isinstance(self.encoding, str) else None
        except LookupError:
            codec = None
        if codec is None or not codec._is_text_encoding:
            raise FfkvError(f"corpus encoding {self.encoding!r} (--encoding) is not a known text encoding: "
                            "use e.g. utf-8, latin-1 or cp1252")
        object.__setattr__(self, "encoding", codec.name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values, for the run manifest."""
        return asdict(self)

    def located(self) -> "CorpusSpec":
        """The same spec with a local file or folder named by its absolute path (a dataset on the hub as it is), as
        a run records it: a run indexed from one folder reads its corpus (its held-out examples) from any other."""
        if self.source.startswith(HF_PREFIX) or not os.path.exists(self.source):
            return self
        return replace(self, source=os.path.abspath(self.source))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CorpusSpec":
        """The spec a manifest recorded; missing options take their defaults."""
        if not isinstance(data, dict):
            raise FfkvError(f"corpus spec must be a mapping of options, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FfkvError(f"corpus spec has unknown option(s) {', '.join(unknown)}: "
                            f"allowed are {', '.join(sorted(known))}")
        if "source" not in data:
            raise FfkvError("corpus spec has no 'source': give a file, a directory, or hf:<dataset id>")
        return cls(**data)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise FfkvError(f"corpus {name} {value!r} is not one of {', '.join(allowed)}")


def _positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise FfkvError(f"corpus {name} must be a positive integer, got {value!r}")
