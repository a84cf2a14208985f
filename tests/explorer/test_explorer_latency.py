"""The latency benchmark's synthetic run (its smallest shape) is a valid run: every page type the benchmark
times answers, and each memory page with the trigger examples of both directions. Timing belongs to
`benchmarks/explorer_latency.py`, not to a test."""

from __future__ import annotations

from starlette.testclient import TestClient

from explorer_latency import SHAPES, Stub, write_lookups, write_run
from ffkv.explorer import create_app, pages


def test_the_benchmark_run_serves_every_page_type(tmp_path):
    layers, keys, top_k, directions, vocab, _, _ = SHAPES["tiny"]
    run = tmp_path / "run"
    write_run(run, "tiny")
    write_lookups(run, "tiny")
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=Stub(vocab))) as client:
        for i in range(30):
            r = client.get(f"/memory/{1 + i % layers}/{(i * 97) % keys}")  # layers count from 1 in URLs
            assert r.status_code == 200 and r.text.count('class="t trig') == top_k * len(directions)
            assert 'id="triggers-negative"' in r.text
        assert client.get("/").status_code == 200
        for _, _, sort in pages.LAYER_COLUMNS:  # the synthetic patterns and census give every column
            assert client.get(f"/layer/2?sort={sort}&order=desc").status_code == 200, sort
        assert client.get("/search?token=w17").status_code == 200
        assert "topic 12" in client.get("/search?q=topic+12").text
        assert client.get("/concepts?layer=1").status_code == 200
        assert client.get("/trace").status_code == 200
        assert client.get("/trace?prompt=w1+w2").status_code == 503  # the weights are absent
