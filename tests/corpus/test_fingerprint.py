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


def test_shared_data_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("FFKV_SHARED_DATA", str(tmp_path))
    assert shared_data_dir() == tmp_path
    monkeypatch.setenv("FFKV_SHARED_DATA", str(tmp_path / "missing"))
    assert shared_data_dir() is None
    monkeypatch.delenv("FFKV_SHARED_DATA")
    found = shared_data_dir()
    repo = Path(__file__).resolve().parents[2]
    assert found == ((repo.parent / "shared" / "data") if (repo.parent / "shared" / "data").is_dir() else None)
