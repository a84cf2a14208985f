"""One writer per run: the lock names its holder, dies with its process, is not kept by forked children;
atomic writes sync and report a full disk as the OSError it is."""

from __future__ import annotations

import builtins
import errno
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import filelock
import pytest
import torch

from ffkv.store import atomic
from ffkv.store.lock import Holder, RunLocked, exclusive, probe, read_holder
from ffkv.store.manifest import Process
from ffkv.store.run import RunDir
from ffkv.store.state import run_state
from test_manifest import _manifest


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_writer_gets_one_line_naming_the_first(tmp_path):
    run = RunDir(tmp_path)
    with run.lock("analyze") as me:
        assert me.pid == os.getpid() and me.host == socket.gethostname() and me.command == "analyze"
        assert read_holder(run.lock_path) == me and probe(run.lock_path) is True
        with pytest.raises(RunLocked) as refused:
            with run.lock("index"):
                pass
        assert str(refused.value) == (f"run {tmp_path} is being written by `ffkv analyze` (pid {os.getpid()} on "
                                      f"{me.host}, since {me.started}); wait for it to finish or stop it first")
    assert run.lock_path.read_text() == "" and probe(run.lock_path) is False
    with run.lock("index"):  # free again
        pass


def test_a_lock_left_by_a_dead_process_is_free(tmp_path):
    run = RunDir(tmp_path)
    gone = Holder(pid=dead_pid(), host=socket.gethostname(), command="index", started="then")
    run.lock_path.write_text(json.dumps(gone.__dict__))  # what a kill -9 leaves: a record, no flock
    assert gone.alive() is False and probe(run.lock_path) is False
    with run.lock("index") as me:
        assert read_holder(run.lock_path) == me


def test_a_lock_held_by_a_child_of_a_dead_writer_is_named(tmp_path):
    path = tmp_path / ".lock"
    held = filelock.FileLock(path)
    held.acquire()  # say an orphaned child keeps the flock of a writer that died
    try:
        path.write_text(json.dumps(Holder(dead_pid(), socket.gethostname(), "index", "then").__dict__))
        with pytest.raises(RunLocked, match=r"locked by a process other than its recorded writer `ffkv index` "
                                            r"\(pid \d+ .*which has ended: a child process of it may still run"):
            with exclusive(path, "index", "run x", wait=0.1):
                pass
    finally:
        held.release()


def test_forked_children_do_not_keep_the_lock(tmp_path):
    """Tokenizer workers are forked while the index holds the lock; a kill -9 of the index must
    free the run even while they live on."""
    run = RunDir(tmp_path)
    with run.lock("index"):
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
        child.start()
    try:
        assert child.is_alive() and probe(run.lock_path) is False
    finally:
        child.terminate()
        child.join()


def test_a_running_run_reads_interrupted_once_its_writer_is_gone(tmp_path):
    run = RunDir(tmp_path)
    process = Process(pid=dead_pid(), host=socket.gethostname(), command="index", started="s",
                      heartbeat=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    run.write_manifest(_manifest(status="running", process=process))
    state = run_state(tmp_path)
    assert state.status == "interrupted" and state.alive is False
    assert "stopped without saving (killed or crashed); last heartbeat" in state.lines()[1]
    with run.lock("index"):
        state = run_state(tmp_path)
        assert state.status == "running" and state.alive is True and "written by `ffkv index`" in state.lines()[1]


def test_atomic_writes_sync_the_file_then_its_folder(tmp_path, monkeypatch):
    synced = []
    real = atomic.fsync
    monkeypatch.setattr(atomic, "fsync", lambda path: (synced.append(str(path)), real(path)))
    atomic.write_json(tmp_path / "a.json", {"x": 1})
    assert len(synced) == 2 and synced[0].startswith(str(tmp_path / ".a.json.")) and synced[1] == str(tmp_path)
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


def test_a_full_disk_is_an_oserror_even_through_torch_save(tmp_path, monkeypatch):
    """torch.save reports a failed write as a RuntimeError without its cause; checkpoints need ENOSPC."""
    monkeypatch.setattr(atomic, "open", lambda path, mode: builtins.open("/dev/full", mode), raising=False)
    with pytest.raises(OSError) as full:
        atomic.write_with(tmp_path / "checkpoint.pt", lambda f: torch.save({"x": torch.zeros(100_000)}, f))
    assert full.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too
