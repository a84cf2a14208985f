"""The index on a GPU: the same triggers as on the CPU, and no host sync inside the loop over batches.

Both tests need CUDA and are skipped without it (CI has no GPU); a session lent a GPU runs them.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from ffkv.batching import collate, length_batches
from ffkv.corpus import CorpusReader, CorpusSpec
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index, index_batch, index_capture
from ffkv.indexing.reducer import TriggerReducer
from ffkv.indexing.sinks import KeySink, model_keys, random_keys
from ffkv.indexing.topk import TopKState
from ffkv.memories.controls import RandomKeys
from support.helpers import loaded_tiny, on_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")

#: What identifies a trigger: its place in the table and the example, position and next token it names.
IDENTITY = ["layer", "key", "direction", "rank", "example_id", "position", "next_token_id"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"line {i} says {'ab' * (i % 5)} and {'xyz'[i % 3] * (i % 7)}\n" for i in range(60)))
    return CorpusSpec(source=str(path), unit="line")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gpu_index_names_the_cpu_index_triggers(tmp_path, corpus, family):
    """float32 on both devices: the same trigger ids, positions and order, for the model's keys and for the
    random control keys indexed beside them; coefficients within 1e-4 (the GPU's matrix products sum in another
    order)."""
    options, batching = IndexOptions(top_k=5, control_keys=16), BatchOptions(batch_size=8)
    cpu = build_index(loaded_tiny(family), corpus, tmp_path / "cpu", options, batching, progress=False)
    gpu = build_index(on_device(loaded_tiny(family), "cuda"), corpus, tmp_path / "gpu", options, batching, progress=False)
    for table in ("trigger_examples", "control_trigger_examples"):
        a = pq.read_table(cpu.table(table)).to_pandas()
        b = pq.read_table(gpu.table(table)).to_pandas()
        assert len(a) == len(b) > 0, table
        assert a[IDENTITY].equals(b[IDENTITY]), table
        torch.testing.assert_close(torch.tensor(b["coefficient"].to_numpy()),
                                   torch.tensor(a["coefficient"].to_numpy()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("controlled", [False, True])
def test_index_loop_never_waits_for_the_gpu(corpus, controlled):
    """Reducing and merging a batch launch work only: no op in the loop copies a result back to the host
    (torch's sync debug mode raises on any that does), with or without the random control keys. Batches are
    moved to the GPU beforehand, as the prefetching workers do."""
    loaded = on_device(loaded_tiny("gpt2"), "cuda")
    view = loaded.view
    examples = list(CorpusReader(corpus, loaded.tokenizer))
    batches = [collate(group, loaded.tokenizer.pad_id, (), 32).to("cuda") for group in length_batches(examples, 8, None)]
    state = TopKState.empty(view.n_layers, 2 * view.d_m, 5, "cuda")
    reducer = TriggerReducer(state, "example", signed=True)
    if controlled:
        control = TopKState.empty(view.n_layers, 2 * 16, 5, "cuda")
        reducer = KeySink(model_keys(reducer, view.n_layers)
                          + random_keys(TriggerReducer(control, "example", signed=True), RandomKeys(view, 16)))
    with index_capture(loaded, reducer):
        index_batch(loaded, reducer, batches[0])  # first use: allocations and kernel loading
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for batch in batches[1:]:
                index_batch(loaded, reducer, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    reducer.flush()
    assert int((state.example_id != torch.iinfo(torch.int64).max).sum()) == state.example_id.numel()
