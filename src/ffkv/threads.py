"""How many CPU threads the ``ffkv`` command's native work runs on: chosen once per command, for the machine it finds.

torch, and the BLAS, OpenMP, Arrow and Rust (tokenizers) pools beside it, start one thread per core, and each
parallel operation waits for its slowest thread. On a machine that other work already keeps busy (a laptop, a shared
node) those threads queue behind it, and a thread per core is slower than one: `benchmarks/threads_under_load.py`
measures it. `choose` picks the count from, in order:

1. the command's ``--threads N``;
2. the environment variable ``FFKV_THREADS``;
3. a count the user fixed for the pools themselves (``OMP_NUM_THREADS``): left as it is;
4. the cores this process may run on, less the work already running on them (`busy_cores`: the processes
   runnable now, read over a tenth of a second before ffkv starts its own), and at least one.

`apply` sizes every pool to the count (through the variables they read when they start, and torch's own setter
where torch has started). The count never changes a result beyond the last bits of a parallel reduction's
rounding; a run records the count it ran with (manifest.json: ``index.threads``; each analysis's ``threads``), a
resumed index runs with its recorded count again, and a rerun with ``--threads`` of that count gives the same bytes.

Only the ``ffkv`` command chooses: the library (`ffkv.index`, `ffkv.analyze` in a notebook) leaves torch's threads
as its caller set them.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

#: The environment variable that fixes ffkv's thread count (as ``--threads`` does).
ENV = "FFKV_THREADS"
#: The variables each pool reads when it starts: OpenMP (torch's intra-op pool, Arrow's CPU pool), MKL, OpenBLAS
#: (NumPy), Rayon (Hugging Face tokenizers).
POOL_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
#: How long `busy_cores` watches the machine, and how often it looks.
SAMPLE_SECONDS, SAMPLE_EVERY = 0.1, 0.005


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count ffkv runs with, and why (``--threads``, ``FFKV_THREADS``, ``OMP_NUM_THREADS``, or the
    machine's cores and the work found on them)."""

    threads: int
    why: str


def cores() -> int:
    """The cores this process may run on (its CPU affinity, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """The cores other work keeps busy now: the mean number of runnable threads of the whole machine over
    `seconds` (Linux: ``procs_running`` of /proc/stat, this process's own reading thread left out), else the
    1-minute load average (0 where the system gives none).

    A load average lags by a minute: read right after another ffkv command ends, it would still count that
    command's work. The runnable count is what competes for the cores at this moment."""
    readings: list[int] = []
    deadline = time.monotonic() + seconds
    while True:
        running = _procs_running()
        if running is None:
            break
        readings.append(max(0, running - 1))
        if time.monotonic() >= deadline:
            break
        time.sleep(SAMPLE_EVERY)
    if readings:
        return sum(readings) / len(readings)
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _procs_running() -> int | None:
    try:
        with open("/proc/stat", "rb") as stat:
            for line in stat:
                if line.startswith(b"procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def parse_count(text: str | int, where: str) -> int:
    """A thread count as given (`where`: ``--threads`` or ``FFKV_THREADS``): a whole number of at least 1."""
    value = str(text).strip()
    if not (value.isascii() and value.isdigit()) or len(value) > 4 or int(value) < 1:
        from ffkv.errors import FfkvError

        raise FfkvError(f"{where} must be a whole number of threads from 1 to 9999, got {str(text)[:20]!r}")
    return int(value)


def choose(requested: int | None = None, *, environ: Mapping[str, str] = os.environ,
           available: Callable[[], int] = cores, busy: Callable[[], float] = busy_cores) -> ThreadChoice:
    """The thread count for this command (the module's docstring gives the order); `environ`, `available` and
    `busy` are the machine's, replaceable in tests."""
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    if environ.get(ENV, "").strip():
        return ThreadChoice(parse_count(environ[ENV], ENV), ENV)
    fixed = environ.get("OMP_NUM_THREADS", "").strip()
    if fixed.isascii() and fixed.isdigit() and int(fixed) >= 1:
        return ThreadChoice(int(fixed), "OMP_NUM_THREADS")
    n, others = available(), busy()
    free = max(1, min(n, math.floor(n - others + 0.5)))
    if free == n:
        return ThreadChoice(n, f"{n} core{'s' * (n != 1)}, idle")
    return ThreadChoice(free, f"{n} cores, {others:.1f} of them busy with other work")


def apply(choice: ThreadChoice, environ: dict[str, str] | None = None) -> Callable[[], None]:
    """Size every pool to `choice.threads`: the variables of the pools not started yet (`POOL_VARIABLES`, each
    unless the user set it), and torch's intra-op threads where torch has started. Returns what undoes it
    (the command line undoes nothing; a caller in the same process, a test, does)."""
    environ = os.environ if environ is None else environ
    saved = {name: environ.get(name) for name in POOL_VARIABLES}
    for name in POOL_VARIABLES:
        if choice.why != "OMP_NUM_THREADS" or name not in environ:
            environ[name] = str(choice.threads)
    torch = sys.modules.get("torch")
    previous = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(choice.threads)

    def undo() -> None:
        for name, value in saved.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        if previous is not None:
            torch.set_num_threads(previous)

    return undo


def current() -> int:
    """The thread count work in this process runs with (torch's intra-op threads), for the pools that take a count
    of their own (DuckDB) and for the run's record."""
    import torch

    return torch.get_num_threads()


@contextmanager
def running_with(count: int | None) -> Iterator[int]:
    """torch's intra-op threads at `count` for the block (None: as they are); yields the count the block runs with.
    A resumed index runs with the count its first part ran with, so that it ends with the same bytes."""
    import torch

    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield previous
        return
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(previous)


__all__ = ["ENV", "POOL_VARIABLES", "ThreadChoice", "apply", "busy_cores", "choose", "cores", "current",
           "parse_count", "running_with"]
