"""The index equals an independent brute-force computation over every prefix (SPEC section 3)."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.index.indexer import BatchOptions, IndexOptions, build_index
from support.helpers import loaded_tiny

FAMILIES = ("gpt2", "gpt_neox_parallel", "opt", "llama", "bert")


def write_corpus(path, n=23, seed=0):
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "x", "quick"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 5))) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return lines


def brute_force(loaded, lines, k, mode):
    """Coefficients of every prefix, each run alone and unpadded; then a full sort.

    Returns (top-k table, table of every candidate).
    """
    view, tok = loaded.view, loaded.tokenizer
    rows = []  # (layer, key, value, example_id, position, next_token)
    for eid, line in enumerate(lines):
        ids = tok.encode(line)
        if view.encoder:
            with view.capture(("coefficients",)) as cap:
                view.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
            full = torch.stack([cap["coefficients"][l][0] for l in range(view.n_layers)])  # (L, T, d_m)
            per_pos = [full[:, j] for j in range(len(ids))]
        else:
            per_pos = []
            for j in range(1, len(ids) + 1):
                with view.capture(("coefficients",)) as cap:
                    view.forward(torch.tensor([ids[:j]]), torch.ones(1, j, dtype=torch.long))
                per_pos.append(torch.stack([cap["coefficients"][l][0, -1] for l in range(view.n_layers)]))
        for j, m in enumerate(per_pos):
            if ids[j] in tok.special_ids:
                continue
            nxt = ids[j + 1] if j + 1 < len(ids) else -1
            for layer in range(view.n_layers):
                for key in range(view.d_m):
                    rows.append((layer, key, float(m[layer, key]), eid, j, nxt))
    every = pd.DataFrame(rows, columns=["layer", "key", "coefficient", "example_id", "position", "next_token_id"])
    df = every
    if mode == "example":
        df = df.sort_values(["layer", "key", "example_id", "coefficient", "position"],
                            ascending=[True, True, True, False, True])
        df = df.groupby(["layer", "key", "example_id"], sort=False).head(1)
    df = df.sort_values(["layer", "key", "coefficient", "example_id", "position"],
                        ascending=[True, True, False, True, True])
    df = df.groupby(["layer", "key"], sort=False).head(k).copy()
    df["rank"] = df.groupby(["layer", "key"]).cumcount()
    return df.reset_index(drop=True), every


TOL = 1e-5  # float32 rounding between a padded batch and a lone prefix


def assert_same(result: pd.DataFrame, expected: pd.DataFrame, every: pd.DataFrame, mode: str):
    """The result is the brute-force top-k, exactly up to float rounding between near-equal values."""
    result = result.sort_values(["layer", "key", "rank"]).reset_index(drop=True)
    ids = ["layer", "key", "example_id", "position"]
    # Same number of entries per key, and the same values rank by rank.
    assert len(result) == len(expected)
    np.testing.assert_array_equal(result[["layer", "key", "rank"]], expected[["layer", "key", "rank"]])
    np.testing.assert_allclose(result["coefficient"], expected["coefficient"], atol=TOL)
    # Every entry is a real prefix with that coefficient and next token.
    looked_up = result.merge(every, on=ids, how="left", suffixes=("", "_bf"))
    np.testing.assert_allclose(looked_up["coefficient"], looked_up["coefficient_bf"], atol=TOL)
    np.testing.assert_array_equal(looked_up["next_token_id"], looked_up["next_token_id_bf"])
    if mode == "example":
        assert not result.duplicated(["layer", "key", "example_id"]).any()
    # Order within a key follows the stored values exactly, ties by example id then position.
    again = result.sort_values(["layer", "key", "coefficient", "example_id", "position"],
                               ascending=[True, True, False, True, True])
    np.testing.assert_array_equal(again["rank"].to_numpy(), result["rank"].to_numpy())
    # Nothing clearly stronger than a key's weakest kept entry was left out. In example mode an
    # example's position is only defined up to rounding when two of its positions nearly tie (a
    # parallel block's first layer sees each token alone), so there the example must be kept.
    weakest = result.groupby(["layer", "key"])["coefficient"].min().rename("weakest")
    strong = expected.join(weakest, on=["layer", "key"])
    strong = strong[strong["coefficient"] > strong["weakest"] + TOL]
    kept = ids if mode == "prefix" else ["layer", "key", "example_id"]
    missing = strong.merge(result[kept], on=kept, how="left", indicator=True)
    assert (missing["_merge"] == "both").all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["example", "prefix"])
def test_index_equals_brute_force(tmp_path, family, mode):
    lines = write_corpus(tmp_path / "corpus.txt")
    loaded = loaded_tiny(family, bos=(family == "llama"), eos=(family == "bert"))
    spec = CorpusSpec(source=str(tmp_path / "corpus.txt"), unit="line")
    expected, every = brute_force(loaded, lines, k=5, mode=mode)
    for batch_size in (1, 4, 32):
        run = build_index(loaded, spec, tmp_path / f"run-{batch_size}", IndexOptions(top_k=5, mode=mode),
                          BatchOptions(batch_size=batch_size, window_batches=2), progress=False)
        assert_same(pd.read_parquet(run.table("trigger_examples")), expected, every, mode)


def test_ties_break_by_lower_example_then_position(tmp_path):
    # Identical examples give identical coefficients: ranks must follow example ids.
    (tmp_path / "c.txt").write_text("aaa\nbbb\naaa\naaa\n")
    loaded = loaded_tiny("opt")
    run = build_index(loaded, CorpusSpec(source=str(tmp_path / "c.txt"), unit="line"), tmp_path / "run",
                      IndexOptions(top_k=4, mode="prefix"), BatchOptions(batch_size=3), progress=False)
    df = pd.read_parquet(run.table("trigger_examples"))
    for (_, _), g in df.groupby(["layer", "key"]):
        g = g.sort_values("rank")
        values = g["coefficient"].to_numpy()
        keys = list(zip(-values, g["example_id"], g["position"]))
        assert keys == sorted(keys)
