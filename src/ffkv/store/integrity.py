"""Whether a run's files are still the ones written: recorded at each write, checked before each read.

Every Parquet table of a run (``examples``, ``trigger_examples``, ``metrics/NAME``) is recorded in
manifest.json's ``tables`` when it is written (`describe`): its size in bytes, its rows, its columns
(name and Arrow type), the SHA-256 of its bytes, and the step that wrote it (``index``, ``merge``, or
the `ffkv analyze` experiment). Before a table is read, `problem` compares it with that record: the
size, the Parquet footer, the rows, the columns, and for a metrics table the name it carries in its
own metadata (a table copied over another is caught even without a record). That is a stat and a
footer read; ``verify=True`` (`ffkv status --verify`) also hashes the bytes. A table of a run written
before the records existed is checked against what its reader expects.

Every other file is recorded by `describe_file` (size, SHA-256, step) and checked by `file_problem`:
the figures and the translators in manifest.json's ``files`` (`file_problems`: figures are small and
always hashed, so a report never embeds another figure's image; the others by size, hashed under
``verify``), the explorer's lookup files in explorer/info.json (`ffkv.store.lookups`: sizes on every
start, hashes under ``verify``). The human labels, which the explorer saves without the run's
lock, are checked by their content instead (`ffkv.store.annotations.label_problem`).

`survey` lists what `ffkv status` and the report name: damaged, missing and out-of-date tables,
figures, labels and the explorer's lookup files, and an `ffkv analyze` that was cut off.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from ffkv.store.manifest import Manifest
    from ffkv.store.run import RunDir

#: The index's tables (relative paths): they cannot be rewritten in place.
INDEX_TABLES = ("examples.parquet", "trigger_examples.parquet")
#: Metrics tables written by `ffkv analyze` itself at the end of every call, not by one experiment.
EVERY_ANALYZE = ("fidelity", "encoder_applicability", "latent_applicability")
#: Key of a metrics table's schema metadata that holds how it was computed (JSON, with its ``name``).
DESCRIPTION_KEY = b"ffkv"
_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        while piece := handle.read(_CHUNK):
            h.update(piece)
    return h.hexdigest()


def columns_of(schema: pa.Schema) -> dict[str, str]:
    """A schema's columns as ``{name: Arrow type}``, in order (its metadata left out)."""
    return {field.name: _type(field.type) for field in schema}


def _type(kind: pa.DataType) -> str:
    """An Arrow type as text, a list's item field unnamed (Parquet names it ``element``, Arrow ``item``)."""
    return str(kind).replace("<element: ", "<item: ")


def describe_file(path: str | Path, step: str) -> dict[str, Any]:
    """The record of any file just written: its size, the sha256 of its bytes, and `step` (what writes it)."""
    path = Path(path)
    return {"size": path.stat().st_size, "sha256": sha256_file(path), "step": step}


def describe(path: str | Path, step: str) -> dict[str, Any]:
    """The record of a table just written: `describe_file`'s, with its rows and columns."""
    meta = pq.read_metadata(path)
    record = describe_file(path, step)
    return {"size": record["size"], "rows": meta.num_rows, "columns": columns_of(meta.schema.to_arrow_schema()),
            "sha256": record["sha256"], "step": step}


@dataclass(frozen=True)
class Problem:
    """What is wrong with one file of a run, and the command that makes it right.

    Attributes:
        path: the file, relative to the run (``metrics/values.parquet``).
        state: ``missing``, ``damaged`` or ``out of date``.
        why: what was found (empty for a missing file).
        fix: what to run, in words with the command.
    """

    path: str
    state: str
    why: str
    fix: str

    def line(self, run: str | Path) -> str:
        """The problem as one line: the file (under `run`), its state, what was found, and the fix."""
        why = f" ({self.why})" if self.why else ""
        return f"{Path(run) / self.path} is {self.state}{why}: {self.fix}"


#: Tables written by a command of their own rather than an `ffkv analyze` step: step -> that command, whose
#: language model the user names again.
TOOL_STEPS = {"explain": "ffkv explain {run} --explainer BACKEND", "score": "ffkv score {run} --simulator BACKEND"}
#: Steps that write the index's tables (``control_*`` included): `ffkv index`, and `ffkv merge` of its shards.
INDEX_STEPS = ("index", "merge")


def rewrite_command(run: str | Path, rel: str, step: str | None) -> str:
    """How a table (or another file) of the run is written again: by its `ffkv analyze` step or its command, or
    (a table of the index: its two tables and the random-key control's) not in place."""
    from ffkv.store.schemas import INDEX_EXPECTED

    if rel in INDEX_EXPECTED or step in INDEX_STEPS:
        return ("the index cannot be rewritten in place: index the corpus again into a new folder "
                f"(`ffkv index`, with the options in {Path(run) / 'manifest.json'})")
    if step in TOOL_STEPS:
        return (f"rewrite it with `{TOOL_STEPS[step].format(run=run)}` and the memories and options it was run with "
                "(a language model may answer otherwise than before)")
    if step is None or step in EVERY_ANALYZE:
        return f"rewrite it with `ffkv analyze {run} --only lookups` (it is written at the end of every analyze)"
    return f"rewrite it with `ffkv analyze {run} --only {step}`"


def redraw_command(run: str | Path, step: str) -> str:
    """How a figure of the run is drawn again: by the `ffkv analyze` step that drew it."""
    return f"draw it again with `ffkv analyze {run} --only {step}`"


def step_of(manifest: Manifest, rel: str) -> str | None:
    """The step that writes the table `rel`: its record's (``index``, ``merge``, an `ffkv analyze` experiment);
    for a metrics table (``metrics/NAME.parquet``) without one, the experiment whose manifest entry lists it,
    else the longest experiment name it starts with."""
    record = manifest.tables.get(rel)
    if record and record.get("step"):
        return str(record["step"])
    if not rel.startswith("metrics/"):
        return None
    name = Path(rel).stem
    for experiment, info in manifest.analyses.items():
        if name in (info.get("tables") or ()):
            return experiment
    return owner_of(manifest, name)


def owner_of(manifest: Manifest, name: str) -> str | None:
    """The experiment whose name a table's or figure's `name` carries (NAME or NAME_*, the longest such among the
    run's analyses), or None."""
    for experiment in sorted(manifest.analyses, key=len, reverse=True):
        if name == experiment or name.startswith(experiment + "_"):
            return experiment
    return None


def problem(root: str | Path, rel: str, record: Mapping[str, Any] | None, fix: str,
            expected: pa.Schema | None = None, verify: bool = False) -> Problem | None:
    """What is wrong with the table `rel` of the run at `root`, or None when it reads as written.

    Args:
        record: the table's record in the manifest (None: a run written before records, or a table
            never recorded); without it the file is checked against `expected` and its own name only.
        fix: the command that rewrites it (`rewrite_command`), for the problem's line.
        expected: the columns its reader needs (a schema; extra columns are allowed).
        verify: also hash the bytes and compare them with the record.
    """
    path = Path(root) / rel
    found = file_problem(root, rel, record, fix)  # missing, or another size
    if found is not None:
        return found

    def damaged(why: str) -> Problem:
        return Problem(rel, "damaged", why, fix)

    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError, ValueError):
        return damaged("not a whole Parquet file")
    columns = columns_of(schema)
    name = Path(rel).stem
    own = _own_name(schema)
    if rel.startswith("metrics/") and own is not None and own != name:
        return damaged(f"it holds the table {own!r}, not {name!r}")
    if record is not None:
        if columns != record.get("columns"):
            return damaged("its columns are not those written: " + _difference(record.get("columns") or {}, columns))
        if meta.num_rows != record.get("rows"):
            return damaged(f"{meta.num_rows:,} rows; {int(record.get('rows', 0)):,} when it was written")
    if expected is not None:
        lacking = [f.name for f in expected if columns.get(f.name) != _type(f.type)]
        if lacking:
            return damaged(f"it lacks the column(s) {', '.join(lacking)} of type "
                           f"{', '.join(str(expected.field(n).type) for n in lacking)}")
    return file_problem(root, rel, record, fix, verify=True) if verify else None


def file_problem(root: str | Path, rel: str, record: Mapping[str, Any] | None, fix: str,
                 verify: bool = False) -> Problem | None:
    """What is wrong with the file `rel` of the run at `root` against its record (`describe_file`), or None when
    it reads as written: missing, another size, or (`verify`) other bytes. Without a record only its presence is
    checked."""
    path = Path(root) / rel
    if not path.is_file():
        return Problem(rel, "missing", "", fix)
    if record is None:
        return None
    size = path.stat().st_size
    if size != record.get("size"):
        return Problem(rel, "damaged", f"{size:,} bytes; {int(record.get('size') or 0):,} when it was written", fix)
    if verify and record.get("sha256") and sha256_file(path) != record["sha256"]:
        return Problem(rel, "damaged", "its bytes differ from those written (SHA-256)", fix)
    return None


def _own_name(schema: pa.Schema) -> str | None:
    raw = (schema.metadata or {}).get(DESCRIPTION_KEY)
    if raw is None:
        return None
    try:
        value = json.loads(raw).get("name")
    except (ValueError, AttributeError):
        return None
    return str(value) if value is not None else None


def _difference(written: Mapping[str, str], found: Mapping[str, str]) -> str:
    gone = [c for c in written if c not in found]
    new = [c for c in found if c not in written]
    changed = [c for c in written if c in found and written[c] != found[c]]
    parts = [f"{label} {', '.join(cols[:4])}{'...' if len(cols) > 4 else ''}"
             for label, cols in (("without", gone), ("with", new), ("other types of", changed)) if cols]
    return "; ".join(parts) or "in another order"


# ---------------------------------------------------------------------------------------- the whole run
@dataclass(frozen=True)
class CutOff:
    """An `ffkv analyze` that did not finish: how it stopped, the steps it ran and those it did not."""

    how: str
    steps: list[str]
    done: list[str]
    error: str | None

    @property
    def not_done(self) -> list[str]:
        return [s for s in self.steps if s not in self.done]

    def line(self, run: str | Path) -> str:
        how = {"interrupted": "was interrupted (Ctrl-C)", "failed": f"failed ({self.error or 'error not recorded'})",
               "running": "was cut off (killed or crashed)"}[self.how]
        if not self.not_done:
            return (f"the last `ffkv analyze` {how} after its last step, before the fidelity table: rerun "
                    f"`ffkv analyze {run} --only lookups`")
        done = f"{len(self.done)} of {len(self.steps)} steps done ({', '.join(self.done)})" if self.done \
            else f"none of its {len(self.steps)} steps done"
        return (f"the last `ffkv analyze` {how}: {done}; the tables of the others are from an earlier analyze or "
                f"missing: rerun `ffkv analyze {run} --only {','.join(self.not_done)}`")


def cut_off(run: RunDir, manifest: Manifest, writer_alive: bool | None = None) -> CutOff | None:
    """The analyze that stopped before its end (`Manifest.analyzing`), or None: none did, or it still runs
    (`writer_alive`: whether the run's lock is held now; None: cannot be told, then its process is asked)."""
    info = manifest.analyzing
    if not info:
        return None
    how = str(info.get("status", "running"))
    if how == "running":
        alive = writer_alive
        if alive is None:
            from ffkv.store.lock import Holder

            process = info.get("process") or {}
            try:
                alive = Holder(int(process["pid"]), str(process["host"]), "analyze", str(process["started"])).alive()
            except (KeyError, TypeError, ValueError):
                alive = None
        if alive is not False:
            return None
    return CutOff(how, [str(s) for s in info.get("steps", [])], [str(s) for s in info.get("done", [])],
                  info.get("error"))


def survey(run: RunDir, manifest: Manifest, verify: bool = False, writer_alive: bool | None = None) -> list[Problem]:
    """Every problem of a complete run: its tables (recorded, or listed by the analyses that wrote them),
    its figures (recorded ones always hashed: they are small), its human labels, the explorer's lookup files
    (hashed too with `verify`), and tables left from before an analyze that was cut off."""
    from ffkv.store import annotations, lookups
    from ffkv.store.schemas import INDEX_EXPECTED

    found: list[Problem] = []
    listed: dict[str, str | None] = {rel: None for rel in INDEX_TABLES}
    for experiment, info in manifest.analyses.items():
        for name in info.get("tables") or ():
            if "." not in str(name):  # not the explorer's files that `lookups` lists (explorer/, below)
                listed.setdefault(f"metrics/{name}.parquet", experiment)
    for rel in manifest.tables:
        listed.setdefault(rel, None)
    for rel in listed:
        issue = problem(run.path, rel, manifest.tables.get(rel), rewrite_command(run.path, rel, step_of(manifest, rel)),
                        INDEX_EXPECTED.get(rel), verify)
        if issue is not None:
            found.append(issue)
    found += file_problems(run, manifest, verify)
    for source in ("neurons", "latents"):
        labels = annotations.label_problem(run, manifest, source)
        if labels is not None:
            found.append(labels)
    stopped = cut_off(run, manifest, writer_alive)
    if stopped is not None:
        bad = {p.path for p in found}
        for rel in manifest.tables:
            step = step_of(manifest, rel)
            if rel in bad or not rel.startswith("metrics/") or not (run.path / rel).is_file():
                continue
            if step in stopped.not_done or (step in EVERY_ANALYZE and stopped.done):
                found.append(Problem(rel, "out of date", "from an analyze before the one that was cut off",
                                     rewrite_command(run.path, rel, step if step not in EVERY_ANALYZE else None)))
    if "lookups" in manifest.analyses and not manifest.analyses["lookups"].get("skipped"):
        if lookups.find(run, manifest) is None:
            state = "missing" if not run.cache_dir.is_dir() else "out of date"
            found.append(Problem("explorer/", state, "the explorer's lookup tables",
                                 f"rebuild them with `ffkv analyze {run.path} --only lookups` (or let `ffkv serve` "
                                 "build them)"))
        elif verify:
            found += lookups.verify(run)
    return found


def file_problems(run: RunDir, manifest: Manifest, verify: bool = False, only: str | None = None) -> list[Problem]:
    """The files of a run other than its tables that are not as written: each recorded one (manifest.json's
    ``files``) against its size, and its SHA-256 for a figure (figures are small, and one swapped with another of
    the same size must not pass) or under `verify`; for a figure an analysis lists without a record (a run drawn
    before the records), only whether it exists. Each problem names the command that writes the file again.
    `only`: check that one file (its path in the run) alone."""
    found: list[Problem] = []
    for experiment, info in manifest.analyses.items() if only is None else ():
        for name in info.get("figures") or ():
            name = str(name)
            files = [run.figures_dir / name] if Path(name).suffix in (".png", ".svg") else \
                [run.figure_path(name, fmt) for fmt in ("png", "svg")]
            if any(f"figures/{f.name}" in manifest.files for f in files):
                continue  # checked against its record, below
            if not any(f.is_file() for f in files):
                found.append(Problem(f"figures/{files[0].name}", "missing", "", redraw_command(run.path, experiment)))
    for rel, record in manifest.files.items():
        if only is not None and rel != only:
            continue
        step = str(record.get("step") or Path(rel).stem)
        figure = rel.startswith("figures/")
        fix = redraw_command(run.path, step) if figure else rewrite_command(run.path, rel, step)
        issue = file_problem(run.path, rel, record, fix, verify=figure or verify)
        if issue is not None:
            found.append(issue)
    # A figure file of an experiment whose figures are recorded, yet without a record of its own, was not drawn
    # by it (its own stale figures are removed with their records): the report must not show it as the run's.
    drew = {str(record.get("step")) for rel, record in manifest.files.items() if rel.startswith("figures/")}
    for path in sorted(run.figures_dir.glob("*")) if drew and only is None and run.figures_dir.is_dir() else ():
        rel = f"figures/{path.name}"
        owner = owner_of(manifest, path.stem)
        if path.suffix in (".png", ".svg") and rel not in manifest.files and owner in drew:
            found.append(Problem(rel, "damaged", f"`ffkv analyze --only {owner}` did not draw it: it is not in the "
                                                 "run's record", "move it out of the run's figures folder"))
    return found


__all__ = ["CutOff", "EVERY_ANALYZE", "INDEX_STEPS", "INDEX_TABLES", "Problem", "columns_of", "cut_off", "describe",
           "describe_file", "file_problem", "file_problems", "owner_of", "problem", "redraw_command",
           "rewrite_command", "sha256_file", "step_of", "survey"]
