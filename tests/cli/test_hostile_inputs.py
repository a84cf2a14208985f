"""The rest of the audit (Why 4-5), each as a new user meets it: one line and the documented exit status.

Annotation imports (a non-numeric layer, a binary file, a layer or key the run does not have), the annotate
form and the commands on a read-only run, `ffkv prune` on a full disk and what a killed prune left, the
advice after a killed merge, an example longer than the model's positions, short tokens beyond loopback,
and Host headers with user-info.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from ffkv import cli
from ffkv.models import loading
from ffkv.store import atomic
from ffkv.store.annotations import read_labels
from support import tiny_cli
from support.cli_runs import disk_full_at, error_line, run

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_gpt2(monkeypatch):
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])


@pytest.fixture
def own_run(index_only, tmp_path):
    return Path(shutil.copytree(index_only, tmp_path / "run"))


# ------------------------------------------------------------------------------------------ annotate import

@pytest.mark.parametrize("content, expected", [
    (b"memory,label\nx:1,shallow\n", "line 2: memory 'x:1': LAYER and KEY of a memory must be integers"),
    (b"memory,label\n1:1,shallow\n99:1,shallow\n", "line 3: memory '99:1': layer 99 does not exist: this model has "
                                                    "layers 1..3"),
    (b"memory,label\n1:99999,none\n", "line 2: memory '1:99999': key 99999 does not exist"),
    (b"memory,label\n1:1.5,none\n", "line 2: memory '1:1.5': LAYER and KEY of a memory must be integers"),
    (b"memory,label\n0:1,none\n", "line 2: memory '0:1': layer 0 does not exist"),
    # An older export's layer and key columns, counted from 0, are read by their own convention.
    (b"layer,key,label\nx,1,shallow\n", "line 2: layer 'x' is not an integer"),
    (b"layer,key,label\n0,1,shallow\n99,1,shallow\n", "line 3: layer '99' is not a layer of this run (0 to 2, 0-based"),
    (b"layer,key,label\n0,99999,none\n", "line 2: key '99999' is not a key of this run (0 to "),
    (b"layer,key,label\n0,1.5,none\n", "line 2: key '1.5' is not an integer"),
    (b"layer,key,label\n-1,1,none\n", "line 2: layer '-1' is not a layer of this run"),
    # Python's int() reads "1_0" as 10 and a fullwidth "１" as 1: each was stored as another memory's label.
    (b"memory,label\n1:1_0,shallow\n", "line 2: memory '1:1_0': LAYER and KEY of a memory must be integers"),
    ("memory,label\n\uff11:1,shallow\n".encode(), "line 2: memory '\uff11:1': LAYER and KEY of a memory must be"),
    (b"layer,key,label\n0,1_0,shallow\n", "line 2: key '1_0' is not an integer"),
    ("layer,key,label\n\uff10,1,shallow\n".encode(), "line 2: layer '\uff10' is not an integer"),
    (b"layer,key,label\n0,+1,shallow\n", "line 2: key '+1' is not an integer"),
    # A long number is quoted short (it was quoted back whole).
    (b"memory,label\n1:" + b"1" * 100_000 + b",shallow\n", "line 2: memory '1:" + "1" * 38 + "'\u2026: LAYER and"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\x00binary", "is not UTF-8 text"),
    (b"", "is not a CSV table"),
    (b"memory\n1:1\n", "lacks a label column"),
    (b"label\nshallow\n", "lacks a memory column"),
])
def test_annotate_import_refuses_what_the_run_cannot_hold(own_run, tmp_path, capsys, content, expected):
    """The audit: a non-numeric layer (ValueError) or a binary file (UnicodeDecodeError) gave tracebacks, and
    labels for layer 99, key 99999 of a smaller run were stored without complaint."""
    labels = tmp_path / "labels.csv"
    labels.write_bytes(content)
    code, _, err = run(capsys, "annotate", "import", own_run, labels)
    assert code == 2 and expected in error_line(err)
    assert len(error_line(err)) < 500
    assert read_labels(own_run).empty


@pytest.mark.parametrize("content", ["memory,label,description\n 2:3 ,Shallow,ends\n1:0,,\n",
                                     "layer,key,label,description\n1, 3 ,Shallow,ends\n0,0,,\n"])
def test_annotate_import_stores_good_labels(own_run, tmp_path, capsys, content):
    """Memory 2:3 (layers from 1), or layer 1 and key 3 of an older export (from 0): the same key."""
    labels = tmp_path / "labels.csv"
    labels.write_text(content)
    assert run(capsys, "annotate", "import", own_run, labels)[0] == 0
    saved = read_labels(own_run)
    assert saved[["layer", "key", "label"]].values.tolist() == [[1, 3, "shallow"]]


# ------------------------------------------------------------------------------------------ numbers as typed

@pytest.mark.parametrize("option, text, expected", [
    ("--memories", "1:1_0", "--memories takes L:K pairs"), ("--memories", "\uff11:1", "--memories takes L:K pairs"),
    ("--memories", "t\uff14:1", "--memories takes L:K pairs"), ("--memories", "1:" + "1" * 100_000, "--memories takes"),
    ("--layers", "1,\uff12", "--layers takes layers from 1"), ("--layers", "1_0", "--layers takes layers from 1"),
])
def test_a_layer_or_key_on_the_command_line_is_ascii_digits(tmp_path, capsys, option, text, expected):
    """`--memories 1:1_0` named memory 1:10 and `--layers 1,２` layer 2 (Python's int() reads both): refused, in one
    line quoting what was given cut short, before the run or the backend is opened."""
    code, _, err = run(capsys, "explain", tmp_path / "no-run", "--explainer", "openai:http://127.0.0.1:9/v1#m",
                       "--retries", "0", option, text, "--no-progress")
    line = error_line(err)
    assert code == 2 and expected in line and "digits 0-9" in line and len(line) < 500, line


def test_the_layer_of_locate_is_ascii_digits(tmp_path, capsys):
    """`ffkv locate --layer ４` traced layer 4: a fullwidth digit is refused as the option's error."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["locate", "--model", "tiny-gpt2", "--prompt", "a b", "--subject", "a", "--layer", "\uff14",
                  "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --layer: expected a layer from 1" in err and "digits 0-9" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ read-only runs

def test_the_annotate_form_on_a_read_only_run_says_so(fresh_run, monkeypatch):
    """The audit: the annotate form on a read-only run answered a generic 500. The write fails as on a
    read-only file system (EROFS at the file layer)."""
    from ffkv.explorer import create_app
    from ffkv.store import annotations

    run, loaded = fresh_run

    def read_only(path, table):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(annotations.atomic, "write_parquet", read_only)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded),
                    raise_server_exceptions=False) as c:
        r = c.post("/memory/1/0/annotate", data={"label": "shallow", "description": "", "annotator": "a"},
                   follow_redirects=False)
    assert r.status_code == 403 and "the label was not saved: Read-only file system" in r.text
    assert "must be writable" in r.text and "please report" not in r.text


def namespace_can_mount() -> bool:
    if not shutil.which("unshare"):
        return False
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                          capture_output=True)
    return done.returncode == 0


IN_NAMESPACE = """
import contextlib, io, json, sys
sys.path.insert(0, {tests!r})
from support import tiny_cli
tiny_cli.install()
from ffkv import cli
results = {{}}
for name, argv in json.loads({jobs!r}).items():
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
    results[name] = {{"code": code, "err": err.getvalue(), "out": out.getvalue()}}
if {form!r}:
    from starlette.testclient import TestClient
    from ffkv.explorer import create_app
    from support.helpers import loaded_tiny
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app({form!r}, loaded=loaded_tiny("gpt2")),
                    raise_server_exceptions=False) as c:
        r = c.post("/memory/1/0/annotate", data={{"label": "shallow", "annotator": "a"}}, follow_redirects=False)
        results["form"] = {{"code": r.status_code, "err": r.text, "out": ""}}
print(json.dumps(results))
"""


def in_namespace(script: str, mounts: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f"{mounts} && '{sys.executable}' -c \"$SCRIPT\""],
                          env={**env, "SCRIPT": script}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not namespace_can_mount(), reason="cannot mount a tmpfs in a mount namespace here")
def test_commands_on_a_read_only_run(analyzed, tmp_path):
    """A shared run on a read-only file system: readers read it; writers stop with one line, exit status 1."""
    mount = tmp_path / "ro"
    mount.mkdir()
    labels = tmp_path / "labels.csv"
    labels.write_text("layer,key,label\n0,1,shallow\n")
    run = mount / "run"
    jobs = {"status": ["status", str(run)], "report": ["report", str(run)],
            "analyze": ["analyze", str(run), "--only", "values", "--no-progress"],
            "import": ["annotate", "import", str(run), str(labels)]}
    script = IN_NAMESPACE.format(tests=str(TESTS), jobs=json.dumps(jobs), form=str(run))
    got = in_namespace(script, f"mount -t tmpfs -o size=64m tmpfs '{mount}' && cp -a '{analyzed[0]}' '{run}' && "
                               f"mount -o remount,ro '{mount}'")
    assert got["status"]["code"] == 0 and got["status"]["out"].splitlines()[0] == f"{run}: complete"
    for name in ("report", "analyze", "import"):
        line = error_line(got[name]["err"])
        assert got[name]["code"] == 1 and "read-only file system" in line.lower(), (name, line)
    assert got["form"]["code"] == 403 and "Read-only file system" in got["form"]["err"]


# ------------------------------------------------------------------------------------------ prune

@pytest.fixture(scope="module")
def tiny_lm_run(tmp_path_factory):
    """ffkv-tiny indexed on 40 verses by the real pipeline (a model `ffkv prune` can write and load back)."""
    import ffkv
    from ffkv.corpus import CorpusSpec
    from ffkv.indexing.indexer import IndexOptions, build_index
    from ffkv.models import load_model

    folder = tmp_path_factory.mktemp("tiny_lm_run")
    lines = ffkv.embedded_corpus("train").read_text().splitlines()[:40]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    build_index(load_model("ffkv-tiny"), CorpusSpec(source=str(folder / "corpus.txt"), unit="line"), folder / "run",
                IndexOptions(top_k=3), progress=False)
    return folder / "run"


@pytest.mark.skipif(not namespace_can_mount(), reason="cannot mount a tmpfs in a mount namespace here")
def test_prune_on_a_full_disk(tiny_lm_run, tmp_path):
    """The audit: `ffkv prune` onto a full disk ended in a safetensors traceback. A 256 KB tmpfs: the model
    does not fit; one line, exit status 1, and nothing left behind."""
    mount = tmp_path / "small"
    mount.mkdir()
    jobs = {"prune": ["prune", str(tiny_lm_run), "--criterion", "random", "--share", "0.1",
                      "--out", str(mount / "pruned")]}
    script = IN_NAMESPACE.format(tests=str(TESTS), jobs=json.dumps(jobs), form="") \
        .replace("print(json.dumps(results))", f"import os; results['left'] = os.listdir({str(mount)!r}); "
                                               "print(json.dumps(results))")
    got = in_namespace(script, f"mount -t tmpfs -o size=256k tmpfs '{mount}'")
    line = error_line(got["prune"]["err"])
    assert got["prune"]["code"] == 1 and "No space left on device" in line and "nothing was written" in line
    assert got["left"] == []


def test_what_a_killed_prune_left_is_cleaned_and_only_that(tiny_lm_run, tmp_path, capsys):
    """The audit: a killed prune left `.OUT.*.tmp/` forever. The next prune into the same --out removes the
    folder of a writer that has ended; one that a live writer holds stays."""
    import fcntl

    out = tmp_path / "pruned"
    dead = tmp_path / ".pruned.0dead.tmp"
    (dead / "sub").mkdir(parents=True)
    (dead / "model.safetensors").write_bytes(b"half")
    live = tmp_path / ".pruned.1live.tmp"
    live.mkdir()
    other = tmp_path / ".other.2dead.tmp"  # another name: not this command's
    other.mkdir()
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        code, out_text, err = run(capsys, "prune", tiny_lm_run, "--criterion", "random", "--share", "0.1",
                                  "--out", out)
        assert code == 0, err
        assert not dead.exists() and live.is_dir() and other.is_dir() and (out / "config.json").is_file()
    finally:
        os.close(held)
    assert atomic.clean_stale(tmp_path, "pruned") == [live]  # its writer gone, it goes too


# ------------------------------------------------------------------------------------------ merge, long lines

def test_status_after_a_killed_merge_gives_advice_that_works(own_run, tmp_path, capsys):
    """The audit: after a killed merge, status said to add --resume, which merge rejects."""
    manifest = json.loads((own_run / "manifest.json").read_text())
    manifest["status"] = "running"
    manifest["process"] = {"pid": 999999, "host": os.uname().nodename, "command": "merge",
                           "started": "2026-01-01T00:00:00+0000", "heartbeat": "2026-01-01T00:00:00+0000"}
    (own_run / "manifest.json").write_text(json.dumps(manifest))
    code, out, _ = run(capsys, "status", own_run)
    assert code == 3 and out.splitlines()[0] == f"{own_run}: interrupted" and "--resume" not in out
    assert "rerun the same `ffkv merge` command" in out
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["merge", "a", "--out", "b", "--resume"])  # the advice given before


def test_a_very_long_line_is_cut_with_a_notice_and_memory_follows_the_cut(tmp_path, capsys, tiny_gpt2):
    """The audit: one 20 MiB line peaked at 4.7 GB and was cut to 128 tokens without a word. Now the
    tokenizer reads only a prefix, the cut is counted in the manifest and said in one warning."""
    from ffkv.corpus import CorpusSpec
    from ffkv.corpus.examples import iter_examples
    from support.helpers import CharTokenizer

    long_line = "the cat sat on the mat " * 200_000  # 4.6 MB
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a short line\n" + long_line + "\n" + "another short one\n")

    class Counting(CharTokenizer):
        longest = 0

        def encode(self, text):
            Counting.longest = max(Counting.longest, len(text))
            return super().encode(text)

    examples = list(iter_examples(CorpusSpec(str(corpus), unit="line", max_tokens=64), Counting()))
    whole = CharTokenizer().encode(long_line)[:64]
    assert [e.cut for e in examples] == [False, True, False] and examples[1].token_ids.tolist() == whole
    assert Counting.longest < 20_000  # the tokenizer never saw the 4.6 MB line whole
    code, _, err = run(capsys, "index", "--model", "tiny-gpt2", "--corpus", corpus, "--out", tmp_path / "run",
                       "--unit", "line", "--max-tokens", "64", "--top-k", "2", "--no-progress")
    assert code == 0
    assert "ffkv: warning: 1 example held more than 64 tokens and was cut to the first 64" in err
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["counts"]["examples_cut"] == 1


# ------------------------------------------------------------------------------------------ the explorer's guard

def test_a_short_token_beyond_loopback_is_refused(tmp_path, capsys):
    """The audit: `--token a` was accepted beyond loopback. Refused before anything is read."""
    code, _, err = run(capsys, "serve", tmp_path / "no-run", "--host", "0.0.0.0", "--token", "a")
    assert code == 2 and "--token must be at least 16 characters beyond loopback (got 1)" in error_line(err)


@pytest.mark.parametrize("host", ["127.0.0.1:8000@evil.example", "localhost@evil.example", "127.0.0.1:80ab",
                                  "127.0.0.1:8000/x", "[::1]:8000@evil.example", "127.0.0.1 evil.example"])
def test_host_headers_with_user_info_are_refused(analyzed, host):
    """The audit: `Host: 127.0.0.1:PORT@evil.example` was answered."""
    from ffkv.explorer import create_app

    run, loaded = analyzed
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as c:
        r = c.get("/memory/1/0.json", headers={"host": host})
    assert r.status_code == 400 and "Host header" in r.text and "triggers" not in r.text


def test_a_model_config_holding_a_list(tmp_path, capsys):
    """The audit: a config.json holding a JSON list ended in an AttributeError."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("[1, 2]")
    (tmp_path / "corpus.txt").write_text("a b\n")
    code, _, err = run(capsys, "index", "--model", tmp_path / "model", "--corpus", tmp_path / "corpus.txt",
                       "--out", tmp_path / "run", "--no-progress")
    assert code == 2 and "its config.json is missing or not a model's configuration" in error_line(err)


def test_analyze_on_a_full_disk_exits_1_and_status_names_it(analyzed, tmp_path, capsys, monkeypatch, tiny_gpt2):
    """The audit: a full disk gave exit status 2 in `index` (now 1, tests/cli/test_failures.py) and 1 in
    `analyze`; both are the file system's status, 1. ENOSPC at the third file analyze syncs."""
    run_dir = Path(shutil.copytree(analyzed[0], tmp_path / "run"))
    real, calls = atomic.fsync, disk_full_at(monkeypatch, 3)
    code, _, err = run(capsys, "analyze", run_dir, "--only", "values", "--no-progress")
    assert code == 1 and f"No space left on device ({calls[2]})" in error_line(err)
    monkeypatch.setattr(atomic, "fsync", real)
    code, out, _ = run(capsys, "status", run_dir)
    assert code == 3 and "the last `ffkv analyze` failed (No space left on device" in out


# ------------------------------------------------------------------ other files a user hands ffkv

def test_a_model_config_nested_too_deep_is_one_line(tmp_path, capsys):
    """ffkv_lm's check of a model folder parsed config.json without a depth limit: a RecursionError traceback."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "corpus.txt").write_text("a b\n")
    code, _, err = run(capsys, "index", "--model", tmp_path / "model", "--corpus", tmp_path / "corpus.txt",
                       "--out", tmp_path / "run", "--no-progress")
    assert code == 2 and "its config.json is missing or not a model's configuration" in error_line(err)


def test_a_facts_file_that_is_a_fifo_or_nested_too_deep_is_one_line(tmp_path, capsys):
    """`ffkv locate --facts` waited on a FIFO, and a line nested 100,000 deep gave a RecursionError traceback."""
    fifo = tmp_path / "facts.jsonl"
    os.mkfifo(fifo)
    try:
        done = subprocess.run([sys.executable, "-m", "ffkv.cli", "locate", "--model", "tiny-gpt2", "--facts", str(fifo),
                               "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("ffkv locate waited on a FIFO facts file")
    assert done.returncode == 2 and f"{fifo}: a FIFO (named pipe), not a regular file" in error_line(done.stderr)
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps({"prompt": "a b", "subject": "a"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    code, _, err = run(capsys, "locate", "--model", "tiny-gpt2", "--facts", deep, "--out", tmp_path / "out")
    assert code == 2 and f"{deep}: line 2 is not JSON (nested more than 64 deep)" in error_line(err)


def test_annotate_import_of_a_fifo_says_what_it_is(own_run, tmp_path, capsys):
    """It was called a file that does not exist."""
    os.mkfifo(tmp_path / "labels.csv")
    code, _, err = run(capsys, "annotate", "import", own_run, tmp_path / "labels.csv")
    assert code == 2 and f"{tmp_path / 'labels.csv'}: a FIFO (named pipe), not a regular file" in error_line(err)
    assert read_labels(own_run).empty
