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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ffkv.store.lock import Holder, probe, read_holder
from ffkv.store.manifest import Manifest
from ffkv.store.run import RunDir

RESUME = "continue it: rerun the command that started it, adding --resume"


@dataclass(frozen=True)
class RunState:
    """A run's state.

    Attributes:
        status: running, interrupted, failed or complete: the recorded status, except that
            a `running` run whose writer is gone is `interrupted`.
        alive: for a running run, whether its writer lives (None: cannot be told from here).
        writer: the process that holds the run's lock now (an index, or an analyze of a complete run).
        manifest: the manifest as recorded.
    """

    path: Path
    status: str
    alive: bool | None
    writer: Holder | None
    manifest: Manifest

    def lines(self) -> list[str]:
        """What `ffkv status` prints: the state on the first line, then details and what to do."""
        m = self.manifest
        process = m.process.holder().describe() if m.process else "its writer"
        beat = f"last heartbeat {m.process.heartbeat} ({_ago(m.process.heartbeat)})" if m.process else ""
        if m.status == "running" and self.status == "interrupted":
            return [f"{self.path}: interrupted", f"  {process} stopped without saving (killed or crashed); {beat}",
                    f"  {RESUME}"]
        if self.status == "running":
            live = {True: "alive", False: "not alive", None: "cannot tell from here whether it is alive"}[self.alive]
            return [f"{self.path}: running", f"  written by {process}: {live}; {beat}"]
        if self.status == "failed":
            return [f"{self.path}: failed", f"  error: {m.error or 'not recorded'}", f"  {RESUME}"]
        if self.status == "interrupted":
            return [f"{self.path}: interrupted", f"  stopped by Ctrl-C at a checkpoint; {beat}".rstrip("; "),
                    f"  {RESUME}"]
        lines = [f"{self.path}: complete"]
        if m.counts:
            lines.append(f"  {m.counts.get('examples', 0):,} examples, {m.counts.get('tokens', 0):,} tokens, "
                         f"top-{m.top_k}, model {m.model.id}")
        if m.analyses:
            lines.append(f"  analyses: {', '.join(sorted(m.analyses))}")
        if self.writer is not None:
            lines.append(f"  being written now by {self.writer.describe()}")
        return lines


def _ago(stamp: str) -> str:
    try:
        seconds = time.time() - datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return "time unknown"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(seconds, 0):.0f} s ago"


def run_state(path: str | Path) -> RunState:
    """The state of the run at `path` (an `FfkvError` when it is not a readable run)."""
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
    return RunState(run.path, status, alive, writer, manifest)


__all__ = ["RunState", "run_state"]
