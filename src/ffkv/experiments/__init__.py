"""The paper's experiments on a run directory: the studies, and the shared analysis core they are built on.

Each study declares itself at its end (``EXPERIMENT = Experiment(...)``, `ffkv.experiments.registry`): `analyze`,
the report, the command and the explorer read the studies from the registry, and a new study is one file
(here, or outside the package: docs/extending.md). The tools that act on memories (prune, intervene, concepts,
annotate, and the commands beyond the paper) are apart, in `ffkv.tools`, one layer above.

The studies (compute -> table -> figure):

    patterns.py            paper, Fig. 2: shallow / semantic key patterns, descriptions, agreement with human labels
    ablations.py           paper, Fig. 3: coefficient change when a prefix token is removed
    values.py              paper, Figs. 4-5, Table 2: values as distributions over the vocabulary
    composition.py         paper, Figs. 7-8: active memories, the layer output as a composition
    refinement.py          paper, Figs. 9-11, Table 3: how FF layers refine the residual's prediction
    translators.py         the tuned lens: per-layer translators fitted on held-out text (optional)
    census.py              beyond the paper: every key classed (dead, token/n-gram detector, positional; value type, eraser)
    vocabulary_classes.py  Gurnee et al. 2024: prediction, suppression and partition values from the weights
    suppressed.py          beyond the paper: active memories that ranked the gold token first where the model was wrong
    membership.py          beyond the paper: do coefficients separate training from held-out text (ROC AUC per layer)
    pruning.py             beyond the paper: held-out perplexity against the share of keys removed
    lookups.py             the explorer's tables

The shared core:

    analyze.py           `analyze(run_dir, ...)`, what `ffkv analyze` calls
    registry.py          the experiments, as their modules declare them; plugins (--plugin FILE.py, entry points)
    common.py            the run context, projections, held-out examples, tables
    heldout.py           the one forward pass over held-out examples the studies share; the active rule's scale s_l
    scoring.py           one forward pass that scores an example: loss, token-set mass, coefficient statistics
    dead.py              dead keys: never active over the indexed corpus, one rule for every study
    semantic.py          the semantic score of a key and its null
    trigger_contexts.py  per-token coefficients of every trigger example (the explorer's shading)
    encoders.py          which figures apply to a masked-LM encoder
    fidelity.py          metrics/fidelity.parquet from the experiments' own fidelity rules
    figures.py           PNG + SVG figures, written atomically
"""

from ffkv.experiments.analyze import analyze


def __getattr__(name: str):
    """``EXPERIMENTS``: what `analyze` runs by default, in its order (every registered experiment but the optional
    ones), read from the registry when asked, so that a plugin registered since counts."""
    if name == "EXPERIMENTS":
        from ffkv.experiments.registry import default_names

        return tuple(default_names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EXPERIMENTS", "analyze"]
