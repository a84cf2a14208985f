import os
from pathlib import Path

from ffkv.corpus import CorpusSpec, fingerprint, shared_data_dir


def test_fingerprint_follows_the_source_and_the_options(tmp_path: Path):
    path = tmp_path / "a.txt"
    path.write_text("Hello there. " * 200_000)  # over 2 MiB: the tail is read apart from the head
    spec = CorpusSpec(path)
    first = fingerprint(spec)
    assert first == fingerprint(CorpusSpec(path)) and len(first) == 64
    assert fingerprint(CorpusSpec(path, unit="line")) != first
    stat = path.stat()
    path.write_text("Hello there. " * 199_999 + "Hello where. ")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only the tail differs
    assert fingerprint(spec) != first
    assert fingerprint(CorpusSpec(tmp_path)) != fingerprint(CorpusSpec(tmp_path, unit="line"))
    assert fingerprint(CorpusSpec("hf:a/b")) != fingerprint(CorpusSpec("hf:a/b", hf_split="test"))


def test_fingerprint_is_the_content_not_the_path(tmp_path: Path, monkeypatch):
    text = "Hello there. " * 200_000
    (tmp_path / "a.txt").write_text(text)
    first = fingerprint(CorpusSpec(tmp_path / "a.txt"))
    monkeypatch.chdir(tmp_path)
    assert fingerprint(CorpusSpec("a.txt")) == first  # relative and absolute: one corpus
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "b.txt").write_text(text)
    assert fingerprint(CorpusSpec(tmp_path / "copy" / "b.txt")) == first  # a copy elsewhere, another name
    middle = len(text) // 2
    (tmp_path / "copy" / "b.txt").write_text(text[:middle] + "X" + text[middle + 1:])
    assert fingerprint(CorpusSpec(tmp_path / "copy" / "b.txt")) != first  # one byte in the middle
    assert fingerprint(CorpusSpec(tmp_path / "a.txt", encoding="latin-1")) != first
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    for folder, names in (("d1", ("x.txt", "y.txt")), ("d2", ("y.txt", "x.txt"))):
        for name, body in zip(names, ("one.", "two.")):
            (tmp_path / folder / name).write_text(body)
    assert fingerprint(CorpusSpec(tmp_path / "d1")) != fingerprint(CorpusSpec(tmp_path / "d2"))  # reading order


def test_shared_data_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("FFKV_SHARED_DATA", str(tmp_path))
    assert shared_data_dir() == tmp_path
    monkeypatch.setenv("FFKV_SHARED_DATA", str(tmp_path / "missing"))
    assert shared_data_dir() is None
    monkeypatch.delenv("FFKV_SHARED_DATA")
    found = shared_data_dir()
    repo = Path(__file__).resolve().parents[2]
    assert found == ((repo.parent / "shared" / "data") if (repo.parent / "shared" / "data").is_dir() else None)
