"""Opening a file that someone sent never runs code from it: a crafted pickle in a model directory, a run
directory's model, `ffkv train`'s and `ffkv index`'s checkpoints is refused with one line, and its payload
(which would create a marker file) never runs. The audit's reproduction: `models/fairseq_lm.py` retried
`torch.load(weights_only=False)` on any failure, and `ffkv train --resume` loaded with it."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal

import pytest
import torch

import ffkv.models  # noqa: F401 - registers the loaders
from ffkv import cli
from ffkv.errors import FfkvError
from ffkv.models.safe_load import UnsafeCheckpoint, load_checkpoint
from support.runs import corpus_lines


class Payload:
    """Unpickled, it runs `touch MARKER` (what an attacker's model.pt would do with a worse command)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


FORMATS = {"zip": dict(), "legacy": dict(_use_new_zipfile_serialization=False)}


def save_payload(path, marker, kind: str = "zip", extra: dict | None = None) -> None:
    """A torch checkpoint (zip or the old format) whose settings hold the payload, or a bare pickle."""
    path.parent.mkdir(parents=True, exist_ok=True)
    obj = {"args": Payload(marker), "model": {"w": torch.zeros(2)}, **(extra or {})}
    if kind == "pickle":
        path.write_bytes(pickle.dumps(obj))
    else:
        torch.save(obj, path, **FORMATS[kind])


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ffkv: error: "), err
    return lines[0]


@pytest.mark.parametrize("kind", ["zip", "legacy", "pickle"])
def test_a_payload_in_a_checkpoint_never_runs(tmp_path, kind):
    marker = tmp_path / "ran"
    save_payload(tmp_path / "model.pt", marker, kind)
    with pytest.raises(FfkvError) as refused:
        load_checkpoint(tmp_path / "model.pt", what="fairseq checkpoint")
    assert not marker.exists()
    if kind != "pickle":  # a bare pickle is not a torch checkpoint at all
        assert isinstance(refused.value, UnsafeCheckpoint) and "system" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_plain_settings_load(tmp_path):
    import argparse

    torch.save({"args": argparse.Namespace(decoder_layers=2, lr=[0.1]), "model": {"w": torch.ones(3)},
                "extra": {"n": 1, "s": {1, 2}, "t": (1.5, None)}}, tmp_path / "model.pt")
    got = load_checkpoint(tmp_path / "model.pt")
    assert got["args"].decoder_layers == 2 and got["extra"] == {"n": 1, "s": {1, 2}, "t": (1.5, None)}


@pytest.mark.parametrize("kind", ["zip", "legacy"])
def test_index_with_a_fairseq_model_directory(tmp_path, capsys, kind):
    model = tmp_path / "model"
    marker = tmp_path / "ran"
    save_payload(model / "model.pt", marker, kind)
    (model / "dict.txt").write_text("a 1\nb 1\n")
    (tmp_path / "corpus.txt").write_text("a b\n")
    code = cli.main(["index", "--model", str(model), "--corpus", str(tmp_path / "corpus.txt"),
                     "--out", str(tmp_path / "run"), "--no-progress"])
    line = error_line(capsys)
    assert code == 2 and "names 'posix.system'" in line and "has no option that runs" in line
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_index_with_a_hugging_face_model_directory(tmp_path, capsys):
    """transformers reads pytorch_model.bin weights-only: the payload is refused there too."""
    import transformers

    model = tmp_path / "hf"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                                         n_positions=16)).save_pretrained(model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    marker = tmp_path / "ran"
    torch.save({"transformer.wte.weight": Payload(marker)}, model / "pytorch_model.bin")
    (tmp_path / "corpus.txt").write_text("a b\n")
    capsys.readouterr()
    code = cli.main(["index", "--model", str(model), "--corpus", str(tmp_path / "corpus.txt"),
                     "--out", str(tmp_path / "run"), "--no-progress"])
    line = error_line(capsys)
    assert code == 2 and f"the model weights in {model} names 'posix.system'" in line and "weights_only" not in line
    assert not marker.exists()


def test_a_run_directory_naming_a_crafted_model(index_only, tmp_path, capsys):
    """A shared run whose manifest names a crafted model: intervene, analyze and the explorer's model load
    refuse it; nothing runs."""
    from ffkv.explorer.model import load_run_model

    run = shutil.copytree(index_only, tmp_path / "run")
    model, marker = tmp_path / "model", tmp_path / "ran"
    save_payload(model / "model.pt", marker)
    (model / "dict.txt").write_text("a 1\n")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["model"]["id"] = manifest["identity"]["model_id"] = str(model)
    (run / "manifest.json").write_text(json.dumps(manifest))
    for argv in (["intervene", str(run), "--off", "1:0", "--n-eval", "2", "--no-progress"],
                 ["analyze", str(run), "--only", "values", "--no-progress"]):
        assert cli.main(argv) == 2
        assert "names 'posix.system'" in error_line(capsys)
    with pytest.raises(UnsafeCheckpoint):
        load_run_model(run)  # what `ffkv serve RUN` loads in the background
    assert not marker.exists()


def test_a_training_checkpoint_with_a_payload(tmp_path, capsys):
    out, marker = tmp_path / "out", tmp_path / "ran"
    (tmp_path / "corpus.txt").write_text("\n".join(corpus_lines(40)) + "\n")
    save_payload(out / "checkpoint" / "state.pt", marker, extra={"options": Payload(marker)})
    code = cli.main(["train", "--corpus", str(tmp_path / "corpus.txt"), "--out", str(out), "--resume",
                     "--steps", "2", "--no-progress"])
    assert code == 2 and "training checkpoint" in error_line(capsys)
    assert not marker.exists()


def test_an_index_checkpoint_with_a_payload(tmp_path, capsys):
    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
    from support.helpers import loaded_tiny

    corpus, out, marker = tmp_path / "corpus.txt", tmp_path / "run", tmp_path / "ran"
    corpus.write_text("\n".join(corpus_lines(100)) + "\n")  # two windows of 64: Ctrl-C after the first

    def ctrl_c(n):
        if n == 1:
            os.kill(os.getpid(), signal.SIGINT)

    loaded = loaded_tiny("gpt2")
    spec = CorpusSpec(str(corpus), unit="line")
    with pytest.raises(KeyboardInterrupt):
        build_index(loaded, spec, out, IndexOptions(top_k=3), BatchOptions(batch_size=4), progress=False,
                    after_window=ctrl_c)
    checkpoint = out / ".partial" / "checkpoint.pt"
    assert checkpoint.exists()
    save_payload(checkpoint, marker)
    with pytest.raises(UnsafeCheckpoint, match="index checkpoint .*names 'posix.system'.*choose a new --out"):
        build_index(loaded, spec, out, IndexOptions(top_k=3), BatchOptions(batch_size=4), resume=True,
                    progress=False)
    assert not marker.exists()
