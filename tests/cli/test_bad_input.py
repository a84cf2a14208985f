"""Bad input gets one clear line, a non-zero exit and no traceback, and never a complete run."""

from __future__ import annotations

import json
import re

import pytest

from ffkv import cli
from ffkv.models import loading
from support.helpers import loaded_tiny


@pytest.fixture
def tiny_gpt2(monkeypatch):
    """Make `--model tiny-gpt2` load a tiny random model (no files, no network)."""
    def loader(name, dtype, device):
        if name == "tiny-gpt2":
            got = loaded_tiny("gpt2")
            return got.model, got.tokenizer
        return None
    monkeypatch.setattr(loading, "LOADERS", [loader, *loading.LOADERS])


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith("ffkv: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The cat sat on the mat. The dog ran.\nA second line here.\n")
    return path


def index_args(corpus, out, *extra):
    return ["index", "--model", "tiny-gpt2", "--corpus", str(corpus), "--out", str(out), "--no-progress", *extra]


def assert_not_complete(out):
    manifest = out / "manifest.json"
    assert not manifest.exists() or json.loads(manifest.read_text())["status"] != "complete"


def test_good_run_prints_summary(tmp_path, capsys, tiny_gpt2, corpus):
    code, out, err = run(capsys, *index_args(corpus, tmp_path / "run", "--top-k", "2"))
    assert code == 0, err
    assert "indexed" in out


@pytest.mark.parametrize("case, match", [
    ("missing corpus", "does not exist|not found|no such"),
    ("empty corpus", "empty|no text|blank"),
    ("blank corpus", "empty|no text|blank"),
    ("binary corpus", "binary"),
])
def test_bad_corpus(tmp_path, capsys, tiny_gpt2, case, match):
    path = tmp_path / "c.txt"
    if case == "empty corpus":
        path.write_text("")
    elif case == "blank corpus":
        path.write_text("\n  \n\t\n\n")
    elif case == "binary corpus":
        path.write_bytes(bytes(range(256)) * 10)
    code, _, err = run(capsys, *index_args(path, tmp_path / "run"))
    assert code == 2
    assert re.search(match, one_error_line(err), flags=re.IGNORECASE)
    assert_not_complete(tmp_path / "run")


def test_missing_model_path(tmp_path, capsys, corpus):
    code, _, err = run(capsys, "index", "--model", str(tmp_path / "nope"), "--corpus", str(corpus),
                       "--out", str(tmp_path / "run"), "--no-progress")
    assert code == 2
    assert "cannot load model" in one_error_line(err)
    assert_not_complete(tmp_path / "run")


def test_unsupported_architecture(tmp_path, capsys, corpus):
    import transformers as tf
    tf.T5ForConditionalGeneration(tf.T5Config(d_model=8, d_ff=16, num_layers=1, num_heads=1, d_kv=4,
                                              vocab_size=32)).save_pretrained(tmp_path / "t5")
    code, _, err = run(capsys, "index", "--model", str(tmp_path / "t5"), "--corpus", str(corpus),
                       "--out", str(tmp_path / "run"), "--no-progress")
    assert code == 2
    line = one_error_line(err)
    assert "unsupported architecture 't5'" in line and "GPT-2" in line


def test_top_k_larger_than_corpus_keeps_all(tmp_path, capsys, tiny_gpt2, corpus):
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "run", "--unit", "line", "--top-k", "10"))
    assert code == 0
    assert "ffkv: warning: --top-k 10 is larger than the 2 examples" in err
    import pandas as pd
    te = pd.read_parquet(tmp_path / "run" / "trigger_examples.parquet")
    assert te.groupby(["layer", "key"]).size().eq(2).all()


@pytest.mark.parametrize("extra", [["--top-k", "0"], ["--top-k", "many"], ["--mode", "both"],
                                   ["--batch-size", "-3"], ["--dtype", "float8"], ["--unit", "word"]])
def test_nonsense_options(tmp_path, capsys, tiny_gpt2, corpus, extra):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(index_args(corpus, tmp_path / "run", *extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    assert_not_complete(tmp_path / "run")


def test_output_dir_with_other_run_or_files(tmp_path, capsys, tiny_gpt2, corpus):
    assert run(capsys, *index_args(corpus, tmp_path / "run", "--top-k", "2"))[0] == 0
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "run", "--top-k", "3"))
    assert code == 2 and "holds a different run" in one_error_line(err)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "other"))
    assert code == 2 and "not empty" in one_error_line(err)
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "new", "--resume"))
    assert code == 2 and "nothing to resume" in one_error_line(err)


def test_bad_device(tmp_path, capsys, tiny_gpt2, corpus):
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "run", "--device", "tpu7"))
    assert code == 2 and "device" in one_error_line(err)
