"""`ffkv prune`: bad input gets one clear line and exit status 2, and nothing is written."""

from __future__ import annotations

import pytest

from ffkv import cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if "error:" in l]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def tiny_gpt2(monkeypatch):
    """The analysed run's model id, tiny-gpt2, loads a tiny random model (no files, no network)."""
    from ffkv.models import loading
    from support import tiny_cli

    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])


def test_prune_bad_input(analyzed, tmp_path, tmp_path_factory, capsys, tiny_gpt2):
    import shutil

    source, _ = analyzed
    run_dir = tmp_path_factory.mktemp("without-census") / "run"  # a copy without the census table, for the census criterion's refusal
    shutil.copytree(source, run_dir)
    (run_dir / "metrics" / "census.parquet").unlink()
    (tmp_path / "exists").mkdir()
    for argv, expected in (
        (["--criterion", "sparsity", "--share", "0.1", "--out", str(tmp_path / "a")], "unknown pruning criterion"),
        (["--criterion", "random", "--share", "0.1", "--out", str(tmp_path / "exists")], "exists"),
        (["--criterion", "census", "--share", "0.1", "--out", str(tmp_path / "c")], "--only census"),
    ):
        code, _, err = run(capsys, "prune", str(run_dir), *argv)
        assert code == 2 and expected in error_line(err)
    for share in ("1", "-0.2", "half", "nan"):  # refused by the parser, before anything is read
        with pytest.raises(SystemExit) as stop:
            run(capsys, "prune", str(run_dir), "--criterion", "random", "--share", share, "--out", str(tmp_path / "b"))
        assert stop.value.code == 2
        assert "expected a share in [0, 1)" in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_prune_refuses_a_model_without_a_hugging_face_tokenizer(analyzed, tmp_path, capsys, tiny_gpt2):
    """The test run's model has a character tokenizer: the model could not be loaded back, so nothing is written."""
    run_dir, _ = analyzed
    code, _, err = run(capsys, "prune", str(run_dir), "--criterion", "random", "--share", "0.2",
                       "--out", str(tmp_path / "m"))
    assert code == 2 and "tokenizer" in error_line(err)
    assert not list(tmp_path.iterdir())
