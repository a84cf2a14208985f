"""Where a corpus lives: the files of a source, their formats, and a text-file check.

A source is one file, a directory (every non-hidden file below it, in sorted path
order so example ids are the same on every machine), or a Hugging Face dataset.
"""

from __future__ import annotations

import codecs
import fnmatch
from dataclasses import dataclass
from pathlib import Path

from ffkv.corpus.spec import HF_PREFIX, CorpusSpec
from ffkv.errors import FfkvError

SNIFF_BYTES = 64 * 1024
_WIKITEXT_NAMES = ("wiki.*.tokens", "wiki.*.raw")


@dataclass(frozen=True)
class SourceFile:
    """One file of a corpus and the format it is read in."""

    path: Path
    format: str


def is_hf(spec: CorpusSpec) -> bool:
    """Whether the spec reads a Hugging Face dataset rather than local files."""
    return spec.format == "hf" or spec.source.startswith(HF_PREFIX)


def hf_name_config(spec: CorpusSpec) -> tuple[str, str | None]:
    """``hf:<dataset id>[:<config>]`` (or a bare id with format hf) as (id, config)."""
    body = spec.source[len(HF_PREFIX):] if spec.source.startswith(HF_PREFIX) else spec.source
    name, _, config = body.partition(":")
    return name.strip(), (config.strip() or None)


def detect_format(path: Path) -> str:
    """The format ``auto`` reads a file in, from its name."""
    name = path.name.lower()
    if any(fnmatch.fnmatch(name, pattern) for pattern in _WIKITEXT_NAMES):
        return "wikitext"
    if name.endswith(".jsonl") or name.endswith(".ndjson"):
        return "jsonl"
    if name.endswith(".parquet") or name.endswith(".pq"):
        return "parquet"
    return "text"


def source_files(spec: CorpusSpec) -> list[SourceFile]:
    """The files of a local source with their formats, in reading order."""
    path = Path(spec.source).expanduser()
    if not path.exists():
        raise FfkvError(f"corpus source {spec.source} does not exist: check the path "
                        "(or write hf:<dataset id> for a Hugging Face dataset)")
    if path.is_dir():
        try:
            files = sorted((p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                           key=lambda p: p.relative_to(path).as_posix())
        except OSError as error:
            raise FfkvError(f"corpus directory {spec.source} cannot be listed ({error.strerror}): "
                            "check its permissions") from error
        if not files:
            raise FfkvError(f"corpus directory {spec.source} holds no files: point source at the corpus files")
    elif path.is_file():
        files = [path]
    else:
        raise FfkvError(f"corpus source {spec.source} is neither a file nor a directory: give a corpus file or folder")
    return [SourceFile(p, detect_format(p) if spec.format == "auto" else spec.format) for p in files]


def wrong_encoding_advice(encoding: str) -> str:
    """What to do about text that is not in `encoding`."""
    other = "latin-1" if encoding == "utf-8" else "utf-8"
    return (f"the file is in another text encoding; give it with --encoding (e.g. --encoding {other}), "
            f"or re-encode the file as {encoding}")


def check_text_file(path: Path, encoding: str = "utf-8") -> None:
    """Refuse a file whose first 64 KiB hold a NUL byte (binary) or do not decode in `encoding`."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
    except OSError as error:
        raise FfkvError(f"corpus file {path} cannot be read ({error.strerror}): check that it exists "
                        "and is readable") from error
    if b"\x00" in head and not codecs.lookup(encoding).name.startswith("utf-16"):
        raise FfkvError(f"corpus file {path} looks like a binary file, not text: give a text, "
                        "WikiText, JSONL or Parquet file (or set format)")
    try:
        codecs.getincrementaldecoder(encoding)().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as error:
        raise FfkvError(f"corpus file {path} is not valid {encoding} text (byte {error.start}): "
                        f"{wrong_encoding_advice(encoding)}") from None
