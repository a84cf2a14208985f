"""Which studies read a sparse dictionary's latents beside the neurons, and why the others do not.

A run indexed with ``--dictionary`` holds latents as memories of their own (`ffkv.memories.sets.Latents`). Each
experiment states what it computes for them (`ffkv.experiments.registry.Experiment.latents`): the tables that set
the latents beside the neurons of their layer, or why it computes nothing for them. `analyze` writes the
``latent_applicability`` table for such a run, so that the report names every study as read on latents, not
applicable, or not computed yet: never an empty section.
"""

from __future__ import annotations

import pandas as pd

from ffkv.experiments import registry

#: The report's title of the ``latent_applicability`` table's section, and the rows it shows.
TITLE = "Which studies read the dictionary's latents beside the neurons, and why the others do not (beyond the paper)"
READING_ROWS = 30
#: What an experiment that states nothing computes for latents.
NOT_YET = "not computed for latents yet: it reads the neurons only"


def applicability_table() -> pd.DataFrame:
    """metrics/latent_applicability.parquet: per experiment, in the paper's order, whether it reads latents and
    what it writes for them, or why not."""
    rows = []
    for name, e in registry.experiments().items():
        said = e.latents or NOT_YET
        rows.append({"experiment": name, "applies": not said.startswith("not "), "statement": said})
    return pd.DataFrame(rows)


__all__ = ["TITLE", "READING_ROWS", "NOT_YET", "applicability_table"]
