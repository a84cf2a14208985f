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


def custom_code_model(folder, marker, model_type: str = "evilnet"):
    """A model folder whose config.json names Python modules of its own (``auto_map``): importing them, as
    transformers does once told to trust the folder, creates `marker`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": model_type, "vocab_size": 16,
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil",
                     "AutoTokenizer": ["tokenization_evil.Evil", None]}}))
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (folder / f"{module}.py").write_text(code)
    return folder


def test_a_model_folder_with_custom_code_is_refused_without_a_prompt(tmp_path):
    """The audit: transformers asked "Do you wish to run the custom code? [y/N]" on standard input, and a "y" ran
    the folder's Python. Here standard input says y: nothing asks, nothing runs, one line, exit 2."""
    import subprocess
    import sys

    model, marker = custom_code_model(tmp_path / "model", tmp_path / "ran"), tmp_path / "ran"
    (tmp_path / "corpus.txt").write_text("a b\n")
    done = subprocess.run([sys.executable, "-m", "ffkv.cli", "index", "--model", str(model), "--corpus",
                           str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "run"), "--no-progress"],
                          input="y\ny\ny\n", capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "needs custom code" in lines[0] and "never runs code from a model" in lines[0]
    assert "[y/N]" not in done.stdout + done.stderr and not marker.exists()


def test_a_run_directory_naming_a_custom_code_model(index_only, tmp_path, capsys, monkeypatch):
    """A shared run whose manifest names such a folder: intervene and the explorer's model load refuse it."""
    import io

    from ffkv.explorer.model import load_run_model

    run = shutil.copytree(index_only, tmp_path / "run")
    marker = tmp_path / "ran"
    model = custom_code_model(tmp_path / "model", marker)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["model"]["id"] = manifest["identity"]["model_id"] = str(model)
    (run / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    assert cli.main(["intervene", str(run), "--off", "1:0", "--n-eval", "2", "--no-progress"]) == 2
    assert "needs custom code" in error_line(capsys)
    with pytest.raises(FfkvError, match="needs custom code"):
        load_run_model(run)
    assert not marker.exists()


def test_a_native_family_with_custom_code_named_loads_the_native_code(tmp_path):
    """A GPT-2 folder whose config also names modules of its own loads with transformers' own GPT-2 code."""
    import tokenizers
    import transformers

    from ffkv.models import load_model

    folder, marker = tmp_path / "gpt2", tmp_path / "ran"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                                         n_positions=16)).save_pretrained(folder)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(16)}, unk_token="w0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    native = custom_code_model(tmp_path / "evil", marker)
    config["auto_map"] = json.loads((native / "config.json").read_text())["auto_map"]
    (folder / "config.json").write_text(json.dumps(config))
    for module in native.glob("*.py"):
        shutil.copy(module, folder)
    loaded = load_model(str(folder))
    assert type(loaded.model).__module__.startswith("transformers.") and loaded.view.n_layers == 1
    assert not marker.exists()
