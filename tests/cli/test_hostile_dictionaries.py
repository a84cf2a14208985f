"""Hostile dictionary files, each as a user meets it through the ffkv command: one line and exit 2, nothing hung,
nothing read without end, no array decompressed that the layout does not need, no config read as another kind
than the library that wrote it would read it; and a dictionary recorded where it lies, so that a run indexed
from one folder reads it from any other.

FIFOs named ``cfg.json``, ``sae.safetensors``, ``sae_weights.safetensors`` or ``x.npz`` and a ``cfg.json``
linked to ``/dev/zero`` are read by a real ``ffkv index`` in a subprocess under a timeout (and a memory limit);
a real npz decompression bomb (a 1 MB file holding a gigabyte of zeros) is read with its memory traced.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
import pytest
from starlette.testclient import TestClient

from ffkv.api import Run
from ffkv.dictionaries import reopen, save_sparsify
from ffkv.explorer import create_app
from ffkv.models import loading
from ffkv.store.run import RunDir
from dictionaries.test_layouts import GIB, make, npz_with, saelens_folder, saelens_of, traced_peak
from indexing.test_exactness import write_corpus
from indexing.test_latents import random_dictionary
from support import tiny_cli
from support.cli_runs import error_line, run
from support.helpers import loaded_tiny

TESTS = Path(__file__).resolve().parents[1]
LAYER = 1   # the dictionaries' FF layer, from 0 (t2 as addresses write it)


@pytest.fixture
def tiny_gpt2(monkeypatch):
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])


@pytest.fixture(scope="module")
def view():
    return loaded_tiny("gpt2").view


def index_argv(corpus: Path, out: Path, dictionary: Path | str) -> list[str]:
    return ["index", "--model", "tiny-gpt2", "--corpus", str(corpus), "--unit", "line", "--out", str(out),
            "--top-k", "3", "--control-keys", "4", "--no-progress", "--dictionary", str(dictionary)]


def sparsify_dictionary(folder: Path, view, kind: str = "transcoder") -> Path:
    """A sparsify hookpoint folder of the tiny GPT-2's layer LAYER, ``folder/h.1.mlp`` (an SAE's input bias is its
    decoder bias, as sparsify's)."""
    d = random_dictionary(view, LAYER, kind, "topk")
    if kind == "sae":
        d = replace(d, input_bias=d.decoder_bias)
    return save_sparsify(d, folder / f"h.{LAYER}.mlp")


def edit_config(folder: Path, **changes) -> None:
    config = folder / "cfg.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def replaced_by_fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


# ------------------------------------------------------------------ FIFOs and devices: a real ffkv index, timed

def _limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (16 * GIB, 16 * GIB))   # a reader without end fails, not the machine


def test_fifos_and_devices_named_as_dictionary_files_are_refused_in_one_line_without_waiting(tmp_path, view):
    """The audit: a FIFO named cfg.json hung `ffkv index` until it was killed; cfg.json linked to /dev/zero read
    3.2 GB, then a MemoryError traceback (the 1 MiB check trusted st_size, which is 0 for a device)."""
    write_corpus(tmp_path / "corpus.txt", n=9)
    cases: dict[str, tuple[Path, Path]] = {}   # name -> (--dictionary, the file refused)

    folder = sparsify_dictionary(tmp_path / "fifo_cfg", view)
    cases["fifo_cfg"] = (folder.parent, replaced_by_fifo(folder / "cfg.json"))
    folder = sparsify_dictionary(tmp_path / "fifo_weights", view)
    cases["fifo_weights"] = (folder, replaced_by_fifo(folder / "sae.safetensors"))
    cfg = {"architecture": "standard", "d_in": 6, "d_sae": 24, "apply_b_dec_to_input": True,
           "normalize_activations": "none", "metadata": {"hook_name": f"blocks.{LAYER}.hook_mlp_out"}}
    folder = saelens_folder(tmp_path / "fifo_saelens" / "sae", cfg, saelens_of(make("sae", "relu")))
    cases["fifo_saelens"] = (folder.parent, replaced_by_fifo(folder / "sae_weights.safetensors"))
    (tmp_path / "fifo_npz").mkdir()
    cases["fifo_npz"] = (tmp_path / "fifo_npz", replaced_by_fifo(tmp_path / "fifo_npz" / "x.npz"))
    folder = sparsify_dictionary(tmp_path / "zero_cfg", view)
    (folder / "cfg.json").unlink()
    (folder / "cfg.json").symlink_to("/dev/zero")
    cases["zero_cfg"] = (folder, folder / "cfg.json")
    (tmp_path / "zero_npz").mkdir()
    (tmp_path / "zero_npz" / "x.npz").symlink_to("/dev/zero")
    cases["zero_npz"] = (tmp_path / "zero_npz", tmp_path / "zero_npz" / "x.npz")

    jobs = {name: index_argv(tmp_path / "corpus.txt", tmp_path / f"run_{name}", where)
            for name, (where, _) in cases.items()}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-m", "support.tiny_cli", "--many", str(tmp_path / "jobs.json"),
                               str(tmp_path / "results.json")], env=env, capture_output=True, text=True, timeout=60,
                              preexec_fn=_limited_memory)
    except subprocess.TimeoutExpired:
        pytest.fail("ffkv index waited on a dictionary file (a FIFO?) until the timeout")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    kinds = {"fifo": "a FIFO (named pipe), not a regular file", "zero": "a character device, not a regular file"}
    for name, (_, refused) in cases.items():
        got = results[name]
        assert got["code"] == 2 and "Traceback" not in got["err"], (name, got)
        line = error_line(got["err"])
        assert str(refused) in line and kinds[name.split("_")[0]] in line, (name, line)
        assert got["status"] is None, name   # refused before any run was written


# ------------------------------------------------------------------ configs: one line, read as the library reads them

def test_a_deeply_nested_config_is_one_line(tmp_path, capsys, tiny_gpt2, view):
    """The audit: a RecursionError traceback."""
    write_corpus(tmp_path / "corpus.txt", n=9)
    folder = sparsify_dictionary(tmp_path / "dicts", view)
    (folder / "cfg.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(capsys, *index_argv(tmp_path / "corpus.txt", tmp_path / "run", folder.parent))
    assert code == 2 and f"{folder / 'cfg.json'}: not a JSON config (nested more than 64 deep)" in error_line(err)


@pytest.mark.parametrize("layout", ["sparsify", "saelens"])
def test_a_hookpoint_of_5000_digits_is_one_short_line(tmp_path, capsys, tiny_gpt2, view, layout):
    """The audit: a ValueError traceback (Python's int() refuses more than 4,300 digits)."""
    write_corpus(tmp_path / "corpus.txt", n=9)
    hookpoint = f"layers.{'1' * 5000}.mlp" if layout == "sparsify" else f"blocks.{'1' * 5000}.hook_mlp_out"
    if layout == "sparsify":
        folder = sparsify_dictionary(tmp_path / "dicts", view)
        edit_config(folder, hookpoint=hookpoint)
    else:
        cfg = {"architecture": "standard", "d_in": view.d_model, "d_sae": 24, "apply_b_dec_to_input": True,
               "normalize_activations": "none", "metadata": {"hook_name": hookpoint}}
        d = random_dictionary(view, LAYER, "sae", "relu")
        folder = saelens_folder(tmp_path / "dicts" / "sae", cfg, saelens_of(d))
    code, _, err = run(capsys, *index_argv(tmp_path / "corpus.txt", tmp_path / "run", folder.parent))
    line = error_line(err)
    assert code == 2 and str(folder) in line and "names no FF layer ffkv knows" in line and len(line) < 1000, line


@pytest.mark.parametrize("key", ["transcode", "skip_connection"])
def test_a_boolean_written_as_a_string_is_refused_quoting_it(tmp_path, capsys, tiny_gpt2, view, key):
    """The audit: ``"transcode": "false"`` was read as a transcoder (sparsify 1.3.3 reads "false" as false: an SAE)
    and the run completed on the wrong site; ``"skip_connection": "false"`` was refused saying it was True."""
    write_corpus(tmp_path / "corpus.txt", n=9)
    folder = sparsify_dictionary(tmp_path / "dicts", view, kind="sae")
    edit_config(folder, **{key: "false"})
    code, _, err = run(capsys, *index_argv(tmp_path / "corpus.txt", tmp_path / "run", folder.parent))
    line = error_line(err)
    assert code == 2 and f"{folder / 'cfg.json'}: {key!r} is 'false', expected true or false" in line, line
    assert "True" not in line and not (tmp_path / "run" / "manifest.json").exists()


def test_a_saelens_boolean_written_as_a_string_is_refused(tmp_path, capsys, tiny_gpt2, view):
    write_corpus(tmp_path / "corpus.txt", n=9)
    cfg = {"architecture": "standard", "d_in": view.d_model, "d_sae": 24, "apply_b_dec_to_input": "false",
           "normalize_activations": "none", "metadata": {"hook_name": f"blocks.{LAYER}.hook_mlp_out"}}
    folder = saelens_folder(tmp_path / "dicts" / "sae", cfg, saelens_of(random_dictionary(view, LAYER, "sae", "relu")))
    code, _, err = run(capsys, *index_argv(tmp_path / "corpus.txt", tmp_path / "run", folder.parent))
    assert code == 2 and "'apply_b_dec_to_input' is 'false', expected true or false" in error_line(err)


# ------------------------------------------------------------------ npz bombs

def test_an_unused_compressed_gigabyte_in_an_npz_is_never_read(tmp_path, capsys, tiny_gpt2, view):
    """The audit: a 4.5 MB npz with an unused compressed 2^30-element array cost 4.47 GB (every array was loaded).
    Only the arrays the layout names are read: the run completes, its dictionary's latents indexed."""
    write_corpus(tmp_path / "corpus.txt", n=9)
    d = random_dictionary(view, LAYER, "transcoder", "topk")
    path = npz_with(tmp_path / "bomb.npz", d, bomb=("unused", "|u1", (GIB,), GIB))
    assert path.stat().st_size < 4 << 20
    with traced_peak() as peak:
        code, _, err = run(capsys, *index_argv(tmp_path / "corpus.txt", tmp_path / "run", path))
    assert code == 0, err
    assert peak[0] < 256 << 20, f"{peak[0]:,} bytes traced"
    latents = pd.read_parquet(tmp_path / "run" / "latent_trigger_examples.parquet")
    assert set(latents["layer"]) == {LAYER}


def test_a_bomb_in_a_needed_npz_array_is_refused_from_its_header(tmp_path, capsys, tiny_gpt2, view):
    """A 0-d ``hookpoint`` whose header declares a string of a gigabyte (one element: an element count lets it
    through) is refused by its byte budget before it is decompressed; before, its gigabyte of zeros was read, the
    empty string taken for no hookpoint, and the run completed."""
    write_corpus(tmp_path / "corpus.txt", n=9)
    d = random_dictionary(view, LAYER, "transcoder", "topk")
    path = npz_with(tmp_path / "bomb.npz", d, bomb=("hookpoint", f"<U{GIB // 4}", (), GIB))
    with traced_peak() as peak:
        code, _, err = run(capsys, *index_argv(tmp_path / "corpus.txt", tmp_path / "run", path))
    line = error_line(err)
    assert code == 2 and f"{path}: 'hookpoint' is a <U{GIB // 4} array of shape ()" in line and "4,096 bytes" in line
    assert peak[0] < 256 << 20, f"{peak[0]:,} bytes traced"
    assert not (tmp_path / "run" / "manifest.json").exists()


# ------------------------------------------------------------------ a run indexed with a dictionary

@pytest.fixture(scope="module")
def indexed(tmp_path_factory, view):
    """A run of the tiny GPT-2 indexed with a sparsify transcoder named by a path relative to where the index
    ran (``dicts`` in folder ``a``), its explorer lookups built: (root, run)."""
    root = tmp_path_factory.mktemp("hostile_dictionaries")
    write_corpus(root / "corpus.txt", n=9)
    (root / "a").mkdir()
    sparsify_dictionary(root / "a" / "dicts", view)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
        patch.chdir(root / "a")
        assert cli_main(*index_argv(root / "corpus.txt", root / "run", "dicts")) == 0
        assert cli_main("analyze", root / "run", "--only", "lookups", "--eval-corpus", root / "corpus.txt",
                        "--no-progress") == 0
    return root, root / "run"


def cli_main(*argv) -> int:
    from ffkv import cli

    return cli.main([str(a) for a in argv])


def test_a_dictionary_named_relative_to_one_folder_is_read_from_any_other(indexed, tmp_path, capsys, monkeypatch,
                                                                          tiny_gpt2):
    """The audit: the path was recorded as given (``dicts/h.1.mlp``): from another folder analyze called the
    dictionary gone and skipped it (exit 0, a warning), and serve's latent pages said gone."""
    root, run_dir = indexed
    capsys.readouterr()
    recorded = RunDir(run_dir).manifest().index["dictionary"]
    assert recorded[str(LAYER)]["path"] == str((root / "a" / "dicts" / f"h.{LAYER}.mlp").resolve())
    monkeypatch.chdir(tmp_path)
    assert list(reopen(recorded)) == [LAYER]
    latents = Run(run_dir, loaded=loaded_tiny("gpt2")).memories("latents")
    assert latents.values(LAYER).shape[0] == 24
    own = shutil.copytree(run_dir, tmp_path / "run")
    code, _, err = run(capsys, "analyze", own, "--only", "latents_beside", "--eval-corpus", root / "corpus.txt",
                       "--no-progress")
    assert code == 0 and "not computed" not in err and "gone" not in err, err   # the latents were read


def test_analyze_with_a_deeply_nested_config_at_dictionary_is_one_line(indexed, tmp_path, capsys, tiny_gpt2):
    """The audit: `ffkv analyze RUN --dictionary PATH` gave the RecursionError traceback too."""
    root, run_dir = indexed
    capsys.readouterr()
    own = shutil.copytree(run_dir, tmp_path / "run")
    deep = shutil.copytree(root / "a" / "dicts", tmp_path / "deep")
    (deep / f"h.{LAYER}.mlp" / "cfg.json").write_text("{\"a\": " * 100_000 + "1" + "}" * 100_000)
    code, _, err = run(capsys, "analyze", own, "--only", "lookups", "--eval-corpus", root / "corpus.txt",
                       "--no-progress", "--dictionary", deep)
    line = error_line(err)
    assert code == 2 and f"{deep / f'h.{LAYER}.mlp' / 'cfg.json'}: not a JSON config (nested more than 64 deep)" in line


def test_serve_with_a_fifo_config_answers_its_latent_pages_and_the_others(indexed, tmp_path, tiny_gpt2):
    """The audit: with a FIFO cfg.json at `ffkv serve --dictionary`, the first latent page waited on it and held the
    model's queue: memory and trace pages stopped answering. The latent page now says why the dictionary could not
    be read, at once, and every other page answers."""
    root, run_dir = indexed
    folder = shutil.copytree(root / "a" / "dicts", tmp_path / "moved")
    fifo = replaced_by_fifo(folder / f"h.{LAYER}.mlp" / "cfg.json")
    app = create_app(run_dir, loaded=loaded_tiny("gpt2"), dictionary_at=folder)
    with TestClient(base_url="http://127.0.0.1:8000", app=app, raise_server_exceptions=False) as client:
        answered: dict = {}
        latent_page = threading.Thread(target=lambda: answered.update(page=client.get(f"/memory/t{LAYER + 1}:0")),
                                       daemon=True)
        latent_page.start()
        latent_page.join(30)
        if latent_page.is_alive():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))   # let the reader go, so that the test ends
            latent_page.join(30)
            pytest.fail("the latent page waited on the FIFO cfg.json")
        page = answered["page"]
        assert page.status_code == 200 and f"{fifo}: a FIFO (named pipe), not a regular file" in page.text
        for url in ("/", f"/memory/{LAYER + 1}/3", f"/layer/t{LAYER + 1}", f"/memory/t{LAYER + 1}:1"):
            assert client.get(url, timeout=30).status_code == 200, url


# ------------------------------------------------------------------ a damaged run: refused by every reader, named

def _serve(run_dir: Path) -> subprocess.CompletedProcess:
    """A real `ffkv serve` in a subprocess (tiny-gpt2 by name): a refusal comes before it listens; a server that
    starts instead fails the test at the timeout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-m", "support.tiny_cli", "serve", str(run_dir), "--port", "0"],
                              env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("ffkv serve started on a damaged run instead of refusing it")


def _rewritten(run_dir: Path, rel: str, change, record: bool) -> None:
    """Rewrite the run's table `rel` through `change(DataFrame) -> DataFrame`, its schema kept; with `record`, its
    manifest record rewritten to match (size, rows, SHA-256: a crafted run that passes every record check)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ffkv.store import integrity

    path = run_dir / rel
    table = pq.read_table(path)
    pq.write_table(pa.Table.from_pandas(change(table.to_pandas()), schema=table.schema, preserve_index=False), path)
    if record:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        manifest["tables"][rel] = integrity.describe(path, manifest["tables"][rel]["step"])
        (run_dir / "manifest.json").write_text(json.dumps(manifest))


def _swap_latents(rows: pd.DataFrame) -> pd.DataFrame:
    """Latent 0's trigger rows as latent 1's and back, in the file's order."""
    rows = rows.copy()
    rows["key"] = rows["key"].map(lambda k: {0: 1, 1: 0}.get(k, k)).astype(rows["key"].dtype)
    return rows.sort_values(["layer", "key", "rank"], kind="stable")


@pytest.mark.parametrize("record", [False, True], ids=["as damaged", "record rewritten to its size"])
def test_serve_refuses_latent_triggers_with_two_latents_swapped(indexed, tmp_path, record):
    """The audit: after two latents' rows were swapped in latent_trigger_examples.parquet, `ffkv status` and
    `ffkv analyze` called it damaged, but `ffkv serve` rebuilt its pages from it (/memory/t2:0 showed latent 1's
    examples). The build now hashes what it reads; with the record rewritten to the new size and rows, only the
    SHA-256 tells, and it does."""
    _, run_dir = indexed
    own = shutil.copytree(run_dir, tmp_path / "run")
    _rewritten(own, "latent_trigger_examples.parquet", _swap_latents, record=False)
    if record:
        manifest = json.loads((own / "manifest.json").read_text())
        written = manifest["tables"]["latent_trigger_examples.parquet"]
        written["size"] = (own / "latent_trigger_examples.parquet").stat().st_size   # its hash left as written
        (own / "manifest.json").write_text(json.dumps(manifest))
    done = _serve(own)
    line = error_line(done.stderr)
    assert done.returncode == 3 and f"{own / 'latent_trigger_examples.parquet'} is damaged" in line, done.stderr
    assert ("SHA-256" in line) is record


def test_latent_ids_outside_the_run_are_a_damaged_table_not_a_crash(indexed, tmp_path, capsys, tiny_gpt2):
    """The audit: latent ids out of range in the trigger table crashed `ffkv serve` (IndexError in
    lookups.trigger_summaries); the server never started. A crafted table whose record was rewritten to match is
    refused by serve and by every reader of the table, naming it."""
    _, run_dir = indexed
    own = shutil.copytree(run_dir, tmp_path / "run")

    def outside(rows: pd.DataFrame) -> pd.DataFrame:
        rows = rows.copy()
        rows.loc[rows.index[-1], "key"] = 10 ** 6
        return rows
    _rewritten(own, "latent_trigger_examples.parquet", outside, record=True)
    done = _serve(own)
    line = error_line(done.stderr)
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert (f"{own / 'latent_trigger_examples.parquet'} is damaged (its ids lie outside the run's shape: memory "
            f"1000000 of layer {LAYER} in its rows; that layer has 24)") in line
    with pytest.raises(Exception, match="its ids lie outside the run's shape") as refused:
        RunDir(own).read_triggers(source="latents")
    assert type(refused.value).__name__ == "DamagedRun"


def test_neuron_ranks_outside_top_k_are_a_damaged_table(indexed, tmp_path):
    _, run_dir = indexed
    own = shutil.copytree(run_dir, tmp_path / "run")

    def outside(rows: pd.DataFrame) -> pd.DataFrame:
        rows = rows.copy()
        rows.loc[rows.index[0], "rank"] = 3   # indexed with --top-k 3: ranks 0 to 2
        return rows
    _rewritten(own, "trigger_examples.parquet", outside, record=True)
    with pytest.raises(Exception, match=r"rank 3 in its rows; the run keeps the top 3"):
        RunDir(own).read_triggers()
    done = _serve(own)
    assert done.returncode == 3 and "rank 3 in its rows" in error_line(done.stderr)


def test_a_deleted_latent_table_is_missing_for_analyze_and_serve(indexed, tmp_path, capsys, tiny_gpt2):
    """The audit: with latent_trigger_examples.parquet deleted, `analyze --only values,lookups` exited 0 and rebuilt
    the explorer without latents; serve then said the run "was indexed without a sparse dictionary" though its
    manifest records one. Now both refuse it as missing, as a deleted control table is (exit 3)."""
    root, run_dir = indexed
    own = shutil.copytree(run_dir, tmp_path / "run")
    (own / "latent_trigger_examples.parquet").unlink()
    capsys.readouterr()
    code, _, err = run(capsys, "analyze", own, "--only", "values,lookups", "--eval-corpus", root / "corpus.txt",
                       "--no-progress")
    missing = f"{own / 'latent_trigger_examples.parquet'} is missing: the index cannot be rewritten in place"
    assert code == 3 and missing in error_line(err)
    done = _serve(own)
    assert done.returncode == 3 and missing in error_line(done.stderr)
    code, out, _ = run(capsys, "status", own)
    assert code == 3 and missing in out


def test_latents_beside_refuses_studies_of_other_held_out_examples(indexed, tmp_path, capsys, tiny_gpt2):
    """The audit: `ffkv analyze --only latents_beside` with another --n-eval than the analysis before dropped 10
    of its 15 rows without a word (exit 0). The studies it gathers from an earlier analyze must be of this call's
    held-out examples; otherwise it is refused naming them and the command."""
    root, run_dir = indexed
    own = shutil.copytree(run_dir, tmp_path / "run")
    corpus = root / "corpus.txt"
    capsys.readouterr()
    code, _, err = run(capsys, "analyze", own, "--only", "values,composition,latents_beside", "--eval-corpus", corpus,
                       "--n-eval", "8", "--no-progress")
    assert code == 0, err
    first = pd.read_parquet(own / "metrics" / "latents_beside.parquet")
    assert {"composition_latents", "values_latents"} <= set(first["study"])
    code, _, err = run(capsys, "analyze", own, "--only", "latents_beside", "--eval-corpus", corpus, "--n-eval", "5",
                       "--no-progress")
    line = error_line(err)
    assert code == 2 and "latents_beside gathers the latent tables of composition," in line
    assert f"`ffkv analyze {own} --only composition,latents_beside`" in line and "n-eval" in line
    pd.testing.assert_frame_equal(pd.read_parquet(own / "metrics" / "latents_beside.parquet"), first)
    code, _, err = run(capsys, "analyze", own, "--only", "latents_beside", "--eval-corpus", corpus, "--n-eval", "8",
                       "--no-progress")
    assert code == 0, err   # the same examples: it reads them
    pd.testing.assert_frame_equal(pd.read_parquet(own / "metrics" / "latents_beside.parquet"), first,
                                  check_exact=False, rtol=1e-6)


def test_latents_beside_of_a_gone_dictionary_is_skipped_not_written(indexed, tmp_path, capsys, tiny_gpt2, view):
    """The audit: with the dictionary gone, analyze warned, exited 0 and still printed that latents_beside was
    written. Now a full analyze says it was skipped and why; named alone it is refused."""
    root, _ = indexed
    corpus = root / "corpus.txt"
    dicts = sparsify_dictionary(tmp_path / "dicts", view)
    assert cli_main(*index_argv(corpus, tmp_path / "run", dicts)) == 0
    shutil.move(dicts, tmp_path / "moved")
    capsys.readouterr()
    code, out, err = run(capsys, "analyze", tmp_path / "run", "--only", "values,latents_beside", "--eval-corpus",
                         corpus, "--no-progress")
    assert code == 2 and "latents_beside: the run's dictionary cannot be read:" in error_line(err)
    assert f"{dicts}: the dictionary this run was indexed with is gone" in error_line(err)
    code, out, err = run(capsys, "analyze", tmp_path / "run", "--eval-corpus", corpus, "--no-progress")
    assert code == 0, err
    written = out.splitlines()[0].rsplit(": ", 1)[1].split(", ")
    assert "values" in written and "latents_beside" not in written and "lookups" not in written
    assert "skipped latents_beside: the run's dictionary cannot be read" in out
    assert "skipped lookups: the run's dictionary cannot be read" in out
    code, out, _ = run(capsys, "status", tmp_path / "run")
    assert code == 3 and f"{dicts} is missing (the sparse dictionary of FF layer {LAYER + 1}" in out


def test_status_verify_reads_the_dictionary_again(indexed, tmp_path, capsys, tiny_gpt2, view):
    """The audit: after the dictionary's files were swapped for a permuted one of the same shape, `ffkv status
    --verify` said "all as written" (exit 0) while analyze, serve and intervene refused it."""
    root, _ = indexed
    d = random_dictionary(view, LAYER, "transcoder", "topk")
    folder = save_sparsify(d, tmp_path / "dicts" / f"h.{LAYER}.mlp")
    assert cli_main(*index_argv(root / "corpus.txt", tmp_path / "run", tmp_path / "dicts")) == 0
    capsys.readouterr()
    code, out, _ = run(capsys, "status", tmp_path / "run", "--verify")
    assert code == 0 and "the sparse dictionary's files" in out and "all as written" in out, out
    order = torch.randperm(d.encoder.shape[0], generator=torch.Generator().manual_seed(1))
    permuted = replace(d, encoder=d.encoder[order], encoder_bias=d.encoder_bias[order], decoder=d.decoder[order])
    shutil.rmtree(folder)
    save_sparsify(permuted, folder)
    code, out, _ = run(capsys, "status", tmp_path / "run")
    assert code == 0, out   # present: without --verify the files are not read
    code, out, _ = run(capsys, "status", tmp_path / "run", "--verify")
    assert code == 3 and f"{folder} is damaged (the sparse dictionary of FF layer {LAYER + 1}" in out
    assert "not the dictionary this run was indexed with" in out and "see above" in out


def test_a_corpus_named_relative_to_one_folder_is_read_from_any_other(indexed, tmp_path, capsys, monkeypatch,
                                                                      tiny_gpt2):
    """A run indexed with `--corpus corpus.txt` recorded it so: from another folder `ffkv analyze` (whose held-out
    examples are the run's corpus by default) said the corpus did not exist. It is recorded where it lies."""
    root, _ = indexed
    (tmp_path / "here").mkdir()
    shutil.copy(root / "corpus.txt", tmp_path / "here" / "corpus.txt")
    monkeypatch.chdir(tmp_path / "here")
    argv = index_argv(Path("corpus.txt"), tmp_path / "run", root / "a" / "dicts")
    assert cli_main(*argv) == 0
    assert RunDir(tmp_path / "run").manifest().corpus["source"] == str(tmp_path / "here" / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code, _, err = run(capsys, "analyze", tmp_path / "run", "--only", "composition", "--eval-split", "all",
                       "--no-progress")
    assert code == 0, err
