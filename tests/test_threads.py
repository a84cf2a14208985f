"""The `ffkv` command's thread count: chosen for the machine it finds, overridable, recorded, and kept on resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ffkv import threads
from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.store.run import RunDir
from support.helpers import loaded_tiny


def chosen(busy: float, available: int = 2, environ: dict | None = None, requested: int | None = None) -> int:
    return threads.choose(requested, environ=environ or {}, available=lambda: available, busy=lambda: busy).threads


@pytest.mark.parametrize("available, busy, expected", [
    (2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 9.5, 1),   # a 2-core laptop: idle, one job, load 9.5
    (8, 0.0, 8), (8, 3.0, 5), (8, 7.6, 1), (1, 0.0, 1), (1, 3.0, 1),
])
def test_the_machine_decides_the_count_less_the_cores_other_work_keeps_busy(available, busy, expected):
    assert chosen(busy, available) == expected


def test_the_flag_then_the_variable_then_the_users_openmp_count_decide_before_the_machine():
    assert chosen(9.0, 2, {"FFKV_THREADS": "2", "OMP_NUM_THREADS": "3"}, requested=4) == 4
    assert chosen(9.0, 2, {"FFKV_THREADS": "2", "OMP_NUM_THREADS": "3"}) == 2
    assert chosen(9.0, 2, {"OMP_NUM_THREADS": "3"}) == 3
    assert threads.choose(environ={}, available=lambda: 2, busy=lambda: 1.0).why.startswith("2 cores, 1.0 of them")


@pytest.mark.parametrize("text", ["0", "-1", "two", "1_0", "\u0663", "1.5", "", "99999"])
def test_a_count_that_is_not_a_whole_number_from_1_is_refused_in_one_line(text):
    with pytest.raises(FfkvError, match="whole number of threads"):
        threads.parse_count(text, "FFKV_THREADS")
    with pytest.raises(FfkvError, match="FFKV_THREADS"):
        threads.choose(environ={"FFKV_THREADS": text or " x"})


def test_apply_sizes_torch_and_the_pools_not_started_and_undo_restores_them():
    environ = {"MKL_NUM_THREADS": "7"}
    before = torch.get_num_threads()
    undo = threads.apply(threads.ThreadChoice(1, "--threads"), environ)
    try:
        assert torch.get_num_threads() == 1
        assert all(environ[name] == "1" for name in threads.POOL_VARIABLES)
    finally:
        undo()
    assert torch.get_num_threads() == before and environ == {"MKL_NUM_THREADS": "7"}
    # The user's own OpenMP count stands for the pools they set; the others follow it.
    environ = {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "2"}
    undo = threads.apply(threads.ThreadChoice(3, "OMP_NUM_THREADS"), environ)
    undo()
    assert environ == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "2"}


def test_busy_cores_sees_a_process_spinning_on_this_machine():
    if threads._procs_running() is None:
        pytest.skip("no /proc/stat here: the load average stands in")
    idle = threads.busy_cores(0.2)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        busy = threads.busy_cores(0.3)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy >= 0.7 and busy > idle - 0.5, (idle, busy)


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "c.txt").write_text("\n".join(f"line {i} " + "ab" * (i % 7) for i in range(60)) + "\n")
    return CorpusSpec(source=str(tmp_path / "c.txt"), unit="line")


class Stop(Exception):
    pass


def test_an_index_records_its_count_and_resumes_with_it(tmp_path, corpus):
    loaded = loaded_tiny("gpt2")
    options = IndexOptions(top_k=5, control_keys=8)
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=0, part_rows=5)
    before = torch.get_num_threads()
    seen: list[int] = []

    def stop(n_windows):
        seen.append(torch.get_num_threads())
        if n_windows == 2:
            raise Stop

    with threads.running_with(1), pytest.raises(Stop):
        build_index(loaded, corpus, tmp_path / "run", options, batching, progress=False, after_window=stop)
    assert RunDir(tmp_path / "run").manifest().index["threads"] == 1
    with threads.running_with(2):
        build_index(loaded, corpus, tmp_path / "run", options, batching, progress=False, resume=True,
                    after_window=lambda n: seen.append(torch.get_num_threads()))
        assert torch.get_num_threads() == 2  # given back after the resumed part
    assert set(seen) == {1} and torch.get_num_threads() == before
    assert RunDir(tmp_path / "run").manifest().index["threads"] == 1


def test_the_command_records_the_count_it_chose_and_the_flag_overrides_it(tmp_path, corpus):
    """A real `ffkv` process: FFKV_THREADS and --threads reach torch, and the run records what ran."""
    ffkv = Path(sys.executable).with_name("ffkv")
    env = {**os.environ, "FFKV_THREADS": "1"}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run([str(ffkv), "index", "--model", "ffkv-tiny", "--corpus", corpus.source, "--unit", "line",
                             "--max-examples", "20", "--top-k", "3", "--out", str(tmp_path / "a"), "--no-progress"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["index"]["threads"] == 1
    result = subprocess.run([str(ffkv), "index", "--model", "ffkv-tiny", "--corpus", corpus.source, "--unit", "line",
                             "--max-examples", "20", "--top-k", "3", "--out", str(tmp_path / "b"), "--no-progress",
                             "--threads", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["index"]["threads"] == 2
    for name in ("trigger_examples", "control_trigger_examples"):  # the count moves no byte of the index here
        assert (tmp_path / "a" / f"{name}.parquet").read_bytes() == (tmp_path / "b" / f"{name}.parquet").read_bytes()
    bad = subprocess.run([str(ffkv), "index", "--model", "ffkv-tiny", "--corpus", corpus.source,
                          "--out", str(tmp_path / "c"), "--threads", "0"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "whole number of threads" in bad.stderr and "Traceback" not in bad.stderr
