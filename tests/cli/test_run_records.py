"""Every file a run holds is in its record, and `ffkv status` names one that is not as written (issue 42, items 2
and 6).

On a run built by the real pipeline (tests/support/runs.py: index, then every experiment): figures swapped or
edited, the translators cut short, a hand-written labels table holding what the run cannot have, the explorer's database edited, the
random-key control's table deleted, a merge interrupted, a metrics table cut short under the explorer's
overview. Each advice `ffkv status` gives for them is run, and the run is whole afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from starlette.testclient import TestClient

from ffkv.errors import DamagedRun
from ffkv.models import loading
from ffkv.store import atomic, schemas
from ffkv.store.annotations import read_labels
from support import tiny_cli
from support.cli_runs import error_line, run


@pytest.fixture
def own(analyzed, tmp_path, monkeypatch):
    """A private copy of the analysed run; its model, tiny-gpt2, loads by name (`support.tiny_cli`)."""
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    return Path(shutil.copytree(analyzed[0], tmp_path / "run"))


def advice(out: str, path: Path) -> list[str]:
    """The command `ffkv status` advises for the file `path` (its line's first `ffkv ...` in backquotes), as argv."""
    line = next(line for line in out.splitlines() if f"{path} is " in line)
    return shlex.split(re.search(r"`ffkv ([^`]+)`", line).group(1))


def follow(capsys, out: str, path: Path) -> None:
    """Run the command status advised for `path`; it must succeed."""
    argv = advice(out, path)
    code, _, err = run(capsys, *argv, *(["--no-progress"] if argv[0] == "analyze" else []))
    assert code == 0, (argv, err[-2000:])


def whole(capsys, run_dir: Path) -> None:
    code, out, _ = run(capsys, "status", "--verify", run_dir)
    assert code == 0 and out.splitlines()[0] == f"{run_dir}: complete" and "all as written" in out, out


# ------------------------------------------------------------------------------------------------ figures

def test_swapped_figures_are_named_and_never_reported(own, capsys):
    """The audit: values.png and patterns.png swapped: `status --verify` said "all as written" and `report` exited
    0 with the wrong images."""
    values, patterns = own / "figures" / "values.png", own / "figures" / "patterns.png"
    first, second = values.read_bytes(), patterns.read_bytes()
    values.write_bytes(second)
    patterns.write_bytes(first)
    for argv in (["status", own], ["status", "--verify", own]):
        code, out, _ = run(capsys, *argv)
        assert code == 3 and out.splitlines()[0] == f"{own}: complete, but 2 files damaged or missing", out
        assert f"{values} is damaged (" in out and f"draw it again with `ffkv analyze {own} --only values`" in out
        assert f"{patterns} is damaged (" in out and f"`ffkv analyze {own} --only patterns`" in out
    assert "all as written" not in out
    before = (own / "report.html").read_bytes() if (own / "report.html").exists() else None
    code, _, err = run(capsys, "report", own)
    line = error_line(err)
    assert code == 3 and "figures/" in line and " is damaged (" in line and "draw it again with `ffkv analyze" in line
    assert "no report was written" in line
    assert ((own / "report.html").read_bytes() if (own / "report.html").exists() else None) == before
    follow(capsys, out, values)
    follow(capsys, out, patterns)
    whole(capsys, own)
    assert run(capsys, "report", own)[0] == 0


def test_a_figure_edited_in_place_is_named_without_verify(own, capsys):
    """Same size, other bytes: figures are small, so every check hashes them."""
    path = own / "figures" / "values.svg"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "status", own)
    assert code == 3 and f"{path} is damaged (its bytes differ from those written (SHA-256))" in out


def test_the_explorer_overview_does_not_show_a_damaged_figure(own, analyzed):
    from ffkv.explorer import create_app

    values, patterns = own / "figures" / "values.png", own / "figures" / "patterns.png"
    first = values.read_bytes()
    values.write_bytes(patterns.read_bytes())
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(own, loaded=analyzed[1])) as c:
        page = c.get("/").text
    assert f"Not shown: {values} is damaged (" in page and 'src="/files/figures/values.png"' not in page
    assert 'src="/files/figures/patterns.png"' in page
    values.write_bytes(first)


# ------------------------------------------------------------------------------------------------ labels

def hand_written_labels(run_dir: Path) -> Path:
    """The audit's table: layer 99, key 99999, key -5, label "bogus" (this run: 3 layers of 40 keys)."""
    rows = [(99, 1, "shallow"), (0, 99999, "none"), (1, -5, "both"), (2, 3, "bogus"), (0, 2, "semantic")]
    table = pd.DataFrame([{"layer": layer, "key": key, "label": label, "description": "", "annotator": "me",
                           "time": "2026-01-01T00:00:00Z"} for layer, key, label in rows])
    path = run_dir / "annotations" / "labels.parquet"
    path.parent.mkdir(exist_ok=True)
    atomic.write_parquet(path, pa.Table.from_pandas(table, schema=schemas.LABELS, preserve_index=False))
    return path


def test_labels_the_run_cannot_have_are_named_everywhere(own, tmp_path, capsys):
    """The audit: such a table passed `status`, `report` (a layer "100" and a "bogus" column) and the next
    import's merge."""
    path = hand_written_labels(own)
    written = path.read_bytes()
    named = ("4 of its 5 rows hold what this run cannot have (rows counted from 1): row 1: layer 99 (this run's "
             "layers are 0 to 2, 0-based); row 2: key 99999 (this run's keys are 0 to 39); row 3: key -5 (this "
             "run's keys are 0 to 39); and 1 more")
    for argv in (["status", own], ["status", "--verify", own]):
        code, out, _ = run(capsys, *argv)
        assert code == 3 and f"{path} is damaged ({named}): restore it from a copy, or move it away" in out, out
    code, _, err = run(capsys, "report", own)
    line = error_line(err)
    assert code == 3 and f"{path} is damaged ({named})" in line and "no report was written" in line
    labels = tmp_path / "labels.csv"
    labels.write_text("layer,key,label\n0,1,shallow\n")
    code, _, err = run(capsys, "annotate", "import", own, labels)
    assert code == 3 and f"{path} is damaged ({named})" in error_line(err)
    assert path.read_bytes() == written  # nothing merged into it
    code, _, err = run(capsys, "analyze", own, "--only", "patterns", "--no-progress")
    assert code == 3 and f"{path} is damaged ({named})" in error_line(err)  # before anything ran
    assert "analyzing" not in json.loads((own / "manifest.json").read_text())
    with pytest.raises(DamagedRun, match="row 3: key -5"):
        read_labels(own)
    table = pd.read_parquet(path).iloc[3:]
    atomic.write_parquet(path, pa.Table.from_pandas(table, schema=schemas.LABELS, preserve_index=False))
    with pytest.raises(DamagedRun, match=r"\(1 of its 2 rows .*: row 1: label 'bogus' \(labels are shallow, semantic, "
                                         r"both, none\)\)"):
        read_labels(own)
    shutil.move(path, tmp_path / "aside.parquet")  # the advice: move it away
    whole(capsys, own)
    assert run(capsys, "annotate", "import", own, labels)[0] == 0
    whole(capsys, own)


def test_labels_of_another_schema_are_named(own, capsys):
    path = own / "annotations" / "labels.parquet"
    path.parent.mkdir(exist_ok=True)
    atomic.write_parquet(path, pa.table({"layer": ["one"], "key": [1], "label": ["shallow"]}))
    code, out, _ = run(capsys, "status", own)
    assert code == 3 and (f"{path} is damaged (it lacks the column(s) layer, key, description, annotator, time of "
                          "type int16, int32, string, string, string)") in out


# ------------------------------------------------------------------------------------------------ the explorer

def edit_database(run_dir: Path) -> Path:
    """The audit: explorer.duckdb edited, and its size in info.json updated to match."""
    path = run_dir / "explorer" / "explorer.duckdb"
    with open(path, "ab") as handle:
        handle.write(b"\0" * 4096)
    info_path = run_dir / "explorer" / "info.json"
    info = json.loads(info_path.read_text())
    for record in (info.get("files") or {}, info.get("sizes") or {}):
        if "explorer.duckdb" in record:
            if isinstance(record["explorer.duckdb"], dict):
                record["explorer.duckdb"]["size"] = path.stat().st_size
            else:
                record["explorer.duckdb"] = path.stat().st_size
    info_path.write_text(json.dumps(info))
    return path


def test_an_edited_explorer_database_is_named_by_verify(own, capsys):
    path = edit_database(own)
    code, out, _ = run(capsys, "status", "--verify", own)
    assert code == 3 and "all as written" not in out, out
    assert (f"{path} is damaged (its bytes differ from those written (SHA-256)): rebuild them with "
            f"`ffkv analyze {own} --only lookups`") in out
    follow(capsys, out, path)
    whole(capsys, own)


def test_lookup_tables_built_before_their_hashes_still_read(own, capsys):
    info_path = own / "explorer" / "info.json"
    info = json.loads(info_path.read_text())
    info["sizes"] = {name: record["size"] for name, record in info.pop("files").items()
                     if name.endswith((".duckdb", ".parquet"))}
    info_path.write_text(json.dumps(info))
    whole(capsys, own)
    from ffkv.explorer.data import ExplorerData

    assert ExplorerData(own, loaded=None).folder == own / "explorer"  # taken as they are, not rebuilt


def test_a_table_cut_short_is_marked_in_the_explorer_overview(own, analyzed):
    """The audit: with metrics/values.parquet truncated, the overview showed that table's findings unmarked."""
    from ffkv.explorer import create_app

    path = own / "metrics" / "values.parquet"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(own, loaded=analyzed[1])) as c:
        page = c.get("/").text
    fidelity = page.split('id="fidelity"')[1].split("</table>")[0]
    rows = [row for row in fidelity.split("<tr")[2:] if ">values<" in row]
    assert rows, fidelity[:2000]
    for row in rows:
        assert f"not shown: {path} is damaged (" in row and f"`ffkv analyze {own} --only values`" in row, row
    others = [row for row in fidelity.split("<tr")[2:] if ">values<" not in row]
    assert others and not any("not shown" in row for row in others)


# ------------------------------------------------------------------------------------------------ the index

def test_a_missing_control_table_is_advised_an_index_that_writes_it(own, capsys):
    """The audit: status advised `ffkv analyze RUN --only lookups`, which does not rewrite it."""
    path = own / "control_trigger_examples.parquet"
    path.unlink()
    code, out, _ = run(capsys, "status", own)
    assert code == 3 and f"{path} is missing: the index cannot be rewritten in place: index the corpus again" in out
    assert "--only lookups" not in out
    manifest = json.loads((own / "manifest.json").read_text())
    corpus = manifest["corpus"]
    again = own.parent / "again"
    code, _, err = run(capsys, "index", "--model", "tiny-gpt2", "--corpus", corpus["source"], "--unit", corpus["unit"],
                       "--top-k", manifest["index"]["top_k"], "--control-keys", manifest["index"]["control_keys"],
                       "--out", again, "--no-progress")
    assert code == 0, err
    assert (again / path.name).is_file()
    whole(capsys, again)


@pytest.mark.parametrize("state", ["interrupted", "failed", "killed"])
@pytest.mark.parametrize("command", ["merge", "index"])
def test_status_of_an_unfinished_run_exits_3(index_only, tmp_path, capsys, state, command):
    """The audit: `status` of a run interrupted during merge exited 0, which --help defines as "every run readable
    and whole"."""
    out = Path(shutil.copytree(index_only, tmp_path / "run"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["status"] = "running" if state == "killed" else state
    manifest["error"] = "No space left on device" if state == "failed" else None
    manifest["process"] = {"pid": 999999, "host": os.uname().nodename, "command": command,
                           "started": "2026-01-01T00:00:00+0000", "heartbeat": "2026-01-01T00:00:00+0000"}
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, said, _ = run(capsys, "status", out)
    assert code == 3 and said.splitlines()[0] == f"{out}: {'failed' if state == 'failed' else 'interrupted'}"
    from ffkv import cli

    help_text = cli.build_parser().format_help()
    assert "an index or merge that stopped" in help_text and "3  a damaged run" in help_text


def test_every_advice_for_missing_files_rewrites_them(own, capsys):
    """Each kind of advice for a missing file of an analysed run, run as printed: a metrics table of one
    experiment, the fidelity table (written at the end of every analyze), a figure, the explorer's folder."""
    gone = [own / "metrics" / "values_keys.parquet", own / "metrics" / "fidelity.parquet",
            own / "figures" / "patterns.svg"]
    for path in gone:
        path.unlink()
    shutil.rmtree(own / "explorer")
    code, out, _ = run(capsys, "status", own)
    assert code == 3
    assert advice(out, gone[0])[:3] == ["analyze", str(own), "--only"] and advice(out, gone[0])[3] == "values"
    assert advice(out, gone[1]) == ["analyze", str(own), "--only", "lookups"]
    assert advice(out, gone[2]) == ["analyze", str(own), "--only", "patterns"]
    assert advice(out, own / "explorer") == ["analyze", str(own), "--only", "lookups"]
    for path in [*gone, own / "explorer"]:
        follow(capsys, out, path)
    whole(capsys, own)
    assert all(path.exists() for path in gone) and (own / "explorer" / "explorer.duckdb").is_file()


def test_the_advice_for_a_missing_explanations_table_rewrites_it(own, capsys):
    """`ffkv explain` needs its language model named: the advice says so, and run with it, rewrites the table."""
    from support.chat_server import ChatServer

    path = own / "metrics" / "explanations.parquet"
    with ChatServer() as server:
        backend = f"openai:{server.url}#rule"
        options = ["--memories", "1:5,2:3", "--no-progress"]
        assert run(capsys, "explain", own, "--explainer", backend, *options)[0] == 0
        whole(capsys, own)
        path.unlink()
        code, out, _ = run(capsys, "status", own)
        assert code == 3 and (f"{path} is missing: rewrite it with `ffkv explain {own} --explainer BACKEND` and the "
                              "memories and options it was run with") in out, out
        argv = [backend if arg == "BACKEND" else arg for arg in advice(out, path)]
        code, _, err = run(capsys, *argv, *options)
        assert code == 0, err
    whole(capsys, own)


def test_the_translators_are_recorded_and_a_damaged_file_is_named(own, capsys):
    """`ffkv analyze --only translators` keeps fitted translators in the run: recorded, checked, and rewritten by
    the command status advises."""
    corpus = json.loads((own / "manifest.json").read_text())["corpus"]["source"]
    fit = ["analyze", own, "--only", "translators", "--eval-corpus", corpus, "--no-progress"]
    code, _, err = run(capsys, *fit)
    assert code == 0, err
    recorded = json.loads((own / "manifest.json").read_text())["files"]
    assert {"translators/translators.npz", "translators/translators.json"} <= set(recorded)
    whole(capsys, own)
    path = own / "translators" / "translators.npz"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 7)
    code, out, _ = run(capsys, "status", own)
    assert code == 3 and f"{path} is damaged (" in out and f"`ffkv analyze {own} --only translators`" in out
    code, _, err = run(capsys, *advice(out, path), "--eval-corpus", corpus, "--no-progress")
    assert code == 0, err
    whole(capsys, own)


def test_a_figure_no_analyze_drew_is_named_and_never_reported(own, capsys):
    """A figure file dropped among an experiment's recorded figures (copied from another run, say) is not the
    run's: named, and the report refuses to embed it. Figures of a run drawn before the records stay unnamed."""
    stray = own / "figures" / "values_copied.png"
    shutil.copy(own / "figures" / "patterns.png", stray)
    code, out, _ = run(capsys, "status", own)
    assert code == 3 and (f"{stray} is damaged (`ffkv analyze --only values` did not draw it: it is not in the run's "
                          "record): move it out of the run's figures folder") in out, out
    code, _, err = run(capsys, "report", own)
    assert code == 3 and f"{stray} is damaged (" in error_line(err)
    stray.unlink()
    manifest = json.loads((own / "manifest.json").read_text())
    manifest["files"] = {rel: record for rel, record in manifest["files"].items() if record["step"] != "patterns"}
    (own / "manifest.json").write_text(json.dumps(manifest))
    whole(capsys, own)  # the patterns figures, unrecorded, as an older ffkv drew them
