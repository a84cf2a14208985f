"""Bad input gets one clear line, a non-zero exit and no traceback, and never a complete run."""

from __future__ import annotations

import json
import re

import pytest

from ffkv import cli
from ffkv.models import loading
from support import tiny_cli


@pytest.fixture
def tiny_gpt2(monkeypatch):
    """Make `--model tiny-gpt2` load a tiny random model (no files, no network)."""
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])


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
    assert f"model '{tmp_path / 'nope'}': no such file or folder" in one_error_line(err)  # not blamed on the hub
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
    assert te.groupby(["layer", "key", "direction"]).size().eq(2).all()


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
    assert "top_k 2 (given: 3)" in one_error_line(err)  # the option that differs, named
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "other"))
    assert code == 2 and "not empty" in one_error_line(err)
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "new", "--resume"))
    assert code == 2 and "nothing to resume" in one_error_line(err)


def test_bad_device(tmp_path, capsys, tiny_gpt2, corpus):
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "run", "--device", "tpu7"))
    assert code == 2 and "device" in one_error_line(err)


def test_max_tokens_beyond_the_model_stops_at_once(tmp_path, capsys, tiny_gpt2, corpus):
    """The audit: --max-tokens above the model's positions failed at 96% of the corpus, and so did
    every --resume, with a message that did not name the option."""
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "run", "--max-tokens", "100"))
    assert code == 2
    assert one_error_line(err) == ("ffkv: error: --max-tokens 100 is more than the 64 positions of model tiny-gpt2: "
                                   "give --max-tokens 64 or less")
    assert not (tmp_path / "run").exists()
    long = tmp_path / "long.txt"
    long.write_text("x" * 300 + "\n")  # one example longer than the model takes
    code, _, err = run(capsys, *index_args(long, tmp_path / "run", "--unit", "line", "--top-k", "1"))
    assert code == 0, err  # the default is cut to the model's positions, and recorded
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["identity"]["corpus"]["max_tokens"] == 64


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "soon"])
def test_checkpoint_seconds_must_be_finite(tmp_path, capsys, tiny_gpt2, corpus, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(index_args(corpus, tmp_path / "run", "--checkpoint-seconds", value))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--checkpoint-seconds: expected a" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_text_in_another_encoding_is_named_with_the_option(tmp_path, capsys, tiny_gpt2):
    """The audit: Latin-1 text was called "a binary file"."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Le caf\u00e9 est cr\u00e8me.\nUne deuxi\u00e8me ligne.\n".encode("latin-1"))
    code, _, err = run(capsys, *index_args(latin, tmp_path / "run", "--unit", "line"))
    line = one_error_line(err)
    assert code == 2 and "is not valid utf-8 text" in line and "--encoding latin-1" in line
    assert_not_complete(tmp_path / "run")
    code, _, err = run(capsys, *index_args(latin, tmp_path / "run", "--unit", "line", "--top-k", "2",
                                           "--encoding", "latin-1"))
    assert code == 0, err
    import pandas as pd
    assert "Le caf\u00e9 est cr\u00e8me." in set(pd.read_parquet(tmp_path / "run" / "examples.parquet").text)
    code, _, err = run(capsys, *index_args(latin, tmp_path / "other", "--encoding", "klingon"))
    assert code == 2 and "--encoding" in one_error_line(err)


def test_ctrl_c_while_the_model_loads_claims_nothing(tmp_path, capsys, corpus, monkeypatch):
    """The audit: Ctrl-C during model loading said "the last checkpoint is saved"."""
    def loading_interrupted(name, dtype, device):
        raise KeyboardInterrupt
    monkeypatch.setattr(loading, "LOADERS", [loading_interrupted, *loading.LOADERS])
    code, _, err = run(capsys, *index_args(corpus, tmp_path / "run"))
    assert code == 130 and err.strip() == "ffkv: interrupted"
    assert not (tmp_path / "run").exists()


def test_a_run_folder_that_does_not_exist_is_named_missing(tmp_path, capsys):
    for argv in (["analyze", str(tmp_path / "none")], ["status", str(tmp_path / "none")],
                 ["report", str(tmp_path / "none")]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"{tmp_path / 'none'}: no such folder" in one_error_line(err), (argv, err)
