"""The explorer under a crowd: `ffkv serve RUN` in its own process, and --clients clients at once for --seconds.

Each client sends the seeded page mix of `explorer_load.py` (overview, layer, memory, memory JSON, token and
text search, trace) one request after another until the time is up; after a 503 it waits as long as the
answer's ``Retry-After-Ms`` (else ``Retry-After``) says, as a well-behaved client does (``--ignore-retry-after``:
at once). Printed: requests, status codes, time to the first byte (median, p95, max; all answers, and per
status, and per page type), client timeouts and connection errors, the server's resident memory at the start,
at the end and its peak (sampled each second), the CPU time of the server and of the clients, and the load
average at the start and at the end. The goal: no request
waits more than 5 s for its first byte, and the memory stays bounded.

    python benchmarks/explorer_crowd.py [RUN] [--clients 500] [--seconds 60] [--timeout 30]
        [--work DIR]   # without RUN: ffkv-tiny indexed on --lines verses and analysed there (kept, reused)
        [--src PATH]   # serve another checkout's src/ (e.g. to measure before a change)

Only loopback is used: the server listens on 127.0.0.1 and every request goes there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from explorer_load import FFKV, quantile, requests_mix, rss_mib, serving

REPO = Path(__file__).resolve().parent.parent
#: The goal: no request waits longer than this for its first byte.
GOAL_FIRST_BYTE_S = 5.0


def ffkv(args: list[str], env: dict) -> None:
    """Run an `ffkv` command in its own process; its last output lines on failure."""
    done = subprocess.run([sys.executable, *FFKV, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"ffkv {args[0]} failed:\n{(done.stdout + done.stderr)[-2000:]}")


def small_run(work: Path, lines: int, env: dict) -> Path:
    """ffkv-tiny indexed on `lines` training verses and analysed on held-out ones, in work/run (reused)."""
    from ffkv.models.default_corpus import default_corpus_path
    from ffkv.store.run import RunDir

    run = work / "run"
    if (run / "metrics").is_dir() and RunDir(run).manifest().complete:
        return run
    print(f"building a run of ffkv-tiny on {lines} verses in {run} (a few minutes)", flush=True)
    ffkv(["index", "--model", "ffkv-tiny", "--corpus", str(default_corpus_path("train")), "--unit", "line",
          "--max-examples", str(lines), "--out", str(run), "--no-progress"], env)
    ffkv(["analyze", str(run), "--eval-corpus", str(default_corpus_path("heldout")), "--n-eval", str(lines // 3),
          "--no-progress"], env)
    return run


async def crowd(base: str, mix: list[tuple[str, str]], clients: int, seconds: float, timeout: float,
                honour_retry: bool, seed: int) -> list[tuple[str, int, float]]:
    """`clients` clients sending requests of `mix` ((page type, path); each client its own seeded choice) until
    `seconds` have passed; (page type, status, seconds to the first byte) per request; status 0: the client
    timed out, -1: a connection error."""
    seen: list[tuple[str, int, float]] = []

    async def one_after_another(http: httpx.AsyncClient, rng: random.Random) -> None:
        while time.perf_counter() < deadline:
            kind, path = rng.choice(mix)
            start = time.perf_counter()
            try:
                async with http.stream("GET", path) as response:  # returns at the headers
                    first_byte = time.perf_counter() - start
                    await response.aread()
            except httpx.TimeoutException:
                seen.append((kind, 0, time.perf_counter() - start))
                continue
            except httpx.HTTPError:
                seen.append((kind, -1, time.perf_counter() - start))
                await asyncio.sleep(0.1)  # a refused connection: not a busy loop
                continue
            seen.append((kind, response.status_code, first_byte))
            if response.status_code == 503 and honour_retry:
                wait_ms = response.headers.get("retry-after-ms")
                wait = int(wait_ms) / 1000 if wait_ms else float(response.headers.get("retry-after", 1))
                await asyncio.sleep(min(wait, max(0.0, deadline - time.perf_counter())))

    # A client of its own for each (as 500 browsers are): one shared pool of 500 connections costs httpx's
    # client far more CPU per request than the server spends, and the client would measure itself. All made
    # before the clock starts, with one TLS context (unused on http://, but each client would build its own).
    tls = ssl.create_default_context()
    https = [httpx.AsyncClient(base_url=base, timeout=timeout, verify=tls) for _ in range(clients)]
    deadline = time.perf_counter() + seconds
    try:
        await asyncio.gather(*(one_after_another(http, random.Random(seed * 100_003 + i))
                               for i, http in enumerate(https)))
    finally:
        for http in https:
            await http.aclose()
    return seen


async def sample_rss(pid: int, every: float, peak: list[float], stop: asyncio.Event) -> None:
    """Keep the largest resident memory of process `pid` seen, in peak[0], until `stop` is set."""
    while not stop.is_set():
        peak[0] = max(peak[0], rss_mib(pid))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def measured(pid: int, *args) -> tuple[list[tuple[str, int, float]], float]:
    """`crowd(*args)`, and the server's peak resident memory meanwhile (MiB)."""
    peak, stop = [rss_mib(pid)], asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, 1.0, peak, stop))
    try:
        seen = await crowd(*args)
    finally:
        stop.set()
        await sampler
    return seen, peak[0]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far, s (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_bytes(rows: list[tuple[str, int, float]]) -> str:
    """Median, p95 and max of the rows' times to the first byte."""
    times = [t for _, _, t in rows]
    if not times:
        return "none"
    return (f"median {statistics.median(times):.3f} s, p95 {quantile(times, 0.95):.3f} s, "
            f"max {max(times):.3f} s")


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="an analysed run directory (default: one built in --work)")
    parser.add_argument("--clients", type=int, default=500, help="clients at once (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=60, help="how long the crowd lasts (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=30, help="a client's timeout, s (default: %(default)s)")
    parser.add_argument("--ignore-retry-after", action="store_true", help="after a 503, ask again at once")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ffkv-crowd"),
                        help="where the run is built without RUN (default: %(default)s)")
    parser.add_argument("--lines", type=int, default=600, help="verses indexed without RUN (default: %(default)s)")
    parser.add_argument("--src", default=str(REPO / "src"), help="the src/ folder whose ffkv to serve")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.clients <= 5000 or not 0 < args.seconds <= 3600:
        raise SystemExit("--clients must be 1-5000 and --seconds 0-3600")

    sys.path.insert(0, args.src)
    from ffkv.store.run import RunDir

    run = Path(args.run) if args.run else small_run(Path(args.work), args.lines, dict(os.environ, PYTHONPATH=args.src))
    model = RunDir(run).require_complete().model
    mix = requests_mix(1000, model.n_layers, model.d_m, args.seed)
    with serving(run, args.src) as (server, base):
        asyncio.run(crowd(base, mix, 4, 5, args.timeout, True, args.seed + 1))  # warm up: 4 clients, 5 s
        rss_start, load_start = rss_mib(server.pid), os.getloadavg()
        server_cpu, client_cpu = cpu_seconds(server.pid), time.process_time()
        began = time.perf_counter()
        seen, rss_peak = asyncio.run(measured(server.pid, base, mix, args.clients, args.seconds, args.timeout,
                                              not args.ignore_retry_after, args.seed))
        took = time.perf_counter() - began
        rss_end, load_end = rss_mib(server.pid), os.getloadavg()
        server_cpu, client_cpu = cpu_seconds(server.pid) - server_cpu, time.process_time() - client_cpu

    statuses = Counter(status for _, status, _ in seen)
    answered = [row for row in seen if row[1] > 0]
    print(f"\n{args.clients} clients for {args.seconds:.0f} s (all done in {took:.1f} s), src {args.src}, "
          f"{'ignoring' if args.ignore_retry_after else 'honouring'} Retry-After")
    print(f"  requests: {len(seen)} ({len(answered) / took:.1f} answers/s)")
    print("  status codes: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()) if s > 0))
    print(f"  client timeouts ({args.timeout:.0f} s): {statuses[0]}, connection errors: {statuses[-1]}")
    print(f"  first byte, all answers: {first_bytes(answered)}")
    for status in sorted(s for s in statuses if s > 0):
        print(f"  first byte, {status}: {first_bytes([row for row in answered if row[1] == status])}")
    for kind in sorted({kind for kind, _, _ in answered}):
        rows = [row for row in answered if row[0] == kind]
        print(f"    {kind:<13} {len(rows):>5} answers, {sum(row[1] == 503 for row in rows):>5} of them 503; "
              f"first byte of the 200s: {first_bytes([row for row in rows if row[1] == 200])}")
    slowest = max((t for _, _, t in seen), default=0.0)
    print(f"  server RSS: {rss_start:.0f} MiB at the start, {rss_end:.0f} at the end, peak {rss_peak:.0f}")
    print(f"  CPU time (2 cores shared): server {server_cpu:.0f} s, these clients {client_cpu:.0f} s, in {took:.0f} s")
    print(f"  load average (1, 5, 15 min): start {', '.join(f'{x:.2f}' for x in load_start)}; "
          f"end {', '.join(f'{x:.2f}' for x in load_end)}")
    met = slowest <= GOAL_FIRST_BYTE_S and not statuses[0]
    print(f"  goal (no first byte later than {GOAL_FIRST_BYTE_S:.0f} s, no timeout): "
          f"{'met' if met else 'NOT met'} (slowest {slowest:.2f} s)")


if __name__ == "__main__":
    main()
