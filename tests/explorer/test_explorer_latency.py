"""A memory page answers in well under a second on a large run (a smaller cut of the benchmark's)."""

from __future__ import annotations

import statistics
import time

from starlette.testclient import TestClient

from explorer_latency import Stub, write_lookups, write_run
from ffkv.explorer import create_app


def test_memory_page_latency(tmp_path):
    layers, keys = 4, 2048
    run = write_run(tmp_path, layers, keys, top_k=50, n_examples=50_000)
    write_lookups(run, layers, keys)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=Stub())) as client:
        times = []
        for i in range(30):
            t = time.perf_counter()
            r = client.get(f"/memory/{1 + i % layers}/{(i * 997) % keys}")  # layers count from 1 in URLs
            times.append(time.perf_counter() - t)
            assert r.status_code == 200 and r.text.count('class="t trig') == 50
    assert statistics.median(times) < 0.3, times
