"""Shards merge into exactly the run one process writes: in-process, via `ffkv merge`, and via torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.indexing.merge import merge_runs
from support.helpers import loaded_tiny

TABLES = ("examples.parquet", "trigger_examples.parquet", "control_trigger_examples.parquet", "control_keys.parquet")


def corpus(tmp_path: Path) -> Path:
    lines = [f"{'ab cd ef'[: 1 + i % 8]} line {i % 13} {'xyz' * (i % 5)}" for i in range(90)]
    path = tmp_path / "c.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def same_bytes(a: Path, b: Path) -> bool:
    return all((a / t).read_bytes() == (b / t).read_bytes() for t in TABLES)


@pytest.mark.parametrize("mode", ["example", "prefix"])
@pytest.mark.parametrize("family,sign", [("gpt2", "both"), ("llama", "both"), ("opt", "positive")])
def test_three_shards_merge_to_single_run_bytes(tmp_path, mode, family, sign):
    """Both trigger directions of GELU and gated models, and the one of ReLU models (each by default)."""
    loaded = loaded_tiny(family)
    spec = CorpusSpec(source=str(corpus(tmp_path)), unit="line")
    options, batching = IndexOptions(top_k=6, mode=mode), BatchOptions(batch_size=4, window_batches=3)
    single = build_index(loaded, spec, tmp_path / "single", options, batching, progress=False)
    shards = [build_index(loaded, spec, tmp_path / f"s{i}", options, batching, progress=False, shard=(i, 3))
              for i in range(3)]
    merged = merge_runs([s.path for s in reversed(shards)], tmp_path / "merged")
    assert same_bytes(single.path, merged.path)
    assert merged.manifest().identity == single.manifest().identity
    assert merged.manifest().sign == sign
    directions = set(pq.read_table(merged.table("trigger_examples")).column("direction").to_pylist())
    assert directions == ({1, -1} if sign == "both" else {1})
    with pytest.raises(FfkvError, match="exactly one run of each shard"):
        merge_runs([shards[0].path, shards[1].path], tmp_path / "partial")


def _tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny GPT-2 with a word-level tokenizer, saved like any Hugging Face model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from support.tiny_models import tiny_model

    words = sorted({w for line in corpus(tmp_path).read_text().split("\n") for w in line.split()})
    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    assert len(vocab) <= 97
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    path = tmp_path / "tiny-gpt2"
    tiny_model("gpt2").save_pretrained(path)
    fast.save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_equal_single_process(tmp_path):
    model = _tiny_model_dir(tmp_path)
    common = ["--model", str(model), "--corpus", str(corpus(tmp_path)), "--unit", "line", "--top-k", "5",
              "--batch-size", "4", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "ffkv.cli", "index", *common, "--out", str(tmp_path / "single")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    dist = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                           "-m", "ffkv.cli", "index", *common, "--out", str(tmp_path / "dist")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert dist.returncode == 0, dist.stderr[-3000:]
    assert same_bytes(tmp_path / "single", tmp_path / "dist")
    assert not (tmp_path / ".dist.shards").exists()
    assert set(pq.read_table(tmp_path / "dist" / "trigger_examples.parquet").column("direction").to_pylist()) == {1, -1}
