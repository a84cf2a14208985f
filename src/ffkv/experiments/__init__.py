"""The paper's experiments on a run directory, one module per study (compute -> table -> figure).

    patterns.py     SPEC 4, Fig. 2: shallow / semantic key patterns, descriptions, human labels
    ablations.py    SPEC 5, Fig. 3: coefficient change when a prefix token is removed
    values.py       SPEC 6, Figs. 4-5, Table 2: values as distributions over the vocabulary
    composition.py  SPEC 7, Figs. 7-8: active memories, the layer output as a composition
    refinement.py   SPEC 8, Figs. 9-11, Table 3: how FF layers refine the residual's prediction
    heldout.py      the one forward pass over held-out examples that 7 and 8 share
    common.py       the run context, projections, held-out examples, tables
    figures.py      PNG + SVG figures, written atomically
    findings.py     the paper's finding per figure (for the report)
    analyze.py      `analyze(run_dir, ...)`, what `ffkv analyze` calls
    sharding.py     under torchrun: which batches (or layers) each rank runs, gathering the rows back
"""

from ffkv.experiments.analyze import EXPERIMENTS, analyze
from ffkv.experiments.common import eval_spec_for
from ffkv.experiments.patterns import export_annotation_sample, import_annotations

__all__ = ["EXPERIMENTS", "analyze", "eval_spec_for", "export_annotation_sample", "import_annotations"]
