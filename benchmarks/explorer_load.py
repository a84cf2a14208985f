"""Explorer under load: `ffkv serve RUN` in its own process, and an asyncio client at several concurrencies.

For each concurrency (default 1, 8 and 50 clients) the client sends the same seeded mix of page types
(overview, layer, memory, memory JSON, token search, text search, trace) for a fixed number of requests
and prints, per page type, the throughput, p50 and p99 latency, and any 5xx. Then the server's resident
memory is compared before and after a soak of `--soak` requests (the goal: under 10% growth), and the
throughput at 8 clients over that at 1 is printed (the goal: at least 1.5).

    python benchmarks/explorer_load.py runs/demo [--requests 600] [--concurrency 1 8 50] [--soak 5000]
        [--src PATH]   # serve another checkout's src/ (e.g. to measure before a change)

Only loopback is used: the server listens on 127.0.0.1 and every request goes there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ("In the beginning God created", "And the LORD spake unto Moses, saying", "Blessed are the poor",
           "For God so loved the world", "The LORD is my shepherd")
WORDS = ("God", "LORD", "land", "king", "water", "house", "children", "heaven")
TOKENS = (" the", " of", " and", " God", " LORD", " unto")
#: `python` arguments that run the `ffkv` command line (of the src/ on PYTHONPATH).
FFKV = ["-c", "import sys; from ffkv.cli import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@contextmanager
def serving(run: str | Path, src: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`ffkv serve RUN` of the ffkv in `src` on a free loopback port, up and its model loaded (a first trace
    waits for it); (the server's process, its base URL). Stopped on leaving."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a full pipe would stop the server
        server = subprocess.Popen([sys.executable, *FFKV, "serve", str(run), "--port", str(port)],
                                  env=dict(os.environ, PYTHONPATH=src), stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.time() + 300
            while True:
                try:
                    if httpx.get(base + "/trace", params={"prompt": "In"}, timeout=300).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline or server.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"the server did not start: {log.read().decode()[-2000:]}")
                time.sleep(0.2)
            yield server, base
        finally:
            server.terminate()
            server.wait(timeout=30)


def requests_mix(n: int, n_layers: int, d_m: int, seed: int) -> list[tuple[str, str]]:
    """(page type, path) for n requests, seeded; traces are a tenth of the mix, as a reader's session."""
    rng = random.Random(seed)
    kinds = ["overview", "layer", "memory", "memory_json", "memory", "search_token", "search_text", "memory",
             "layer", "trace"]
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        layer, key = rng.randrange(1, n_layers + 1), rng.randrange(d_m)
        path = {"overview": "/",
                "layer": f"/layer/{layer}?page={rng.randrange(1, 4)}&sort=key",
                "memory": f"/memory/{layer}/{key}",
                "memory_json": f"/memory/{layer}/{key}.json",
                "search_token": "/search?" + httpx.QueryParams({"token": rng.choice(TOKENS)}).__str__(),
                "search_text": "/search?" + httpx.QueryParams({"q": rng.choice(WORDS)}).__str__(),
                "trace": "/trace?" + httpx.QueryParams({"prompt": rng.choice(PROMPTS)}).__str__()}[kind]
        out.append((kind, path))
    return out


async def drive(base: str, mix: list[tuple[str, str]], concurrency: int) -> tuple[float, dict]:
    """Send `mix` with `concurrency` clients; (seconds, {kind: [(status, seconds)]})."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in mix:
        queue.put_nowait(item)
    seen: dict[str, list[tuple[int, float]]] = defaultdict(list)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                kind, path = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t = time.perf_counter()
            try:
                status = (await client.get(path)).status_code
            except httpx.HTTPError:
                status = 599
            seen[kind].append((status, time.perf_counter() - t))

    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - start, seen


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(concurrency: int, seconds: float, seen: dict) -> float:
    total = sum(len(v) for v in seen.values())
    print(f"\nconcurrency {concurrency}: {total} requests in {seconds:.1f} s, {total / seconds:.1f} req/s")
    print(f"  {'page':<13} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'5xx':>5} {'other non-2xx':>14}")
    for kind in sorted(seen):
        rows = seen[kind]
        times = [t * 1000 for _, t in rows]
        errors = sum(s >= 500 for s, _ in rows)
        other = sum(not 200 <= s < 300 and s < 500 for s, _ in rows)
        print(f"  {kind:<13} {len(rows):>5} {statistics.median(times):>8.0f} {quantile(times, 0.99):>8.0f} "
              f"{errors:>5} {other:>14}")
    return total / seconds


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # each level's table as soon as it is measured
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="an analysed run directory (e.g. runs/demo, from `ffkv demo`)")
    parser.add_argument("--requests", type=int, default=600, help="requests per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 50])
    parser.add_argument("--soak", type=int, default=5000, help="requests of the memory-growth soak (0: none)")
    parser.add_argument("--src", default=str(REPO / "src"), help="the src/ folder whose ffkv to serve")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    sys.path.insert(0, args.src)
    from ffkv.store.run import RunDir

    model = RunDir(args.run).require_complete().model
    with serving(args.run, args.src) as (server, base):
        asyncio.run(drive(base, requests_mix(60, model.n_layers, model.d_m, args.seed + 99), 4))  # warm up
        rates = {}
        for c in args.concurrency:
            # Another seed per level: the explorer keeps recent memories, so a repeated mix would flatter later levels.
            seconds, seen = asyncio.run(drive(base, requests_mix(args.requests, model.n_layers, model.d_m,
                                                                 args.seed + 1000 * c), c))
            rates[c] = report(c, seconds, seen)
        if 1 in rates and 8 in rates:
            print(f"\nthroughput at 8 clients / at 1: {rates[8] / rates[1]:.2f} (goal >= 1.5)")
        if args.soak:
            before = rss_mib(server.pid)
            seconds, seen = asyncio.run(drive(base, requests_mix(args.soak, model.n_layers, model.d_m,
                                                                 args.seed + 1), 8))
            after = rss_mib(server.pid)
            errors = sum(s >= 500 for rows in seen.values() for s, _ in rows)
            print(f"\nsoak: {args.soak} requests at 8 clients in {seconds:.0f} s, {errors} 5xx; server memory "
                  f"{before:.0f} -> {after:.0f} MiB ({100 * (after - before) / before:+.1f}%, goal < 10%)")


if __name__ == "__main__":
    main()
