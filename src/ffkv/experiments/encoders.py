"""Which of the paper's figures apply to a masked-LM encoder (BERT, RoBERTa; docs/definitions.md), and why.

The experiments were defined for next-token prediction. For an encoder the index reads every key over
the whole example (both directions), and the experiments that carry over run at the masked position:

- the trigger target is the token at the trigger position, not the next token (`ffkv.memories.targets`);
- values are projected with the MLM head's decoder weights alone under the default (identity)
  projection; the head's transform (dense, activation, LayerNorm) is the final normalization N, applied
  to residual-stream vectors (Figures 9-11) and to values only under ``--projection final-norm``;
- the held-out position of Figures 6-11 is replaced by the mask token and the model's prediction o is
  its MLM head's output there.

Each experiment states whether it applies (`ffkv.experiments.registry.Encoder`). Those marked as not
applying are skipped by `analyze` for an encoder (nothing is computed for them) and the run's
``encoder_applicability`` table says so, figure by figure, in the report.
"""

from __future__ import annotations

import pandas as pd

from ffkv.experiments import registry

#: The report's title of the ``encoder_applicability`` table's section, and the rows it shows.
TITLE = "Which figures apply to this masked-LM encoder, and why (beyond the paper)"
READING_ROWS = 10


def skipped_reason(experiment: str) -> str:
    """The statement recorded for an experiment skipped on an encoder."""
    return f"not applicable to a masked-LM encoder: {registry.get(experiment).encoder.why}"


def applicability_table() -> pd.DataFrame:
    """metrics/encoder_applicability.parquet: per experiment that states it (`Experiment.encoder`), in the paper's
    order, its figures, whether they apply and why."""
    return pd.DataFrame([{"experiment": name, "figures": e.encoder.figures, "applies": e.encoder.applies,
                          "why": e.encoder.why}
                         for name, e in registry.experiments().items() if e.encoder is not None])
