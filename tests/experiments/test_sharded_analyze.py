"""`ffkv analyze` across torchrun ranks: the sharding primitives, and two Gloo processes equal to one."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from support.experiment_runs import write_corpus
from ffkv import cli
from ffkv import parallel as sharding
from ffkv.batching import row_batches
from ffkv.parallel import process_group


# ------------------------------------------------------------------ primitives
def test_one_process_owns_everything_and_gathers_the_identity():
    assert sharding.current_shard() == (0, 1) and sharding.is_writer()
    assert sharding.owned(range(5)) == [0, 1, 2, 3, 4]
    a = np.arange(12.0).reshape(6, 2)
    assert sharding.gather_rows(a, [0, 1]) is a  # no process group: nothing is sent or copied
    named = {"x": a, "y": np.arange(6)}
    gathered = sharding.gather_rows(named, np.arange(6))
    assert gathered.keys() == named.keys() and all(gathered[k] is named[k] for k in named)
    with process_group("cpu") as shard:  # not launched by torchrun: no group opened
        assert shard == (0, 1)


def test_owned_is_a_fixed_round_robin_partition():
    items = list("abcdefg")
    parts = [sharding.owned(items, (r, 3)) for r in range(3)]
    assert parts == [["a", "d", "g"], ["b", "e"], ["c", "f"]]
    assert sharding.owned(items[:1], (1, 2)) == []  # a rank may own nothing
    with pytest.raises(ValueError, match="0 <= rank < world size"):
        sharding.owned(items, (2, 2))


def test_merge_of_a_two_rank_split_gives_the_original_rows():
    rng = np.random.default_rng(0)
    full = {"f": rng.random((9, 3)).astype(np.float32), "i": rng.integers(0, 99, 9), "b": rng.random(9) > 0.5}
    rows = [np.array([0, 1, 2, 7]), np.array([8, 3, 4, 5, 6])]  # any split, in any order
    parts = [(r, {k: v[r] for k, v in full.items()}) for r in rows]
    for order in (parts, parts[::-1]):
        merged = sharding.merge_rows(order)
        assert merged.keys() == full.keys()
        for k in full:
            assert merged[k].dtype == full[k].dtype
            np.testing.assert_array_equal(merged[k], full[k])
    # A rank that owned no rows may send no arrays (it never learned their shapes).
    merged = sharding.merge_rows([(np.arange(9), full), (np.zeros(0, np.int64), {})])
    np.testing.assert_array_equal(merged["f"], full["f"])
    with pytest.raises(RuntimeError, match="not a partition"):
        sharding.merge_rows([parts[0], parts[0]])
    with pytest.raises(RuntimeError, match="not a partition"):
        sharding.merge_rows([parts[1]])


def test_ranks_run_the_batches_one_process_runs(monkeypatch):
    rng = np.random.default_rng(1)
    rows = [(i, rng.integers(4, 90, rng.integers(1, 12))) for i in range(100)]
    alone = row_batches(rows, 0, (), "cpu", batch_size=8)
    shares = []
    for rank in range(2):
        monkeypatch.setattr(sharding, "current_shard", lambda rank=rank: (rank, 2))
        shares.append(row_batches(rows, 0, (), "cpu", batch_size=8))
    assert sorted(np.concatenate([s.rows for s in shares]).tolist()) == list(range(100))
    one = {tuple(idx): batch.input_ids.tolist() for idx, batch in alone}
    both = {tuple(idx): batch.input_ids.tolist() for s in shares for idx, batch in s}
    assert both == one  # the same rows padded together: the same floats


# ------------------------------------------------------------------ end to end
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _indexed_run(tmp_path: Path) -> Path:
    """A run of a tiny ffkv_lm (ffkv-tiny's family, trained two steps) that a fresh process loads by path."""
    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import IndexOptions, build_index
    from ffkv.models import load_model
    from ffkv.models.train import TrainOptions, train

    corpus = write_corpus(tmp_path / "corpus.txt", 240)
    options = TrainOptions(vocab_size=300, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                           seq_len=32, batch_size=4, steps=2, warmup=1, seed=3)
    train(corpus, tmp_path / "model", options, progress=False)
    loaded = load_model(str(tmp_path / "model"))
    spec = CorpusSpec(source=str(corpus), unit="line", heldout_fraction=0.25)
    return build_index(loaded, spec, tmp_path / "run", IndexOptions(top_k=3), progress=False).path


def _analyses(run: Path) -> dict:
    """manifest['analyses'] without what depends on the clock."""
    analyses = json.loads((run / "manifest.json").read_text())["analyses"]
    return {name: {k: v for k, v in info.items() if k not in ("seconds", "time")} for name, info in analyses.items()}


def test_two_gloo_processes_analyze_like_one(tmp_path):
    run = _indexed_run(tmp_path)
    one, two = (shutil.copytree(run, tmp_path / name) for name in ("one", "two"))
    # 40 held-out examples: two batches of the held-out pass, so both ranks run one.
    options = ["--n-eval", "40", "--no-progress"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process below (one process here: no process start to wait for)
    try:
        assert cli.main(["analyze", str(one), *options]) == 0
    finally:
        torch.set_num_threads(threads)
    dist = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                           "-m", "ffkv.cli", "analyze", str(two), *options],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert dist.returncode == 0, dist.stderr[-3000:]
    assert dist.stdout.count("analyses written") == 1  # rank 0 alone reports

    tables = sorted(p.name for p in (one / "metrics").glob("*.parquet"))
    # census 4 (its control), suppressed 2, pruning 2, composition 4 (tau, scale, massive), patterns' control,
    # vocabulary classes 2, confidence neurons 3
    assert len(tables) == 33 and tables == sorted(p.name for p in (two / "metrics").glob("*.parquet"))
    for name in tables:
        pd.testing.assert_frame_equal(pd.read_parquet(two / "metrics" / name), pd.read_parquet(one / "metrics" / name),
                                      check_exact=True, obj=name)
    assert _analyses(two) == _analyses(one)
    assert _analyses(one)["composition"]["n_examples"] == 40
    assert sorted(p.name for p in (two / "figures").iterdir()) == sorted(p.name for p in (one / "figures").iterdir())
    assert not list(two.rglob("*.tmp"))
