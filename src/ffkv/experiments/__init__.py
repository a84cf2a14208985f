"""The paper's experiments on a run directory, one module per study (compute -> table -> figure).

Each study declares itself at its end (``EXPERIMENT = Experiment(...)``, `ffkv.experiments.registry`): `analyze`,
the report, the command and the explorer read the studies from the registry, and a new study is one file
(here, or outside the package: docs/extending.md).

    patterns.py     SPEC 4, Fig. 2: shallow / semantic key patterns, descriptions, agreement with human labels
    ablations.py    SPEC 5, Fig. 3: coefficient change when a prefix token is removed
    values.py       SPEC 6, Figs. 4-5, Table 2: values as distributions over the vocabulary
    composition.py  SPEC 7, Figs. 7-8: active memories, the layer output as a composition
    refinement.py   SPEC 8, Figs. 9-11, Table 3: how FF layers refine the residual's prediction
    membership.py   SPEC 9: do coefficients separate training from held-out text (ROC AUC per layer)
    scoring.py      one forward pass that scores an example: loss, token-set mass, coefficient statistics
    heldout.py      the one forward pass over held-out examples that 7 and 8 share; the active rule's scale s_l
    dead.py         dead keys: never active over the indexed corpus, one rule for every study
    census.py       SPEC 9: every key classed (dead, token/n-gram detector, positional; value type, eraser)
    suppressed.py   SPEC 9: active memories that ranked the gold token first where the model was wrong
    pruning.py      SPEC 9 (beyond the paper): held-out perplexity against the share of keys removed; `ffkv prune`
    annotation.py   a sample of keys for human labelling (SPEC 4's human workflow)
    common.py       the run context, projections, held-out examples, tables
    figures.py      PNG + SVG figures, written atomically
    registry.py     the experiments, as their modules declare them; plugins (--plugin FILE.py, entry points)
    fidelity.py     metrics/fidelity.parquet from the experiments' own fidelity rules
    analyze.py      `analyze(run_dir, ...)`, what `ffkv analyze` calls
"""

from ffkv.experiments.analyze import analyze
from ffkv.experiments.annotation import export_sample


def __getattr__(name: str):
    """``EXPERIMENTS``: what `analyze` runs by default, in its order (every registered experiment but the optional
    ones), read from the registry when asked, so that a plugin registered since counts."""
    if name == "EXPERIMENTS":
        from ffkv.experiments.registry import default_names

        return tuple(default_names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EXPERIMENTS", "analyze", "export_sample"]
