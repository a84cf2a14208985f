"""The index equals an independent brute-force computation over every prefix (SPEC section 3)."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from support.helpers import loaded_tiny

FAMILIES = ("gpt2", "gpt_neox_parallel", "opt", "llama", "bert")


def write_corpus(path, n=23, seed=0):
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "x", "quick"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 5))) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return lines


def brute_force(loaded, lines, k, mode, directions=(1,)):
    """Coefficients of every prefix, each run alone and unpadded; then a full sort, per direction
    (+1: largest m first; -1: most negative m first), ties by lower example id, then position.

    Returns (top-k table with a direction column, table of every candidate).
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
    tops = []
    for direction in directions:
        df = every.assign(direction=direction, score=direction * every["coefficient"])
        if mode == "example":  # each example's strongest prefix in this direction, the first on a tie
            df = df.sort_values(["layer", "key", "example_id", "score", "position"],
                                ascending=[True, True, True, False, True])
            df = df.groupby(["layer", "key", "example_id"], sort=False).head(1)
        df = df.sort_values(["layer", "key", "score", "example_id", "position"],
                            ascending=[True, True, False, True, True])
        df = df.groupby(["layer", "key"], sort=False).head(k).copy()
        df["rank"] = df.groupby(["layer", "key"]).cumcount()
        tops.append(df.drop(columns="score"))
    expected = pd.concat(tops).sort_values(["layer", "key", "direction", "rank"], ascending=[True, True, False, True])
    return expected.reset_index(drop=True), every


TOL = 1e-5  # float32 rounding between a padded batch and a lone prefix


def assert_same(result: pd.DataFrame, expected: pd.DataFrame, every: pd.DataFrame, mode: str):
    """The result is the brute-force top-k of each direction, exactly up to float rounding between near-equal values."""
    order = ["layer", "key", "direction", "rank"]
    result = result.sort_values(order, ascending=[True, True, False, True]).reset_index(drop=True)
    ids = ["layer", "key", "example_id", "position"]
    # The same directions, the same number of entries per key, and the same values rank by rank.
    assert len(result) == len(expected)
    np.testing.assert_array_equal(result[order], expected[order])
    np.testing.assert_allclose(result["coefficient"], expected["coefficient"], atol=TOL)
    # Every entry is a real prefix with that coefficient and next token.
    looked_up = result.merge(every, on=ids, how="left", suffixes=("", "_bf"))
    np.testing.assert_allclose(looked_up["coefficient"], looked_up["coefficient_bf"], atol=TOL)
    np.testing.assert_array_equal(looked_up["next_token_id"], looked_up["next_token_id_bf"])
    if mode == "example":
        assert not result.duplicated(["layer", "key", "direction", "example_id"]).any()
    # Order within a key and direction follows the stored values exactly (the most negative first in
    # direction -1), ties by example id then position.
    result = result.assign(score=result["direction"] * result["coefficient"])
    again = result.sort_values(["layer", "key", "direction", "score", "example_id", "position"],
                               ascending=[True, True, False, False, True, True])
    np.testing.assert_array_equal(again["rank"].to_numpy(), result["rank"].to_numpy())
    # Nothing clearly stronger than a key's weakest kept entry was left out. In example mode an
    # example's position is only defined up to rounding when two of its positions nearly tie (a
    # parallel block's first layer sees each token alone), so there the example must be kept.
    weakest = result.groupby(["layer", "key", "direction"])["score"].min().rename("weakest")
    strong = expected.assign(score=expected["direction"] * expected["coefficient"]).join(
        weakest, on=["layer", "key", "direction"])
    strong = strong[strong["score"] > strong["weakest"] + TOL]
    kept = ["direction", *ids] if mode == "prefix" else ["layer", "key", "direction", "example_id"]
    missing = strong.merge(result[kept], on=kept, how="left", indicator=True)
    assert (missing["_merge"] == "both").all()


#: The directions each family's index keeps by default: both where m can be negative (GELU: GPT-2, NeoX,
#: BERT; SiLU-gated: Llama), the positive one for ReLU (OPT).
DEFAULT_DIRECTIONS = {"gpt2": (1, -1), "gpt_neox_parallel": (1, -1), "opt": (1,), "llama": (1, -1), "bert": (1, -1)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["example", "prefix"])
def test_index_equals_brute_force(tmp_path, family, mode):
    lines = write_corpus(tmp_path / "corpus.txt")
    loaded = loaded_tiny(family, bos=(family == "llama"), eos=(family == "bert"))
    spec = CorpusSpec(source=str(tmp_path / "corpus.txt"), unit="line")
    directions = DEFAULT_DIRECTIONS[family]
    expected, every = brute_force(loaded, lines, k=5, mode=mode, directions=directions)
    assert (expected["direction"] == -1).any() == (directions == (1, -1))
    for batch_size in (1, 4, 32):
        run = build_index(loaded, spec, tmp_path / f"run-{batch_size}", IndexOptions(top_k=5, mode=mode),
                          BatchOptions(batch_size=batch_size, window_batches=2), progress=False)
        assert run.manifest().sign == ("both" if directions == (1, -1) else "positive")
        result = pd.read_parquet(run.table("trigger_examples"))
        assert_same(result, expected, every, mode)
        if directions == (1, -1):  # the test has negative coefficients to find
            assert (result.loc[result["direction"] == -1, "coefficient"] < 0).any()


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


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def machine_load(monkeypatch, load: float) -> None:
    """Make `reducer.contended` read this 1-minute load average from now on."""
    from ffkv.indexing import reducer

    monkeypatch.setattr(reducer.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setitem(reducer._load_read, "at", -float("inf"))


def test_the_small_operations_take_one_thread_only_on_a_shared_machine(monkeypatch, two_threads):
    """`reducer.one_thread`: one thread while the load average exceeds CONTENDED_LOAD per torch thread (a machine
    shared with other work), torch's threads otherwise (switching then costs more than it saves), one thread with
    `always`; torch's threads again after it."""
    from ffkv.indexing import reducer

    cpu = torch.device("cpu")
    for load, inside in [(0.5, 2), (2.9, 2), (3.1, 1), (9.0, 1)]:  # 2 threads: shared above 3.0
        machine_load(monkeypatch, load)
        with reducer.one_thread(cpu):
            assert torch.get_num_threads() == inside, load
        with reducer.one_thread(cpu, always=True):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    monkeypatch.setattr(reducer.os, "getloadavg", lambda: (_ for _ in ()).throw(OSError("no load average")))
    monkeypatch.setitem(reducer._load_read, "at", -float("inf"))
    assert reducer.contended()  # unknown: as before, one thread


def test_the_index_is_the_same_bytes_on_one_thread_or_two(tmp_path, monkeypatch, two_threads):
    """Whether the reduction's small operations run on one thread (a shared machine) or on two (an idle one), every
    table the index writes is the same, and the reducer took the path asked for."""
    from ffkv.indexing import reducer

    write_corpus(tmp_path / "corpus.txt", n=60)
    loaded = loaded_tiny("llama", bos=True)
    spec = CorpusSpec(source=str(tmp_path / "corpus.txt"), unit="line")
    seen = []
    original = reducer.one_thread

    def watched(device, always=False):
        seen.append(reducer.contended())
        return original(device, always)

    monkeypatch.setattr(reducer, "one_thread", watched)
    tables = []
    for load in (9.0, 0.5):
        machine_load(monkeypatch, load)
        seen.clear()
        run = build_index(loaded, spec, tmp_path / f"run-{load}", IndexOptions(top_k=5, control_keys=16),
                          BatchOptions(batch_size=8), progress=False)
        assert seen and all(s == (load > 3.0) for s in seen)
        tables.append({name: run.table(name).read_bytes() for name in ("trigger_examples", "control_trigger_examples")})
    assert tables[0] == tables[1]
