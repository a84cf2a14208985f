import json
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support.corpus import WIKITEXT
from ffkv.corpus import CorpusSpec, iter_examples
from ffkv.errors import FfkvError


def texts(spec, tok):
    return [e.text for e in iter_examples(spec, tok)]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- plain text ---------------------------------------------------------------------------

def test_plain_text_units(tmp_path, tok):
    path = write(tmp_path / "story.txt", "One day it rained. The end\nwas near.\n\n\n  Second block here.  \n")
    assert texts(CorpusSpec(path, unit="line"), tok) == ["One day it rained. The end", "was near.",
                                                          "Second block here."]
    # sentences may cross a wrapped line but never a blank line
    assert texts(CorpusSpec(path), tok) == ["One day it rained.", "The end was near.", "Second block here."]
    assert texts(CorpusSpec(path, unit="document"), tok) == ["One day it rained. The end\nwas near.",
                                                              "Second block here."]


def test_end_of_text_markers_split_documents_and_are_never_text(tmp_path, tok):
    """TinyStories joins its stories with <|endoftext|> lines (and GPT-2-style text may hold the marker inline):
    each marker ends a document, like a blank line, and no example holds it."""
    path = write(tmp_path / "stories.txt", "Ben saw a vase. He was glad.\n<|endoftext|>\nOllie swam.\n"
                 "Then he ate.<|endoftext|>Tim ran home.\n<|endoftext|>\n\n")
    assert texts(CorpusSpec(path, unit="document"), tok) == ["Ben saw a vase. He was glad.", "Ollie swam.\nThen he ate.",
                                                             "Tim ran home."]
    assert texts(CorpusSpec(path, unit="line"), tok) == ["Ben saw a vase. He was glad.", "Ollie swam.", "Then he ate.",
                                                         "Tim ran home."]
    assert texts(CorpusSpec(path), tok) == ["Ben saw a vase.", "He was glad.", "Ollie swam.", "Then he ate.",
                                            "Tim ran home."]
    records = write(tmp_path / "stories.jsonl", json.dumps({"text": "One.<|endoftext|>Two."}) + "\n")
    assert texts(CorpusSpec(records, unit="document"), tok) == ["One.", "Two."]


def test_text_reader_drops_a_byte_order_mark(tmp_path, tok):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffHello there.".encode("utf-8"))
    assert texts(CorpusSpec(path), tok) == ["Hello there."]


# --- WikiText -------------------------------------------------------------------------------

def test_wikitext_detokenized(tmp_path, tok):
    path = write(tmp_path / "wiki.valid.tokens", WIKITEXT)
    lines = texts(CorpusSpec(path, unit="line"), tok)
    assert lines == ["Alpha is a 3.5 m long thing, made in 1,000 units. It is well-known (mostly).",
                     'Mr. Smith said "it is fine." Then he left.',
                     "The history is short.",
                     "Beta has one line only."]
    assert texts(CorpusSpec(path), tok) == [
        "Alpha is a 3.5 m long thing, made in 1,000 units.", "It is well-known (mostly).",
        'Mr. Smith said "it is fine."', "Then he left.", "The history is short.", "Beta has one line only."]
    docs = texts(CorpusSpec(path, unit="document"), tok)
    assert len(docs) == 2 and docs[0].endswith("The history is short.") and docs[1] == "Beta has one line only."


def test_wikitext_verbatim_for_word_level_models(tmp_path, tok):
    path = write(tmp_path / "wiki.test.raw", WIKITEXT)
    lines = texts(CorpusSpec(path, unit="line", wikitext_detokenize=False), tok)
    assert lines[0] == "Alpha is a 3 @.@ 5 m long thing , made in 1 @,@ 000 units . It is well @-@ known ( mostly ) ."
    sentences = texts(CorpusSpec(path, wikitext_detokenize=False), tok)
    assert sentences[:4] == ["Alpha is a 3 @.@ 5 m long thing , made in 1 @,@ 000 units .",
                             "It is well @-@ known ( mostly ) .", 'Mr. Smith said " it is fine . "', "Then he left ."]


def test_format_auto_detects_from_the_name(tmp_path, tok):
    as_text = write(tmp_path / "notes.txt", WIKITEXT)
    assert "= Alpha Article =" in texts(CorpusSpec(as_text, unit="line"), tok)
    assert "= Alpha Article =" not in texts(CorpusSpec(as_text, unit="line", format="wikitext"), tok)


# --- JSONL ----------------------------------------------------------------------------------

def test_jsonl_records(tmp_path, tok):
    rows = [{"body": "First record. Two sentences."}, {"body": ""}, {"body": None},
            {"body": "Para one.\n\nPara two\ncontinues."}]
    path = write(tmp_path / "data.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert texts(CorpusSpec(path, unit="document", text_field="body"), tok) == [
        "First record. Two sentences.", "Para one.\n\nPara two\ncontinues."]
    assert texts(CorpusSpec(path, text_field="body"), tok) == [
        "First record.", "Two sentences.", "Para one.", "Para two continues."]
    assert texts(CorpusSpec(path, unit="line", text_field="body"), tok)[-2:] == ["Para two", "continues."]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"body": "x"}\n', "line 2 has no field 'text' (fields: body): set text_field"),
    ('{"text": "ok"}\nnot json\n', "line 2 is not valid JSON"),
    ('["a list"]\n', "line 1 is a JSON list, not an object"),
    ('{"text": 5}\n', "line 1 field 'text' holds int, not text"),
])
def test_jsonl_bad_records(tmp_path, tok, content, message):
    path = write(tmp_path / "bad.jsonl", content)
    with pytest.raises(FfkvError) as caught:
        texts(CorpusSpec(path, unit="document"), tok)
    assert message in str(caught.value)


# --- Parquet --------------------------------------------------------------------------------

def test_parquet_reads_every_row_group(tmp_path, tok):
    values = [f"Row number {i}." for i in range(7)] + [None, "  "]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"text": values, "n": list(range(9))}), path, row_group_size=2)
    assert pq.ParquetFile(path).num_row_groups == 5
    assert texts(CorpusSpec(path, unit="document"), tok) == values[:7]


def test_parquet_bad_columns(tmp_path, tok):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), path)
    with pytest.raises(FfkvError, match=r"has no column 'text' \(columns: body, n\): set text_field"):
        texts(CorpusSpec(path), tok)
    with pytest.raises(FfkvError, match="column 'n' holds int64, not text"):
        texts(CorpusSpec(path, text_field="n"), tok)
    bad = write(tmp_path / "fake.parquet", "not parquet at all")
    with pytest.raises(FfkvError, match="cannot be read as Parquet"):
        texts(CorpusSpec(bad), tok)


# --- directories ----------------------------------------------------------------------------

def test_directory_is_read_in_sorted_path_order(tmp_path, tok):
    (tmp_path / "b").mkdir()
    write(tmp_path / "b" / "x.txt", "Third.")
    write(tmp_path / "a2.txt", "Second.")
    write(tmp_path / "a1.jsonl", json.dumps({"text": "First."}))
    write(tmp_path / ".hidden.txt", "Never.")
    examples = list(iter_examples(CorpusSpec(tmp_path), tok))
    assert [e.text for e in examples] == ["First.", "Second.", "Third."]
    assert [e.example_id for e in examples] == [0, 1, 2]


# --- Hugging Face ---------------------------------------------------------------------------

def test_hf_without_datasets_installed(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(FfkvError, match="needs the 'datasets' package: pip install datasets"):
        texts(CorpusSpec("hf:someone/corpus"), tok)


def fake_datasets(records_by_name):
    module = types.ModuleType("datasets")
    calls = []

    def load_dataset(name, config=None, split="train", streaming=False):
        calls.append((name, config, split, streaming))
        if name not in records_by_name:
            raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub\nmore detail")
        return iter(records_by_name[name])

    module.load_dataset = load_dataset
    module.calls = calls
    return module


def test_hf_records_streamed(monkeypatch, tok):
    module = fake_datasets({"someone/corpus": [{"text": "One. Two."}, {"text": ""}, {"text": "Three."}]})
    monkeypatch.setitem(sys.modules, "datasets", module)
    assert texts(CorpusSpec("hf:someone/corpus:cfg", hf_split="validation"), tok) == ["One.", "Two.", "Three."]
    assert module.calls == [("someone/corpus", "cfg", "validation", True)]


def test_hf_wikitext_records_are_wikitext_lines(monkeypatch, tok):
    lines = [{"text": line + "\n"} for line in WIKITEXT.splitlines()]
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({"Salesforce/wikitext": lines}))
    docs = texts(CorpusSpec("hf:Salesforce/wikitext:wikitext-103-raw-v1", unit="document"), tok)
    assert len(docs) == 2 and docs[1] == "Beta has one line only."


def test_hf_errors(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({"a/b": [{"body": "x"}]}))
    with pytest.raises(FfkvError, match=r"'nope/missing' .*cannot be loaded \(Dataset 'nope/missing' doesn't exist"):
        texts(CorpusSpec("hf:nope/missing"), tok)
    with pytest.raises(FfkvError, match="record 0 has no field 'text'"):
        texts(CorpusSpec("hf:a/b"), tok)


# --- bad inputs -----------------------------------------------------------------------------

def test_binary_files_are_refused_and_other_encodings_named(tmp_path, tok):
    nul = tmp_path / "model.bin"
    nul.write_bytes(b"weights\x00\x01\x02")
    with pytest.raises(FfkvError, match="looks like a binary file, not text"):
        texts(CorpusSpec(nul), tok)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 cr\u00e8me.".encode("latin-1"))
    with pytest.raises(FfkvError, match=r"is not valid utf-8 text \(byte 3\): the file is in another text "
                                        r"encoding; give it with --encoding \(e.g. --encoding latin-1\)"):
        texts(CorpusSpec(latin), tok)
    assert texts(CorpusSpec(latin, encoding="latin-1"), tok) == ["caf\u00e9 cr\u00e8me."]
    late = tmp_path / "late.txt"
    late.write_bytes(b"Fine text.\n" * 7000 + b"\xff\xfe broken\n")
    with pytest.raises(FfkvError, match="line 7001 is not valid utf-8: the file is in another text encoding; "
                                        "give it with --encoding"):
        texts(CorpusSpec(late, unit="line"), tok)
    with pytest.raises(FfkvError, match=r"corpus encoding 'klingon' \(--encoding\) is not a known text encoding"):
        CorpusSpec(late, encoding="klingon")


def test_a_multibyte_character_cut_at_the_sniff_limit_is_fine(tmp_path, tok):
    path = tmp_path / "edge.txt"
    path.write_bytes(b"a" * (64 * 1024 - 1) + "\u00e9 done.".encode())
    assert len(texts(CorpusSpec(path, unit="line", max_tokens=4), tok)) == 1


@pytest.mark.parametrize("content", ["", "\n\n   \n\t\n", " = Only = \n\n = = Headings = = \n"])
def test_empty_corpus(tmp_path, tok, content):
    path = write(tmp_path / "wiki.train.tokens", content)
    with pytest.raises(FfkvError, match="holds no text .*: check the source"):
        texts(CorpusSpec(path), tok)


def test_missing_and_unreadable_sources(tmp_path, tok):
    with pytest.raises(FfkvError, match="does not exist: check the path"):
        texts(CorpusSpec(tmp_path / "nope.txt"), tok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FfkvError, match="holds no files"):
        texts(CorpusSpec(tmp_path / "empty"), tok)
    locked = write(tmp_path / "locked.txt", "secret.")
    locked.chmod(0)
    try:
        if locked.open("rb"):  # running as root: permissions do not apply
            pytest.skip("file permissions are not enforced for this user")
    except PermissionError:
        with pytest.raises(FfkvError, match="cannot be read"):
            texts(CorpusSpec(locked), tok)
    finally:
        locked.chmod(0o644)
