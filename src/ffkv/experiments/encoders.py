"""Which of the paper's figures apply to a masked-LM encoder (BERT, RoBERTa; SPEC section 9), and why.

The experiments were defined for next-token prediction. For an encoder the index reads every key over
the whole example (both directions), and the experiments that carry over run at the masked position:

- the trigger target is the token at the trigger position, not the next token (`ffkv.memories.targets`);
- values are projected with the MLM head's decoder weights alone under the default (identity)
  projection; the head's transform (dense, activation, LayerNorm) is the final normalization N, applied
  to residual-stream vectors (Figures 9-11) and to values only under ``--projection final-norm``;
- the held-out position of Figures 6-11 is replaced by the mask token and the model's prediction o is
  its MLM head's output there.

Experiments marked as not applying are skipped by `analyze` for an encoder (nothing is computed for
them) and the run's ``encoder_applicability`` table says so, figure by figure, in the report.
"""

from __future__ import annotations

import pandas as pd

#: experiment -> (applies to an encoder, figures, why).
APPLICABILITY: dict[str, tuple[bool, str, str]] = {
    "patterns": (True, "Figure 2", "computed on the trigger's left context x_1..x_j (shallow suffix, semantic "
                 "score); the encoder also reads the tokens after j, which these scores do not describe"),
    "ablations": (False, "Figure 3", "not computed: it recomputes the coefficient on the prefix alone and removes "
                  "its last token, but an encoder's trigger coefficient is read over the whole example and its last "
                  "prefix token is the trigger token itself; the figure measures nothing the paper's does"),
    "values": (True, "Figures 4-5, Table 2", "the trigger target is the token at the trigger position; values are "
               "projected with the MLM head's decoder weights (its transform only under --projection final-norm)"),
    "composition": (True, "Figures 6-8", "at the masked held-out position; sub-updates and the FF output through "
                    "the values projection (the decoder weights)"),
    "refinement": (True, "Figures 9-11, Table 3", "at the masked held-out position; residuals through the MLM head "
                   "(transform, then decoder); o is the MLM head's prediction of the masked token"),
    "census": (True, "census (beyond the paper)", "over every token of the held-out examples, unmasked: activation, detector "
               "and positional statistics describe the keys; value types through the values projection"),
    "suppressed": (True, "suppressed memories (beyond the paper)", "at the masked held-out position, the gold token being the "
                   "masked one"),
    "membership": (False, "membership (beyond the paper)", "not computed: its baseline and statistic score next-token loss, "
                   "which a masked-LM encoder does not define"),
    "pruning": (False, "pruning curves (beyond the paper)", "not computed: perplexity is a causal LM's; `ffkv prune` still "
                "writes a smaller encoder"),
    "translators": (True, "KL-to-final, Figures 4, 9-11 side by side", "translators fitted at every (unmasked) "
                    "position of the training examples against the MLM head's output there"),
}


def applies(experiment: str, encoder: bool) -> bool:
    """Whether `analyze` runs the experiment on this model (every one on a causal LM)."""
    return not encoder or APPLICABILITY.get(experiment, (True, "", ""))[0]


def skipped_reason(experiment: str) -> str:
    """The statement recorded for an experiment skipped on an encoder."""
    return f"not applicable to a masked-LM encoder: {APPLICABILITY[experiment][2]}"


def applicability_table() -> pd.DataFrame:
    """metrics/encoder_applicability.parquet: per experiment, its figures, whether they apply and why."""
    return pd.DataFrame([{"experiment": name, "figures": figures, "applies": ok, "why": why}
                         for name, (ok, figures, why) in APPLICABILITY.items()])
