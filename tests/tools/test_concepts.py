"""Concepts: the clusters against brute force (top tokens by explicit products, overlaps by Python sets,
components by breadth-first search) on hand-built values, and the explorer's page on a run built by the
real pipeline."""

from __future__ import annotations

import re
from collections import deque

import numpy as np
import pandas as pd
import pytest
import torch
from starlette.testclient import TestClient

from ffkv.errors import FfkvError
from ffkv.tools.concepts import FREQUENT, FREQUENT_FLOOR, MIN_SHARED, TOP, cluster, concepts, shared_pairs
from ffkv.explorer import create_app
from support.helpers import loaded_tiny


def brute_clusters(tops: list[list[int]], min_shared: int, frequent: float) -> list[list[int]]:
    n = len(tops)
    count: dict[int, int] = {}
    for row in tops:
        for t in row:
            count[t] = count.get(t, 0) + 1
    common = {t for t, c in count.items() if c > max(FREQUENT_FLOOR, frequent * n)}
    sets = [set(row) - common for row in tops]
    seen, groups = set(), []
    for i in range(n):
        if i in seen:
            continue
        group, queue = [], deque([i])
        seen.add(i)
        while queue:
            a = queue.popleft()
            group.append(a)
            for b in range(n):
                if b not in seen and len(sets[a] & sets[b]) >= min_shared:
                    seen.add(b)
                    queue.append(b)
        if len(group) >= 2:
            groups.append(sorted(group))
    return sorted(groups, key=lambda g: (-len(g), g[0]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cluster_matches_brute_force_on_random_top_sets(seed):
    rng = np.random.default_rng(seed)
    tops = np.array([rng.choice(40, size=6, replace=False) for _ in range(120)])
    for min_shared in (2, 3):
        assert cluster(tops, min_shared, frequent=0.2) == brute_clusters(tops.tolist(), min_shared, 0.2)


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_pairs_match_set_intersections(seed):
    """Every pair of rows sharing >= min_shared ids, and no other, against Python sets (negative ids match nothing)."""
    rng = np.random.default_rng(seed)
    tops = np.array([rng.choice(30, size=5, replace=False) for _ in range(80)])
    placeholder = rng.random(tops.shape) < 0.1  # frequent tokens, left out as distinct negative ids
    tops = np.where(placeholder, -1 - np.arange(tops.size).reshape(tops.shape), tops)
    sets = [{t for t in row if t >= 0} for row in tops.tolist()]
    for min_shared in (1, 2, 3):
        a, b = shared_pairs(tops, min_shared)
        expected = sorted((i, j) for i in range(len(sets)) for j in range(i + 1, len(sets))
                          if len(sets[i] & sets[j]) >= min_shared)
        assert sorted(zip(a.tolist(), b.tolist())) == expected and len(expected) > 0
    assert [len(x) for x in shared_pairs(np.zeros((0, 5), np.int64))] == [0, 0]


def test_concepts_of_hand_built_values_match_brute_force():
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        u, w = torch.randn(view.d_model, generator=g), torch.randn(view.d_model, generator=g)
        for key in (0, 1, 2):   # three values along u, two along w: two concepts that must be found
            view.values(1)[key] = 10 * u + 0.01 * torch.randn(view.d_model, generator=g)
        for key in (7, 9):
            view.values(1)[key] = 10 * w + 0.01 * torch.randn(view.d_model, generator=g)
    found, members = concepts(loaded, [1])
    groups = [sorted(members[members["concept"] == c]["key"].tolist()) for c in found["concept"]]
    with torch.no_grad():
        tops = [torch.topk(view.values(1)[k] @ view.unembedding.T, TOP).indices.tolist() for k in range(view.d_m)]
    assert groups == brute_clusters(tops, MIN_SHARED, FREQUENT)
    assert any({0, 1, 2} <= set(g) for g in groups) and any({7, 9} <= set(g) for g in groups)
    assert (found["size"] == [len(g) for g in groups]).all() and (members["layer"] == 1).all()
    with pytest.raises(FfkvError, match="layer 9 does not exist"):
        concepts(loaded, [9])


def test_concepts_page_answers_on_a_real_run(analyzed):
    run, loaded = analyzed
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded),
                    raise_server_exceptions=False) as client:
        page = client.get("/concepts?layer=2")
        assert page.status_code == 200 and 'id="method"' in page.text
        found, members = concepts(loaded, [1])  # layer 2 on the page counts from 1
        first = members[members["concept"] == 0]
        links = set(re.findall(r'href="/memory/(\d+)/(\d+)"', page.text))
        assert {("2", str(k)) for k in first["key"]} <= links
        assert f"{len(found)} concept" in page.text
        assert client.get("/concepts").status_code == 200  # the last layer by default
        assert client.get("/concepts?layer=all").status_code == 200
        for bad in ("0", "99", "x"):
            assert client.get(f"/concepts?layer={bad}").status_code == 422
        assert client.post("/concepts").status_code in (403, 405)


def test_concepts_from_the_lookup_table_equal_the_models(analyzed):
    """The explorer clusters the lookup table's identity top tokens (no projection of the values, no weights):
    the same concepts, members and names as `concepts` computing them from the model, on every layer."""
    from ffkv.tools.concepts import concepts_of_tops
    from ffkv.explorer.data import ExplorerData

    run, loaded = analyzed
    data = ExplorerData(run, loaded)
    n_concepts = 0
    try:
        for layer in range(loaded.view.n_layers):
            tops = data.value_top_ids(layer, TOP)
            assert tops is not None and tops.shape == (loaded.view.d_m, TOP)
            found, members = concepts_of_tops([tops], [layer], loaded.tokenizer)
            expected_found, expected_members = concepts(loaded, [layer])
            pd.testing.assert_frame_equal(found, expected_found)
            pd.testing.assert_frame_equal(members, expected_members)
            n_concepts += len(found)
    finally:
        data.close()
    assert n_concepts > 0  # not a comparison of empty tables


def test_concepts_page_needs_no_weights(analyzed):
    """A run served with its tokenizer but no model weights still shows its concepts (from the lookup table)."""
    run, loaded = analyzed

    class TokenizerOnly:
        view = model = None
        tokenizer = loaded.tokenizer

    found, members = concepts(loaded, [1])
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=TokenizerOnly())) as client:
        page = client.get("/concepts?layer=2")
    assert page.status_code == 200 and f"{len(found)} concept" in page.text
    links = set(re.findall(r'href="/memory/(\d+)/(\d+)"', page.text))
    assert {("2", str(k)) for k in members[members["concept"] == 0]["key"]} <= links
