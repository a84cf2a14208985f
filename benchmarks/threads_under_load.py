"""The `ffkv` command's thread choice (`ffkv.threads`) on an idle and on a busy machine, side by side.

Three ways to run the same commands, each in a fresh process:

- ``chosen``: as `ffkv` runs them now (the count chosen for the machine found);
- ``one``: ``OMP_NUM_THREADS=1`` (what a user on a shared node is told to set);
- ``all``: one thread per core, whatever the load (torch's default: ``FFKV_THREADS`` set to the core count).

Each is timed idle and under a synthetic load: `--burners` processes spinning on the same cores (bounded: they stop
when the measurement ends). The rounds interleave the three ways, so that drift hits them alike; the medians and the
spread (min-max) of the wall times are printed, with the load average.

What is timed: `ffkv index` of `--verses` verses of ffkv-tiny's corpus, and a cold memory page of `ffkv serve` on
that run (the first view of a memory runs the model over its trigger examples); with `--demo`, also the whole
`ffkv demo` (minutes each: one round of it, whatever `--rounds` says).

    python benchmarks/threads_under_load.py --rounds 3 --burners 6 [--demo]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

WAYS = ("chosen", "one", "all")


def _env(way: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FFKV_THREADS", "MKL_NUM_THREADS")}
    if way == "one":
        env["OMP_NUM_THREADS"] = "1"
    elif way == "all":
        env["FFKV_THREADS"] = str(len(os.sched_getaffinity(0)))
    return env


def _ffkv() -> list[str]:
    return [sys.executable, "-m", "ffkv.cli"]


def time_index(way: str, corpus: str, verses: int, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([*_ffkv(), "index", "--model", "ffkv-tiny", "--corpus", corpus, "--unit", "line", "--max-examples",
                    str(verses), "--top-k", "20", "--out", str(out), "--no-progress"], env=_env(way), check=True,
                   capture_output=True)
    return time.perf_counter() - start


def time_demo(way: str, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([*_ffkv(), "demo", "--out", str(out), "--no-progress"], env=_env(way), check=True,
                   capture_output=True)
    return time.perf_counter() - start


def time_cold_page(way: str, run: Path) -> float:
    server = subprocess.Popen([*_ffkv(), "serve", str(run), "--port", "0"], env=_env(way), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        while url is None:
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("ffkv serve did not start")
            found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
            url = found.group(1) if found else None
        urllib.request.urlopen(url, timeout=600).read()  # the overview: the model loads meanwhile
        urllib.request.urlopen(url + "memory/1/0", timeout=600).read()  # waits for the model
        start = time.perf_counter()
        urllib.request.urlopen(url + "memory/4/17", timeout=600).read()  # a memory not viewed yet
        return time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burners", type=int, default=6, help="spinning processes under load (default: 6)")
    parser.add_argument("--verses", type=int, default=600)
    parser.add_argument("--demo", action="store_true", help="also time `ffkv demo`, once per way")
    args = parser.parse_args()
    from ffkv.models.default_corpus import default_corpus_path

    corpus = str(default_corpus_path("train"))
    work = Path(tempfile.mkdtemp(prefix="ffkv-threads-"))
    try:
        time_index("chosen", corpus, args.verses, work / "run")  # the run the pages read, and a warm cache
        for loaded in (False, True):
            stop = multiprocessing.Event()
            burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True)
                       for _ in range(args.burners if loaded else 0)]
            for b in burners:
                b.start()
            time.sleep(5 if loaded else 0)
            times: dict[tuple[str, str], list[float]] = {}
            loads = []
            try:
                for round_ in range(args.rounds):
                    for way in WAYS:
                        loads.append(os.getloadavg()[0])
                        times.setdefault(("index", way), []).append(time_index(way, corpus, args.verses, work / way))
                        times.setdefault(("page", way), []).append(time_cold_page(way, work / "run"))
                        if args.demo and round_ == 0:
                            times.setdefault(("demo", way), []).append(time_demo(way, work / f"demo_{way}"))
            finally:
                stop.set()
                for b in burners:
                    b.join(timeout=10)
            state = f"under load ({args.burners} spinning processes)" if loaded else "idle"
            print(f"\n{state}, {len(os.sched_getaffinity(0))} cores, load average {min(loads):.1f}-{max(loads):.1f}")
            for what in ("index", "page", *(("demo",) if args.demo else ())):
                med = {way: statistics.median(times[(what, way)]) for way in WAYS}
                cells = "  ".join(f"{way} {med[way]:7.2f} s ({min(times[(what, way)]):.2f}-{max(times[(what, way)]):.2f})"
                                  for way in WAYS)
                print(f"  {what:5}  {cells}  chosen/one {med['chosen'] / med['one']:.2f}  "
                      f"chosen/all {med['chosen'] / med['all']:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
