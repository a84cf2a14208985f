"""Signed memories (`--sign`): both trigger directions, their exact tie-breaks, and the default per activation."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from ffkv.batching import collate
from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.indexing.reducer import MODES, TriggerReducer
from ffkv.indexing.tables import state_from_table, trigger_table
from ffkv.indexing.topk import TopKState
from ffkv.memories.architectures import signed_coefficients
from support.helpers import loaded_tiny

COLUMNS = ["layer", "key", "direction", "rank", "coefficient", "example_id", "position", "next_token_id"]
SPECIAL, PAD = 1, 0


@dataclass
class Example:
    example_id: int
    token_ids: list[int]


def _world(seed: int, n_examples: int = 40, n_layers: int = 2, d_m: int = 6):
    """Examples (some starting with a special token) and integer coefficients: many exact ties, in both
    directions and between positions of one example."""
    rng = random.Random(seed)
    examples, coefficients = [], {}
    for eid in range(n_examples):
        n = rng.randint(1, 6)
        tokens = [rng.randint(4, 12) for _ in range(n)]
        if rng.random() < 0.3:
            tokens[0] = SPECIAL  # never competes (and an example of one special token has no candidate)
        examples.append(Example(eid, tokens))
        coefficients[eid] = torch.tensor([[[rng.randint(-3, 3) for _ in range(d_m)] for _ in range(n)]
                                          for _ in range(n_layers)], dtype=torch.float32)  # (L, T, d_m)
    return examples, coefficients


def _brute_force(examples, coefficients, k, mode, directions=(1, -1)) -> pd.DataFrame:
    """Per (layer, key, direction): the k best competing prefixes by (direction·m desc, example id, position)."""
    n_layers, _, d_m = coefficients[0].shape
    rows = []
    for layer in range(n_layers):
        for key in range(d_m):
            for direction in directions:
                found = []
                for e in examples:
                    m = coefficients[e.example_id][layer, :, key]
                    cands = [(-direction * float(m[j]), e.example_id, j) for j in range(len(e.token_ids))
                             if e.token_ids[j] != SPECIAL]
                    found.extend([min(cands)] if mode == "example" and cands else cands)
                for rank, (score, eid, pos) in enumerate(sorted(found)[:k]):
                    tokens = next(e.token_ids for e in examples if e.example_id == eid)
                    rows.append((layer, key, direction, rank, -direction * score, eid, pos,
                                 tokens[pos + 1] if pos + 1 < len(tokens) else -1))
    return pd.DataFrame(rows, columns=COLUMNS)


def _cuts(n: int, sizes) -> list[tuple[int, int]]:
    """Consecutive (start, end) batches of n examples, of the given sizes in turn."""
    cuts, start = [], 0
    while start < n:
        cuts.append((start, min(n, start + next(sizes))))
        start = cuts[-1][1]
    return cuts


def _reduce(examples, coefficients, k, mode, batch_size, signed=True, device="cpu", buffer_columns=None,
            select_per_layer=None) -> TopKState:
    """The reducer fed with the coefficients of each batch, as the forward pass would; padded and special
    positions hold values that would win in either direction if they were not blocked."""
    n_layers, _, d_m = coefficients[0].shape
    state = TopKState.empty(n_layers, d_m * (2 if signed else 1), k, device)
    reducer = TriggerReducer(state, mode, signed=signed, buffer_columns=buffer_columns,
                             select_per_layer=select_per_layer)
    sizes = itertools.cycle(batch_size if isinstance(batch_size, (list, tuple)) else [batch_size])
    for start, end in _cuts(len(examples), sizes):
        group = examples[start:end]
        batch = collate(group, PAD, {SPECIAL}).to(device)
        reducer.start(batch)
        b, t = batch.input_ids.shape
        for layer in range(n_layers):
            c = torch.full((b, t, d_m), 99.0)
            c[:, ::2] = -99.0
            for row, e in enumerate(group):
                m = coefficients[e.example_id][layer]
                c[row, : len(m)] = m
                c[row, [j for j, tok in enumerate(e.token_ids) if tok == SPECIAL]] = 50.0 * (-1) ** row
            reducer("coefficients", layer, c.to(device))
        reducer.commit()
    reducer.flush()
    return state


#: The reducer has a CPU and a GPU path (max and min with indices); the GPU's runs where one is present.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_size", [1, 3, 8, 40])
@pytest.mark.parametrize("select_per_layer", [None, True, False])
def test_both_directions_with_exact_ties_equal_brute_force(mode, batch_size, device, select_per_layer):
    """Integer coefficients tie everywhere: the negative direction must order the most negative first, then
    the lower example id, then (in an example, and in prefix mode) the lower position, as the positive one.
    Whether each layer's candidates are selected as it is reduced or once in the merge (a GPU's default), and
    batches of fewer or more examples than k: the same state."""
    examples, coefficients = _world(seed=batch_size)
    expected = _brute_force(examples, coefficients, k=4, mode=mode)
    state = _reduce(examples, coefficients, k=4, mode=mode, batch_size=batch_size, device=device,
                    select_per_layer=select_per_layer).to("cpu")
    result = trigger_table(state, (1, -1)).to_pandas()
    pd.testing.assert_frame_equal(result[COLUMNS].astype(expected.dtypes), expected)
    # The test exercises what it claims: ties in the negative direction and negative coefficients.
    negative = expected[expected["direction"] == -1]
    assert (negative["coefficient"] < 0).all() and negative.duplicated(["layer", "key", "coefficient"]).any()
    # The table reads back into the same state (what `ffkv merge` does with each shard's table).
    again = state_from_table(trigger_table(state, (1, -1)), 2, 6, 4, (1, -1))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), state.state_dict().values()))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("buffer_columns", [0, 3, 4, 9, 10**6])
@pytest.mark.parametrize("select_per_layer", [None, False])
def test_merging_several_batches_at_once_equals_brute_force(mode, buffer_columns, select_per_layer):
    """The CPU merges the candidates of several batches at once: whether it merges after every batch
    (0), after a few (a buffer of 3 to 9 columns against batches of 3 examples, k = 4, some filled exactly,
    some not), or only in the final flush, the state equals the brute force."""
    examples, coefficients = _world(seed=11)
    expected = _brute_force(examples, coefficients, k=4, mode=mode)
    state = _reduce(examples, coefficients, k=4, mode=mode, batch_size=3, buffer_columns=buffer_columns,
                    select_per_layer=select_per_layer)
    result = trigger_table(state, (1, -1)).to_pandas()
    pd.testing.assert_frame_equal(result[COLUMNS].astype(expected.dtypes), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("buffer_columns", [0, 3, 6])
def test_buffer_grows_when_a_wider_batch_comes(mode, buffer_columns):
    """Batches of 1, 5, 2 and 9 examples against k = 4: a batch's candidates per key (min(k, batch) in example
    mode) outgrow the buffer made for the first one, which is merged and made anew; the state still equals
    the brute force."""
    examples, coefficients = _world(seed=5)
    expected = _brute_force(examples, coefficients, k=4, mode=mode)
    state = _reduce(examples, coefficients, k=4, mode=mode, batch_size=[1, 5, 2, 9],
                    buffer_columns=buffer_columns)
    pd.testing.assert_frame_equal(trigger_table(state, (1, -1)).to_pandas()[COLUMNS].astype(expected.dtypes),
                                  expected)


@pytest.mark.parametrize("mode", MODES)
def test_positive_only_state_is_the_positive_half(mode):
    examples, coefficients = _world(seed=7)
    both = trigger_table(_reduce(examples, coefficients, 3, mode, 5), (1, -1)).to_pandas()
    positive = trigger_table(_reduce(examples, coefficients, 3, mode, 5, signed=False), (1,)).to_pandas()
    pd.testing.assert_frame_equal(positive, both[both["direction"] == 1].reset_index(drop=True))
    assert (positive["direction"] == 1).all()


def test_signed_merge_of_halves_equals_one_pass():
    """Two states of disjoint examples merge, in either order, into the state of one pass."""
    examples, coefficients = _world(seed=3)
    one = _reduce(examples, coefficients, 4, "example", 6)
    for first, second in ((examples[:17], examples[17:]), (examples[17:], examples[:17])):
        merged = _reduce(first, coefficients, 4, "example", 6)
        merged.merge(_reduce(second, coefficients, 4, "example", 6), one_per_example=True)
        assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), one.state_dict().values()))


# ------------------------------------------------------------------ the default per activation

@pytest.mark.parametrize("family,signed", [("gpt2", True), ("gpt_neox", True), ("bert", True), ("llama", True),
                                           ("qwen2", True), ("opt", False)])
def test_signed_coefficients_by_activation(family, signed):
    """GELU (GPT-2, NeoX, BERT) and every gated FF (SiLU Llama, Qwen2) can give m < 0; ReLU (OPT) never."""
    view = loaded_tiny(family).view
    assert view.signed is signed
    assert signed_coefficients(view.arch, view.model, view.blocks[0]) is signed


def test_gated_relu_is_still_signed():
    """m = f(gate)·up: the up projection is signed, so a gated FF is signed whatever its activation."""
    view = loaded_tiny("llama").view
    for block in view.blocks:
        block.mlp.act_fn = torch.nn.ReLU()
    assert view.signed


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("".join(f"line {i} " + "ab" * (i % 4) + "\n" for i in range(24)))
    return CorpusSpec(source=str(path), unit="line")


def test_relu_model_defaults_to_positive_only_and_refuses_both(tmp_path, corpus):
    loaded = loaded_tiny("opt")
    run = build_index(loaded, corpus, tmp_path / "run", IndexOptions(top_k=3), BatchOptions(batch_size=4),
                      progress=False)
    manifest = run.manifest()
    assert manifest.sign == "positive" and manifest.identity.index["sign"] == "positive"
    assert manifest.index["sign"] == "positive"
    table = pq.read_table(run.table("trigger_examples"))
    assert set(table.column("direction").to_pylist()) == {1}
    assert len(table) == loaded.view.n_layers * loaded.view.d_m * 3
    with pytest.raises(FfkvError, match="--sign both: this model's coefficients are never negative"):
        build_index(loaded, corpus, tmp_path / "both", IndexOptions(top_k=3, sign="both"), progress=False)
    with pytest.raises(FfkvError, match="--sign must be one of positive, both"):
        build_index(loaded, corpus, tmp_path / "bad", IndexOptions(top_k=3, sign="negative"), progress=False)


def test_gelu_model_defaults_to_both_and_positive_is_its_positive_half(tmp_path, corpus):
    loaded = loaded_tiny("gpt2")
    both = build_index(loaded, corpus, tmp_path / "both", IndexOptions(top_k=3), BatchOptions(batch_size=4),
                       progress=False)
    positive = build_index(loaded, corpus, tmp_path / "positive", IndexOptions(top_k=3, sign="positive"),
                           BatchOptions(batch_size=4), progress=False)
    assert both.manifest().sign == "both" and positive.manifest().sign == "positive"
    a, b = (pd.read_parquet(r.table("trigger_examples")) for r in (both, positive))
    assert len(a) == 2 * len(b) == 2 * loaded.view.n_layers * loaded.view.d_m * 3
    pd.testing.assert_frame_equal(a[a["direction"] == 1].reset_index(drop=True), b)
    # Readers take the positive direction unless told otherwise.
    pd.testing.assert_frame_equal(both.read_triggers(), b)
    pd.testing.assert_frame_equal(both.read_triggers("negative"), a[a["direction"] == -1].reset_index(drop=True))
    with pytest.raises(FfkvError, match="indexed with --sign positive"):
        positive.read_triggers("negative")
