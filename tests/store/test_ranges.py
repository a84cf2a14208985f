"""A trigger table's ids against the run's shape: every way out named, and nothing in range refused."""

from __future__ import annotations

import pandas as pd

from ffkv.store import ranges


def _rows(*triples) -> pd.DataFrame:
    return pd.DataFrame(triples, columns=["layer", "key", "rank"])


def test_ids_within_the_shape_pass_and_each_way_out_is_named():
    allowed, top_k = {0: 4, 1: 4}, 3
    inside = _rows((0, 0, 0), (0, 3, 2), (1, 1, 1))
    assert ranges.problem(ranges.spans(inside), allowed, top_k) is None
    cases = {
        "layer id 2 in its rows; the run's layer ids (from 0) are 0, 1": (2, 0, 0),
        "memory 4 of layer 1 in its rows; that layer has 4": (1, 4, 0),
        "memory -1 of layer 0 in its rows; that layer has 4": (0, -1, 0),
        "rank 3 in its rows; the run keeps the top 3": (1, 0, 3),
        "rank -2 in its rows; the run keeps the top 3": (0, 1, -2),
    }
    for said, bad in cases.items():
        assert ranges.problem(ranges.spans(_rows(*inside.itertuples(index=False), bad)), allowed, top_k) == said
    # a dictionary's layers need not start at 0 nor be contiguous; each layer has its own width
    assert ranges.problem(ranges.spans(_rows((3, 99, 0))), {3: 100, 5: 10}, 1) is None
    assert ranges.problem(ranges.spans(_rows((5, 10, 0))), {3: 100, 5: 10}, 1) == \
        "memory 10 of layer 5 in its rows; that layer has 10"
