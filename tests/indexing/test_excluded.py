"""The special-token positions the index leaves out of ranking are counted and named in the manifest."""

from __future__ import annotations

import pandas as pd

from ffkv.corpus import CorpusSpec
from ffkv.indexing.excluded import sentence
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import load_model


def test_the_manifest_counts_and_names_the_excluded_special_tokens(tmp_path):
    """ffkv-tiny's tokenizer puts <s> first and reads PTB's <unk> as its special unknown token: both are left
    out of ranking, counted here by brute force over the stored examples, and no trigger position holds one."""
    loaded = load_model("ffkv-tiny")
    corpus = tmp_path / "ptb.txt"
    corpus.write_text("the <unk> said it would buy <unk> shares\nprices rose in <unk> trading\nno rare words here\n")
    run = build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), tmp_path / "run", IndexOptions(top_k=2),
                      progress=False)
    manifest = run.manifest()
    examples = pd.read_parquet(run.table("examples"))
    ids = [int(t) for row in examples.token_ids for t in row]
    special = loaded.tokenizer.special_ids
    unk, bos = loaded.tokenizer.hf.convert_tokens_to_ids(["<unk>", "<s>"])
    assert ids.count(unk) == 3 and ids.count(bos) == 3
    assert manifest.counts["excluded_positions"] == sum(i in special for i in ids) == 6
    assert manifest.index["excluded_tokens"] == {"<s>": 3, "<unk>": 3}
    te = pd.read_parquet(run.table("trigger_examples")).merge(examples, on="example_id")
    assert not any(int(row.token_ids[row.position]) in special for row in te.itertuples())
    line = sentence(manifest)
    assert line.startswith(f"6 positions ({6 / manifest.counts['tokens']:.1%}) end in a special token")
    assert "<s> (3), <unk> (3)" in line
