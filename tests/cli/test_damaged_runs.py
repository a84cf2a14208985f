"""A damaged run is named as damaged, never read into a wrong report (the audit's Why 2-3).

On a run built by the real pipeline (tests/support/runs.py: index, then every experiment): each metrics
table deleted, one table copied over another, tables cut short or of another schema, bytes flipped in
place, and an analyze killed in its middle. `ffkv report` refuses a damaged table and marks a missing one
in its section; `ffkv status` names each with the command that rewrites it and exits 3; `ffkv analyze`
and `ffkv serve` refuse with one line. Each asserts the one line and the exit code.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from ffkv import cli
from ffkv.errors import DamagedRun
from ffkv.models import loading
from ffkv.store import atomic
from support import tiny_cli
from support.cli_runs import error_line, run

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def damaged(analyzed, tmp_path, monkeypatch):
    """A private copy of the analysed run; its model, tiny-gpt2, loads by name (`support.tiny_cli`)."""
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    return Path(shutil.copytree(analyzed[0], tmp_path / "run"))


def tables_of(run: Path) -> list[str]:
    return sorted(p.stem for p in (run / "metrics").glob("*.parquet"))


def test_the_run_reads_whole(damaged, capsys):
    manifest = json.loads((damaged / "manifest.json").read_text())
    recorded = set(manifest["tables"])
    index = {"examples.parquet", "trigger_examples.parquet", "control_trigger_examples.parquet", "control_keys.parquet"}
    assert index <= recorded
    assert {f"metrics/{name}.parquet" for name in tables_of(damaged)} == recorded - index
    code, out, _ = run(capsys, "status", "--verify", damaged)
    assert code == 0 and out.splitlines()[0] == f"{damaged}: complete" and "all as written" in out, out


def test_every_missing_table_is_marked_in_the_report(damaged, capsys):
    """The audit: with any one of the metrics tables deleted, the report exited 0 and dropped the measurement
    (its section kept the paper's claim and the figure) while status said complete."""
    names = tables_of(damaged)
    assert len(names) >= 20
    aside = damaged.parent / "aside.parquet"
    for name in names:
        table = damaged / "metrics" / f"{name}.parquet"
        shutil.move(table, aside)
        try:
            code, out, _ = run(capsys, "status", damaged)
            assert code == 3 and f"{table} is missing: rewrite it with `ffkv analyze {damaged} --only " in out, out
            code, out, err = run(capsys, "report", damaged)
            assert code == 0, err
            assert f"ffkv: warning: {table} is missing" in err
            page = (damaged / "report.html").read_text()
            assert f"not computed: metrics/{name}.parquet is missing; rewrite it with `ffkv analyze" in page, name
        finally:
            shutil.move(aside, table)
    assert run(capsys, "status", damaged)[0] == 0


def test_a_table_copied_over_another_is_refused(damaged, capsys):
    """The audit: values.parquet copied over patterns.parquet printed the values table under "Patterns"."""
    shutil.copy(damaged / "metrics" / "values.parquet", damaged / "metrics" / "patterns.parquet")
    code, _, err = run(capsys, "report", damaged)
    line = error_line(err)
    assert code == 3 and f"{damaged}/metrics/patterns.parquet is damaged (" in line
    assert f"rewrite it with `ffkv analyze {damaged} --only patterns`" in line and "no report was written" in line
    code, out, _ = run(capsys, "status", damaged)
    assert code == 3 and out.splitlines()[0] == f"{damaged}: complete, but 1 file damaged or missing"


@pytest.mark.parametrize("table", ["trigger_examples.parquet", "examples.parquet", "metrics/values.parquet",
                                   "metrics/patterns_keys.parquet"])
@pytest.mark.parametrize("damage", ["truncated", "other schema"])
def test_a_damaged_table_gives_one_line_everywhere(damaged, capsys, table, damage):
    """The audit: a truncated table, or one of the wrong schema, gave tracebacks in report, analyze and serve
    (which then never answered), some not naming the file, while status said complete."""
    path = damaged / table
    if damage == "truncated":
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    else:
        atomic.write_parquet(path, pa.table({"layer": [0, 1], "other": ["a", "b"]}))
    code, out, _ = run(capsys, "status", damaged)
    assert code == 3 and f"{path} is damaged (" in out, out
    index = table in ("trigger_examples.parquet", "examples.parquet")
    fix = "the index cannot be rewritten in place" if index else f"--only {Path(table).stem.split('_')[0]}`"
    commands = [["report", damaged], ["analyze", damaged, "--only", "ablations", "--no-progress"],
                ["serve", damaged, "--port", "0"]]
    for argv in commands:
        if argv[0] == "serve" and table == "metrics/values.parquet":
            continue  # the explorer does not read values.parquet: its pages that do answer with the line
        code, _, err = run(capsys, *argv)
        line = error_line(err)
        assert code == 3 and f"{path} is damaged (" in line and fix in line, (argv, line)


def test_bytes_changed_in_place_are_found_by_verify(damaged, capsys):
    path = damaged / "metrics" / "values_keys.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF  # same size, same footer
    path.write_bytes(bytes(data))
    assert run(capsys, "status", damaged)[0] == 0  # the quick check reads sizes, footers, rows and columns
    code, out, _ = run(capsys, "status", "--verify", damaged)
    assert code == 3 and f"{path} is damaged (its bytes differ from those written (SHA-256))" in out


def test_a_run_of_an_older_ffkv_without_records(damaged, capsys):
    """Runs written before the records: a metrics table is still checked by the name it carries, and the
    index tables by their columns."""
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest["tables"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert run(capsys, "status", damaged)[0] == 0
    shutil.copy(damaged / "metrics" / "values.parquet", damaged / "metrics" / "patterns.parquet")
    code, _, err = run(capsys, "report", damaged)
    assert code == 3 and "(it holds the table 'values', not 'patterns')" in error_line(err)
    (damaged / "metrics" / "values.parquet").unlink()
    code, out, _ = run(capsys, "status", damaged)
    assert code == 3 and f"{damaged}/metrics/values.parquet is missing" in out  # listed in the manifest's analyses


KILLED_ANALYZE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from ffkv.experiments import analyze
from support.helpers import loaded_tiny
from support.runs import sharpen
import ffkv.experiments.values as values

def killed(ctx, options):
    os.kill(os.getpid(), signal.SIGKILL)

object.__setattr__(values.EXPERIMENT, "compute", killed)  # the step analyze runs as values (its declaration)
analyze({run!r}, only=["patterns", "ablations", "values", "composition"], eval_corpus={corpus!r}, n_eval=20,
        progress=False, loaded=sharpen(loaded_tiny("gpt2")))
"""


def test_an_analyze_killed_in_its_middle_is_named(damaged, analyzed, capsys):
    """The audit: after kill -9 in the middle of analyze, status said complete with old and new tables mixed."""
    corpus = analyzed[0].parent / "corpus.txt"
    script = KILLED_ANALYZE.format(tests=str(TESTS), run=str(damaged), corpus=str(corpus))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, done.stderr[-2000:]
    code, out, _ = run(capsys, "status", damaged)
    assert code == 3 and out.splitlines()[0] == f"{damaged}: complete, but its last analyze did not finish", out
    assert ("the last `ffkv analyze` was cut off (killed or crashed): 2 of 4 steps done (patterns, ablations); the "
            "tables of the others are from an earlier analyze or missing: rerun "
            f"`ffkv analyze {damaged} --only values,composition`") in out
    assert f"{damaged}/metrics/values.parquet is out of date (from an analyze before the one that was cut off)" in out
    assert f"{damaged}/metrics/fidelity.parquet is out of date" in out
    assert f"{damaged}/metrics/patterns.parquet" not in out  # rewritten by the analyze that was cut off
    code, _, err = run(capsys, "report", damaged)
    assert code == 0 and "ffkv: warning: the last `ffkv analyze` was cut off" in err
    page = (damaged / "report.html").read_text()
    assert "the last `ffkv analyze` was cut off" in page and "values.parquet is out of date" in page
    from ffkv.experiments import analyze

    analyze(damaged, only=["values", "composition"], eval_corpus=str(corpus), n_eval=20, progress=False,
            loaded=analyzed[1])
    code, out, _ = run(capsys, "status", damaged)
    assert code == 0 and out.splitlines()[0] == f"{damaged}: complete", out


def test_a_deleted_explorer_folder_is_not_called_unanalysed(damaged, capsys):
    shutil.rmtree(damaged / "explorer")
    code, out, _ = run(capsys, "status", damaged)
    assert code == 0 and f"{damaged}/explorer is missing (the explorer's lookup tables): rebuild them with " \
        f"`ffkv analyze {damaged} --only lookups`" in out
    from ffkv.explorer.data import ExplorerData

    capsys.readouterr()
    ExplorerData(damaged, loaded=None, progress=True)
    said = capsys.readouterr().out
    assert "its lookup tables are missing or out of date" in said and "not analysed" not in said


def test_status_into_a_closed_pipe_says_nothing(damaged):
    """The audit: `ffkv status RUN | head -2` printed "Broken pipe"."""
    runs = " ".join([str(damaged)] * 300)  # more output than a pipe holds: the writes meet the closed pipe
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m ffkv.cli status {runs} | head -2; "
                                         "echo ${PIPESTATUS[0]} >&2"], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines() == [f"{damaged}: complete", done.stdout.splitlines()[1]]
    assert done.stderr.strip() == "141", done.stderr


def test_exit_codes_are_documented_once():
    from ffkv.errors import EXIT_CODES, FfkvError, StorageError

    text = cli.build_parser().format_help()
    for code, meaning in EXIT_CODES.items():
        assert f"{code:>3}  {meaning[:40]}" in text
    assert (StorageError.exit_code, FfkvError.exit_code, DamagedRun.exit_code) == (1, 2, 3)


def test_a_skipped_study_is_listed_as_skipped(damaged, capsys):
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["analyses"]["membership"] = {"skipped": "no known training split: give --member-corpus and "
                                                     "--nonmember-corpus"}
    for name in ("membership", "membership_examples"):
        (damaged / "metrics" / f"{name}.parquet").unlink()
        del manifest["tables"][f"metrics/{name}.parquet"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    code, out, _ = run(capsys, "status", damaged)
    assert code == 0 and "  skipped: membership: no known training split" in out
    assert "membership" not in out.split("\n")[2]  # not among the analyses that ran
    assert run(capsys, "report", damaged)[0] == 0
    page = (damaged / "report.html").read_text()
    assert '<div class="warning skipped"><strong>Skipped:</strong> no known training split' in page


def test_analyze_says_what_it_skipped(capsys, monkeypatch):
    import ffkv.experiments

    done = {"patterns": {"tables": ["patterns"]}, "membership": {"skipped": "no known training split: give "
                                                                              "--member-corpus"}}
    monkeypatch.setattr(ffkv.experiments, "analyze", lambda *a, **k: done)
    code, out, _ = run(capsys, "analyze", "RUN", "--no-progress")
    assert code == 0 and out.splitlines() == [
        "analyses written to RUN/metrics and RUN/figures: patterns",
        "skipped membership: no known training split: give --member-corpus"]


def test_not_parquet_at_all_of_the_same_size(damaged, capsys):
    """Not a Parquet file (same size as recorded): refused on read, with the file named."""
    from ffkv.store.run import RunDir

    path = damaged / "metrics" / "census.parquet"
    path.write_bytes(b"x" * path.stat().st_size)
    code, _, err = run(capsys, "report", damaged)
    assert code == 3 and f"{path} is damaged (not a whole Parquet file)" in error_line(err)
    with pytest.raises(DamagedRun, match="census.parquet is damaged"):
        RunDir(damaged).read_metric("census")
