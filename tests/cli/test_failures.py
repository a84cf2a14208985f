"""The filesystem and the other processes: one line, a non-zero exit (1 for the file system, as `ffkv --help`
documents it), and never a run marked complete.

Rows of issue 14's bad-input list: a second writer (a concurrent --resume), a writer killed
with kill -9, a full disk (a 2 MB tmpfs where a mount namespace can be had, and ENOSPC
injected at a write everywhere), a read-only file system (a read-only tmpfs), no permission
(another user, or a read-only folder), a temporary file left by a kill; and `ffkv status`
for every state. Subprocesses run ``python -m support.tiny_cli`` (the ffkv command with a
tiny random GPT-2 as ``--model tiny-gpt2``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ffkv import cli
from ffkv.models import loading
from ffkv.store import atomic
from ffkv.store.run import RunDir
from support import tiny_cli
from support.cli_runs import disk_full_at

TESTS = Path(__file__).resolve().parents[1]
LINES = [f"the cat sat on the mat {i}. a part of the city {i * 7}." for i in range(80)]


@pytest.fixture
def tiny_gpt2(monkeypatch):
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


def index_args(corpus, out, *extra):
    return ["index", "--model", "tiny-gpt2", "--corpus", str(corpus), "--out", str(out), "--no-progress",
            "--unit", "line", "--top-k", "3", "--batch-size", "4", *extra]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ffkv: error: "), err
    return lines[0]


def status(out) -> str | None:
    manifest = Path(out) / "manifest.json"
    return json.loads(manifest.read_text())["status"] if manifest.exists() else None


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def same_tables(a, b) -> bool:
    return all((Path(a) / t).read_bytes() == (Path(b) / t).read_bytes()
               for t in ("examples.parquet", "trigger_examples.parquet"))


# ---------------------------------------------------------------- a second writer, a killed writer

def test_second_writer_is_refused_then_a_killed_run_resumes(tmp_path, capsys, tiny_gpt2, corpus):
    """The audit's wrong result: `--resume` started while the first process ran; both exited 0 and the
    run read complete with 196 of 452 examples. Now the second gets one line naming the first; a
    kill -9 leaves a run `ffkv status` calls interrupted, and --resume finishes it exactly."""
    out, pause = tmp_path / "run", tmp_path / "pause"
    pause.mkdir()
    first = subprocess.Popen([sys.executable, "-m", "support.tiny_cli", *index_args(corpus, out, "--checkpoint-seconds", "0")],
                             env={**env(), "FFKV_TEST_PAUSE": str(pause)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (pause / "paused").exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.05)
        host = socket.gethostname()
        for extra in (["--resume"], []):
            code, _, err = run(capsys, *index_args(corpus, out, "--checkpoint-seconds", "0", *extra))
            assert code == 2
            assert f"is being written by `ffkv index` (pid {first.pid} on {host}, since" in error_line(err)
        code, said, _ = run(capsys, "status", str(out))
        assert code == 0 and said.splitlines()[0] == f"{out}: running"
        assert f"pid {first.pid} on {host}" in said and ": alive;" in said
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        first.kill()
        first.wait(30)
    assert status(out) == "running"  # as the killed process left it
    code, said, _ = run(capsys, "status", str(out))
    assert said.splitlines()[0] == f"{out}: interrupted" and "stopped without saving (killed or crashed)" in said
    code, _, err = run(capsys, *index_args(corpus, out))
    assert code == 2 and "stopped without saving (killed or crashed)" in err and "add --resume" in error_line(err)
    code, _, err = run(capsys, *index_args(corpus, out, "--resume"))
    assert code == 0, err
    assert run(capsys, *index_args(corpus, tmp_path / "whole"))[0] == 0
    assert same_tables(out, tmp_path / "whole") and status(out) == "complete"
    assert run(capsys, "status", str(out))[1].splitlines()[0] == f"{out}: complete"


def test_two_writers_of_other_commands_exclude_each_other(tmp_path, capsys, tiny_gpt2, corpus):
    assert run(capsys, *index_args(corpus, tmp_path / "run"))[0] == 0
    labels = tmp_path / "labels.csv"
    labels.write_text("layer,key,label\n0,1,shallow\n")
    with RunDir(tmp_path / "run").lock("analyze"):
        for argv in (["annotate", "import", str(tmp_path / "run"), str(labels)],
                     ["merge", str(tmp_path / "run"), "--out", str(tmp_path / "run")]):
            code, _, err = run(capsys, *argv)
            assert code == 2 and f"is being written by `ffkv analyze` (pid {os.getpid()}" in error_line(err)
        assert "being written now by `ffkv analyze`" in run(capsys, "status", str(tmp_path / "run"))[1]
    assert run(capsys, "annotate", "import", str(tmp_path / "run"), str(labels))[0] == 0


# ---------------------------------------------------------------- a full disk, a read-only file system

def test_disk_full_at_a_write_marks_the_run_failed_then_resumes(tmp_path, capsys, tiny_gpt2, corpus, monkeypatch):
    """ENOSPC injected where a file is synced (the write's last step), at the fourth file of the run."""
    real, calls = atomic.fsync, disk_full_at(monkeypatch, 4)
    out = tmp_path / "run"
    code, _, err = run(capsys, *index_args(corpus, out, "--checkpoint-seconds", "0"))
    line = error_line(err)
    assert code == 1 and f"No space left on device ({calls[3]})" in line and "marked failed" in line
    assert "--resume" in line and status(out) == "failed"
    said = run(capsys, "status", str(out))[1]
    assert said.splitlines()[0] == f"{out}: failed" and "error: No space left on device" in said
    assert not list(out.rglob("*.tmp"))
    monkeypatch.setattr(atomic, "fsync", real)  # space freed
    assert run(capsys, *index_args(corpus, out, "--resume", "--checkpoint-seconds", "0"))[0] == 0
    assert run(capsys, *index_args(corpus, tmp_path / "whole"))[0] == 0
    assert same_tables(out, tmp_path / "whole")


def namespace_can_mount() -> bool:
    """Whether this machine lets us mount a tmpfs in a private mount namespace (unshare -rm)."""
    if not shutil.which("unshare"):
        return False
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {folder}"],
                              capture_output=True)
    return done.returncode == 0


@pytest.fixture(scope="module")
def on_tmpfs(tmp_path_factory):
    """Commands on small and read-only file systems: in one mount namespace and one process, three
    tmpfs mounts (2 MB, 64 KB, read-only) and the ffkv commands that write there. name -> result."""
    if not namespace_can_mount():
        pytest.skip("cannot mount a tmpfs in a mount namespace here")
    root = tmp_path_factory.mktemp("tmpfs")
    rng = random.Random(0)
    big = root / "big.txt"  # 3.3 MB of text that does not compress: its examples cannot fit
    big.write_text("".join(f"{rng.getrandbits(160):040x}\n" for _ in range(80_000)))
    small = root / "small.txt"
    small.write_text("\n".join(LINES) + "\n")
    wide = root / "wide.txt"  # long lines: the examples table keeps all of each text, the model 64 tokens
    wide.write_text("".join(f"{rng.getrandbits(4000):01000x}\n" for _ in range(200)))
    mounts = {"two_mb": "size=2m", "tiny": "size=32k", "read_only": "ro,size=1m"}
    jobs = {
        "too_big": index_args(big, root / "two_mb" / "run"),
        # --max-examples hides the corpus size from the estimate: the disk fills during the run (without the
        # random-key control, whose tables the estimate counts in full, more than this disk holds).
        "fills": index_args(wide, root / "tiny" / "run", "--max-examples", "200", "--checkpoint-seconds", "0",
                            "--control-keys", "0"),
        "read_only": index_args(small, root / "read_only" / "run"),
    }
    (root / "jobs.json").write_text(json.dumps(jobs))
    script = " && ".join(f"mkdir -p '{root / name}' && mount -t tmpfs -o {options} tmpfs '{root / name}'"
                         for name, options in mounts.items())
    script += f" && '{sys.executable}' -m support.tiny_cli --many '{root / 'jobs.json'}' '{root / 'results.json'}'"
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, json.loads((root / "results.json").read_text())


def test_a_run_too_big_for_the_disk_stops_before_writing(on_tmpfs):
    root, results = on_tmpfs
    got = results["too_big"]
    line = error_line(got["err"])
    assert got["code"] == 1 and re.search(r"the run needs at least 3\.\d MB on disk but", line) and "free space" in line
    assert got["status"] is None  # refused before anything was written


def test_disk_full_on_a_small_tmpfs(on_tmpfs):
    root, results = on_tmpfs
    got = results["fills"]
    line = error_line(got["err"])
    assert got["code"] == 1 and f"No space left on device ({root / 'tiny' / 'run'}" in line and "--resume" in line
    assert got["status"] in ("failed", "running"), got  # failed, or not even that could be written: never complete


def test_read_only_file_system(on_tmpfs):
    root, results = on_tmpfs
    got = results["read_only"]
    assert got["code"] == 1 and got["status"] is None
    assert error_line(got["err"]) == (f"ffkv: error: cannot write the run into {root / 'read_only'} "
                                      "(read-only file system): choose another --out")


# ---------------------------------------------------------------- no permission

def test_no_permission(tmp_path, corpus):
    """As another user where the tests run as root (root may write anywhere), else a read-only folder."""
    folder = Path(tempfile.mkdtemp(prefix="ffkv-perm-"))
    try:
        (folder / "corpus.txt").write_bytes(corpus.read_bytes())
        locked = folder / "locked"
        locked.mkdir()
        for path in (folder, folder / "corpus.txt"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        locked.chmod(0o555)
        prefix = []
        if os.geteuid() == 0:
            if not shutil.which("setpriv"):
                pytest.skip("root without setpriv cannot run a process as another user")
            prefix = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        argv = [*prefix, sys.executable, "-m", "support.tiny_cli",
                *index_args(folder / "corpus.txt", locked / "run")]
        done = subprocess.run(argv, env={**env(), "HOME": str(folder)}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stderr
        assert error_line(done.stderr) == (f"ffkv: error: cannot write the run into {locked} (permission denied): "
                                           "choose another --out")
        assert not (locked / "run").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- what a kill leaves

def test_temporary_files_left_by_a_kill_are_cleaned(tmp_path, capsys, tiny_gpt2, corpus):
    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
    from support.helpers import loaded_tiny

    out = tmp_path / "run"

    def ctrl_c(n):
        if n == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        build_index(loaded_tiny("gpt2"), CorpusSpec(str(corpus), unit="line"), out, IndexOptions(top_k=3),
                    BatchOptions(batch_size=4), progress=False, after_window=ctrl_c)
    said = run(capsys, "status", str(out))[1]
    assert said.splitlines()[0] == f"{out}: interrupted" and "stopped by Ctrl-C at a checkpoint" in said
    # What a kill -9 between mkstemp and the rename leaves: a 0-byte file beside a table.
    stray = [out / ".trigger_examples.parquet.x1.tmp", out / ".partial" / ".checkpoint.pt.x2.tmp"]
    for path in stray:
        path.write_bytes(b"")
    assert run(capsys, *index_args(corpus, out, "--resume", "--batch-size", "4"))[0] == 0
    assert not any(p.exists() for p in stray) and not list(out.rglob("*.tmp"))
    (out / "metrics").mkdir()
    (out / "metrics" / ".values.parquet.x3.tmp").write_bytes(b"")  # left by a killed analyze
    with RunDir(out).lock("analyze"):
        assert not list(out.rglob("*.tmp"))
