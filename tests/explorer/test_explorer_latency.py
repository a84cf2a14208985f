"""The latency benchmark's synthetic run (a smaller cut) is a valid run: every memory page it asks for
answers with its 50 trigger examples. Timing belongs to `benchmarks/explorer_latency.py`, not to a test."""

from __future__ import annotations

from starlette.testclient import TestClient

from explorer_latency import Stub, write_lookups, write_run
from ffkv.explorer import create_app


def test_the_benchmark_run_serves_memory_pages(tmp_path):
    layers, keys = 4, 2048
    run = write_run(tmp_path, layers, keys, top_k=50, n_examples=50_000)
    write_lookups(run, layers, keys)
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=Stub())) as client:
        for i in range(30):
            r = client.get(f"/memory/{1 + i % layers}/{(i * 997) % keys}")  # layers count from 1 in URLs
            assert r.status_code == 200 and r.text.count('class="t trig') == 50
