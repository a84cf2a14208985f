"""The pruning step of `ffkv analyze` on a run built by the real pipeline: its tables are right and the report
shows its section."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.nn import functional as F

from ffkv.experiments.pruning import SHARES
from ffkv.report import write_report
from ffkv.store.run import RunDir
from support.runs import corpus_lines


def test_pruning_tables_and_report_section(analyzed):
    run, loaded = analyzed
    rd = RunDir(run)
    table = rd.read_metric("pruning")
    # analyze runs the census before pruning: every criterion, the census one included, each at every share.
    assert list(dict.fromkeys(table["criterion"])) == ["activation_frequency", "value_norm", "contribution",
                                                       "redundancy", "census", "random"]
    assert (table.groupby("criterion")["share"].apply(list) == [list(SHARES)] * 6).all()
    assert (table["n_removed"] == np.floor(table["share"] * loaded.view.d_m + 0.5)).all()
    # Share 0: the model's own perplexity over every position of the held-out lines, by brute force.
    nll, n = 0.0, 0
    with torch.no_grad():
        for line in corpus_lines():
            ids = torch.tensor([loaded.tokenizer.encode(line)])
            logits = loaded.model(input_ids=ids).logits[0].double()
            nll += float(F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum"))
            n += ids.shape[1] - 1
    base = table[table["share"] == 0]
    assert (base["n_tokens"] == n).all()
    assert np.allclose(base["perplexity"], math.exp(nll / n), rtol=1e-6)
    assert table.loc[table["share"] == 0.9, "perplexity"].ne(math.exp(nll / n)).all()

    summary = rd.read_metric("pruning_summary")
    assert list(summary.columns) == ["criterion", "perplexity_0", "perplexity_10", "perplexity_30", "perplexity_50",
                                     "n_tokens"]
    row = summary.set_index("criterion").loc["value_norm"]
    at = table[table["criterion"] == "value_norm"].set_index("share")["perplexity"]
    assert row["perplexity_30"] == at[0.3] and row["perplexity_50"] == at[0.5]

    page = write_report(run).read_text()
    assert 'id="analysis-pruning"' in page
    assert "Pruning memories: held-out perplexity against the share of keys removed" in page
    assert "perplexity 30" in page and "activation_frequency" in page and "redundancy" in page
    assert "pruning" in rd.figure_names()
