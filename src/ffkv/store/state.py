"""The state of a run as a person should read it (`ffkv status RUN`): live or dead, and what to do.

The manifest's `status` is what the last writer recorded. A writer killed without
warning (kill -9, a crash, a lost machine) leaves `running` behind; the run's lock
tells the two apart, because the kernel drops a dead process's lock: a `running` run
whose lock is free reads `interrupted` here. Where the lock cannot be tried (a
read-only copy of the run), the recorded process is asked on its own host, and on
another host the heartbeat's age is all there is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ffkv.store.integrity import CutOff, Problem, cut_off, survey
from ffkv.store.lock import Holder, probe, read_holder
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

RESUME = "continue it: rerun the command that started it, adding --resume"
#: `ffkv merge` has no --resume: run again, it redoes the merge (which is deterministic) in the same --out.
REMERGE = "finish it: rerun the same `ffkv merge` command (it merges again into the same --out)"


def _again(manifest: Manifest) -> str:
    """What to run to finish an unfinished run: the command that wrote it decides."""
    return REMERGE if manifest.process is not None and manifest.process.command == "merge" else RESUME


@dataclass(frozen=True)
class RunState:
    """A run's state.

    Attributes:
        status: running, interrupted, failed or complete: the recorded status, except that
            a `running` run whose writer is gone is `interrupted`.
        alive: for a running run, whether its writer lives (None: cannot be told from here).
        writer: the process that holds the run's lock now (an index, or an analyze of a complete run).
        manifest: the manifest as recorded.
        problems: of a complete run, its damaged, missing and out-of-date files (`ffkv.store.integrity.survey`).
        cut_off: of a complete run, the `ffkv analyze` that did not finish (None: none, or it still runs).
        verified: the tables were hashed (`run_state(verify=True)`).
        dictionary_verified: the sparse dictionary's files were read again against their hashes too (`ffkv status
            --verify` adds what `ffkv.dictionaries.file_problems` finds to `problems`; this layer cannot read them).
    """

    path: Path
    status: str
    alive: bool | None
    writer: Holder | None
    manifest: Manifest
    problems: list[Problem] = field(default_factory=list)
    cut_off: CutOff | None = None
    verified: bool = False
    dictionary_verified: bool = False

    def lines(self) -> list[str]:
        """What `ffkv status` prints: the state on the first line, then details and what to do."""
        m = self.manifest
        process = m.process.holder().describe() if m.process else "its writer"
        beat = f"last heartbeat {m.process.heartbeat} ({_ago(m.process.heartbeat)})" if m.process else ""
        if m.status == "running" and self.status == "interrupted":
            return [f"{self.path}: interrupted", f"  {process} stopped without saving (killed or crashed); {beat}",
                    f"  {_again(m)}"]
        if self.status == "running":
            live = {True: "alive", False: "not alive", None: "cannot tell from here whether it is alive"}[self.alive]
            return [f"{self.path}: running", f"  written by {process}: {live}; {beat}"]
        if self.status == "failed":
            return [f"{self.path}: failed", f"  error: {m.error or 'not recorded'}", f"  {_again(m)}"]
        if self.status == "interrupted":
            return [f"{self.path}: interrupted", f"  stopped by Ctrl-C at a checkpoint; {beat}".rstrip("; "),
                    f"  {_again(m)}"]
        flags = []
        n_bad = sum(_serious(p) for p in self.problems)
        if n_bad:
            flags.append(f"{n_bad} file{'s' if n_bad > 1 else ''} damaged or missing")
        if self.cut_off is not None:
            flags.append("its last analyze did not finish")
        lines = [f"{self.path}: complete" + (f", but {' and '.join(flags)}" if flags else "")]
        if m.counts:
            lines.append(f"  {m.counts.get('examples', 0):,} examples, {m.counts.get('tokens', 0):,} tokens, "
                         f"top-{m.top_k}, model {m.model.id}")
        done = sorted(name for name, info in m.analyses.items() if not info.get("skipped"))
        if done:
            lines.append(f"  analyses: {', '.join(done)}")
        for name, info in sorted(m.analyses.items()):
            if info.get("skipped"):
                lines.append(f"  skipped: {name}: {info['skipped']}")
        if self.cut_off is not None:
            lines.append(f"  {self.cut_off.line(self.path)}")
        lines += [f"  {p.line(self.path)}" for p in self.problems]
        if self.verified:
            dictionary = ", the sparse dictionary's files" if self.dictionary_verified else ""
            lines.append(f"  verified: every recorded table ({len(m.tables)}), other file ({len(m.files)}){dictionary} "
                         "and explorer lookup file hashed, "
                         + ("all as written" if not any(p.state == "damaged" for p in self.problems)
                            else "see above"))
        if self.writer is not None:
            lines.append(f"  being written now by {self.writer.describe()}")
        return lines

    @property
    def damaged(self) -> bool:
        """Whether `ffkv status` exits 3 (`ffkv.errors.EXIT_CODES`): the run is not whole and no live process is
        making it so: an index or merge that stopped (interrupted, failed, or killed), a file damaged or missing,
        or an analyze cut off. A run being written by a live process is not."""
        if self.status in ("interrupted", "failed"):
            return True
        return self.cut_off is not None or any(_serious(p) for p in self.problems)


def _serious(problem: Problem) -> bool:
    """A file damaged or missing; not one out of date, nor a missing or out-of-date explorer folder (derived data,
    which `ffkv serve` builds again). An explorer file whose bytes differ from its record is damaged: `ffkv serve`
    would read it as it is."""
    if problem.state == "out of date":
        return False
    return problem.state == "damaged" or not problem.path.startswith("explorer")



def _ago(stamp: str) -> str:
    try:
        seconds = time.time() - datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return "time unknown"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(seconds, 0):.0f} s ago"


def run_state(path: str | Path, verify: bool = False) -> RunState:
    """The state of the run at `path` (an `FfkvError` when it is not a readable run); `verify` also hashes
    every recorded table of a complete run (`ffkv status --verify`)."""
    run = RunDir(path)
    manifest = run.manifest()
    held = probe(run.lock_path)
    writer = read_holder(run.lock_path) if held else None
    status, alive = manifest.status, None
    if status == "running":
        if held is None:  # the lock cannot be tried: ask the process itself, where it ran here
            alive = manifest.process.holder().alive() if manifest.process else None
        else:
            alive = held
        if alive is False:
            status = "interrupted"
    if status != "complete":
        return RunState(run.path, status, alive, writer, manifest)
    return RunState(run.path, status, alive, writer, manifest, survey(run, manifest, verify, held),
                    cut_off(run, manifest, held), verify)


__all__ = ["RunState", "run_state"]
