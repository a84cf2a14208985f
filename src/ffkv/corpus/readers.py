"""Readers: each turns one source into a stream of documents, holding one at a time.

A `Document` carries the three views the example units need: its text (unit
``document``), its lines (unit ``line``) and its paragraphs, the spans a sentence
may not cross (unit ``sentence``). Memory stays flat in corpus size: files are read
line by line, Parquet in record batches, Hugging Face datasets streaming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ffkv.corpus.sources import check_text_file, hf_name_config, is_hf, source_files, wrong_encoding_advice
from ffkv.corpus.spec import CorpusSpec
from ffkv.corpus.wikitext import detokenize, heading_level
from ffkv.errors import FfkvError

# A plain-text block longer than this is cut at a line boundary, so a file without
# blank lines never has to sit in memory whole.
MAX_BLOCK_CHARS = 1 << 20
#: End-of-text markers that join documents in one text (TinyStories' and GPT-2's ``<|endoftext|>``): a
#: document ends at one, like at a blank line, and the marker itself is never text of an example.
END_OF_TEXT = ("<|endoftext|>",)
PARQUET_BATCH_ROWS = 1024


@dataclass
class Document:
    """One document: WikiText article, plain-text block, or record.

    Attributes:
        text: the whole document, lines joined by newlines.
        lines: its non-blank lines, stripped (WikiText headings left out).
        paragraphs: the spans sentences are split within (lines joined by spaces).
    """

    text: str
    lines: list[str]
    paragraphs: list[str]


def iter_documents(spec: CorpusSpec) -> Iterator[Document]:
    """Every document of the source, in source order."""
    if is_hf(spec):
        yield from read_hf(spec)
        return
    for source in source_files(spec):
        if source.format == "text":
            yield from read_text(source.path, spec.encoding)
        elif source.format == "wikitext":
            yield from read_wikitext(source.path, spec.wikitext_detokenize, spec.encoding)
        elif source.format == "jsonl":
            yield from read_jsonl(source.path, spec.text_field, spec.encoding)
        elif source.format == "parquet":
            yield from read_parquet(source.path, spec.text_field)
        else:  # "hf" is handled above; spec validation admits nothing else
            raise FfkvError(f"corpus format {source.format!r} cannot read file {source.path}: "
                            "use text, wikitext, jsonl or parquet")


def end_of_text_parts(text: str) -> list[str]:
    """`text` cut at every `END_OF_TEXT` marker (the markers dropped)."""
    parts = [text]
    for marker in END_OF_TEXT:
        parts = [piece for part in parts for piece in part.split(marker)]
    return parts


def record_documents(text: str) -> Iterator[Document]:
    """A record's text (JSONL, Parquet, HF) as documents: one, or one per text between `END_OF_TEXT` markers."""
    for part in end_of_text_parts(text):
        document = record_document(part)
        if document is not None:
            yield document


def record_document(text: str) -> Document | None:
    """A record's text (JSONL, Parquet, HF) as a document; blank-line blocks are paragraphs."""
    text = text.strip()
    if not text:
        return None
    lines: list[str] = []
    paragraphs: list[str] = []
    block: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line:
            lines.append(line)
            block.append(line)
        elif block:
            paragraphs.append(" ".join(block))
            block = []
    if block:
        paragraphs.append(" ".join(block))
    return Document(text, lines, paragraphs)


def read_text(path: Path, encoding: str = "utf-8") -> Iterator[Document]:
    """Plain text: a document is a block of lines between blank lines (or `END_OF_TEXT` markers)."""
    block: list[str] = []
    size = 0
    for raw in _text_lines(path, encoding):
        parts = end_of_text_parts(raw)
        for i, part in enumerate(parts):
            line = part.strip()
            if line:
                block.append(line)
                size += len(line)
            ends = not line or i < len(parts) - 1  # a blank line, or a marker after this part
            if block and (ends or size > MAX_BLOCK_CHARS):
                yield Document("\n".join(block), block, [" ".join(block)])
                block, size = [], 0
    if block:
        yield Document("\n".join(block), block, [" ".join(block)])


def read_wikitext(path: Path, detokenize_text: bool, encoding: str = "utf-8") -> Iterator[Document]:
    """A WikiText file: one document per article; each paragraph line is a paragraph."""
    yield from wikitext_documents(_text_lines(path, encoding), detokenize_text)


def wikitext_documents(raw_lines: Iterable[str], detokenize_text: bool) -> Iterator[Document]:
    """WikiText lines to articles: a `` = Title = `` heading starts one; headings are not text."""
    lines: list[str] = []
    for raw in raw_lines:
        level = heading_level(raw)
        if level == 1 and lines:
            yield Document("\n".join(lines), lines, list(lines))
            lines = []
        if level or not raw.strip():
            continue
        lines.append(detokenize(raw) if detokenize_text else raw.strip())
    if lines:
        yield Document("\n".join(lines), lines, list(lines))


def read_jsonl(path: Path, text_field: str, encoding: str = "utf-8") -> Iterator[Document]:
    """JSON Lines: one record (an object with a text field) per line; blank lines skipped."""
    for number, raw in enumerate(_text_lines(path, encoding), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise FfkvError(f"corpus file {path} line {number} is not valid JSON ({error.msg}): "
                            "write one JSON object per line") from error
        yield from record_documents(_field_text(record, text_field, f"corpus file {path} line {number}"))


def read_parquet(path: Path, text_field: str) -> Iterator[Document]:
    """Parquet: one record per row of the text column, read in record batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        raise FfkvError(f"corpus file {path} cannot be read as Parquet ({error}): "
                        "check the file, or set format to match it") from error
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise FfkvError(f"corpus file {path} has no column {text_field!r} (columns: {', '.join(schema.names)}): "
                        "set text_field to the text column")
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise FfkvError(f"corpus file {path} column {text_field!r} holds {column_type}, not text: "
                        "set text_field to a string column")
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield from record_documents(text)


def read_hf(spec: CorpusSpec) -> Iterator[Document]:
    """A Hugging Face dataset, streamed; WikiText datasets are read as WikiText lines."""
    try:
        import datasets  # noqa: PLC0415 - optional dependency, only for hf sources
    except ImportError as error:
        raise FfkvError("reading a hf: corpus needs the 'datasets' package: pip install datasets") from error
    name, config = hf_name_config(spec)
    try:
        dataset = datasets.load_dataset(name, config, split=spec.hf_split, streaming=True)
    except Exception as error:  # the hub and loaders raise many kinds; all mean "cannot load"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FfkvError(f"Hugging Face dataset {name!r} (config {config}, split {spec.hf_split!r}) "
                        f"cannot be loaded ({reason}): check the id, config and split") from error
    where = f"Hugging Face dataset {name!r}"
    texts = (_field_text(record, spec.text_field, f"{where} record {i}") for i, record in enumerate(dataset))
    if name.rsplit("/", 1)[-1].lower().startswith("wikitext"):
        # Hub WikiText holds one source line per record, headings included.
        yield from wikitext_documents(texts, spec.wikitext_detokenize)
        return
    for text in texts:
        yield from record_documents(text)


def _field_text(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise FfkvError(f"{where} is a JSON {type(record).__name__}, not an object: "
                        f"write objects with a {text_field!r} field")
    if text_field not in record:
        fields = ", ".join(sorted(map(str, record))) or "none"
        raise FfkvError(f"{where} has no field {text_field!r} (fields: {fields}): set text_field to the text field")
    value = record[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FfkvError(f"{where} field {text_field!r} holds {type(value).__name__}, not text: "
                        "set text_field to a string field")
    return value


def _text_lines(path: Path, encoding: str = "utf-8") -> Iterator[str]:
    """The lines of a text file in `encoding` (a leading BOM dropped), refusing binary files."""
    check_text_file(path, encoding)
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode(encoding)
                except UnicodeDecodeError as error:
                    raise FfkvError(f"corpus file {path} line {number} is not valid {encoding}: "
                                    f"{wrong_encoding_advice(encoding)}") from error
                yield line.lstrip("\ufeff") if number == 1 else line
    except OSError as error:
        raise FfkvError(f"corpus file {path} cannot be read ({error.strerror}): check that it is readable") from error
