"""Every Parquet schema of the run directory, in one place (documented in docs/run-directory.md).

Tables of `ffkv analyze` (RUN/metrics/) are described by the experiments that write
them and listed with their columns in the docs; the schemas here are those of the
tables that more than one part of ffkv writes or reads by column.
"""

import enum

import numpy as np
import pyarrow as pa

from ffkv.errors import FfkvError

#: RUN/examples.parquet: one row per example of the corpus selection.
EXAMPLES = pa.schema([
    ("example_id", pa.int64()),
    ("token_ids", pa.list_(pa.int32())),
    ("text", pa.string()),
])

#: RUN/trigger_examples.parquet: one row per (layer, key, direction, rank).
TRIGGER_EXAMPLES = pa.schema([
    ("layer", pa.int16()),
    ("key", pa.int32()),
    ("direction", pa.int8()),
    ("rank", pa.int16()),
    ("coefficient", pa.float32()),
    ("example_id", pa.int64()),
    ("position", pa.int32()),
    ("next_token_id", pa.int32()),
])

#: RUN/control_keys.parquet: the random control memories indexed beside the model's keys (`ffkv.memories.controls`),
#: one row per (layer, key); their trigger examples are in RUN/control_trigger_examples.parquet (TRIGGER_EXAMPLES).
CONTROL_KEYS = pa.schema([
    ("layer", pa.int16()),
    ("key", pa.int32()),
    ("source_key", pa.int32()),
    ("key_norm", pa.float32()),
])

#: What a reader needs of each index table (relative path -> columns): trigger_examples of format 1 and 2
#: have no `direction` column, so it is not required.
INDEX_EXPECTED = {
    "examples.parquet": EXAMPLES,
    "trigger_examples.parquet": TRIGGER_EXAMPLES.remove(TRIGGER_EXAMPLES.get_field_index("direction")),
    "control_trigger_examples.parquet": TRIGGER_EXAMPLES,
    "control_keys.parquet": CONTROL_KEYS,
    "latent_trigger_examples.parquet": TRIGGER_EXAMPLES,
    "latent_control_trigger_examples.parquet": TRIGGER_EXAMPLES,
    "latent_control_keys.parquet": CONTROL_KEYS,
}

class Direction(enum.IntEnum):
    """A trigger direction, the one type for it: +1 (``positive``) a key's largest coefficients, the paper's trigger
    examples; -1 (``negative``) its most negative ones (indexed with ``--sign both``). It is the integer of the
    tables' `direction` column and reads the names the command and the library take. Tables of format 1 and 2
    have no such column: every row there is +1."""

    POSITIVE = 1
    NEGATIVE = -1

    @property
    def label(self) -> str:
        """"positive" or "negative", as the command and the library write it."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: "Direction | str | int") -> "Direction":
        """A direction from its name (``positive``, ``negative``) or its integer (1, -1)."""
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and int(value) in (1, -1):
            return cls(int(value))
        raise FfkvError(f"direction must be positive (1) or negative (-1), got {value!r}")

#: RUN/annotations/labels.parquet: human pattern labels, one row per (layer, key, annotator).
LABELS = pa.schema([
    ("layer", pa.int16()),
    ("key", pa.int32()),
    ("label", pa.string()),
    ("description", pa.string()),
    ("annotator", pa.string()),
    ("time", pa.string()),
])

#: RUN/explorer/value_top_tokens.parquet: each value's top tokens, one row per (layer, key, rank).
VALUE_TOP_TOKENS = pa.schema([
    ("layer", pa.int16()),
    ("key", pa.int32()),
    ("rank", pa.int16()),
    ("token_id", pa.int32()),
    ("prob", pa.float32()),
])

#: RUN/explorer/key_stats.parquet: one row per (layer, key), the explorer's sortable statistics.
KEY_STATS = pa.schema([
    ("layer", pa.int16()),
    ("key", pa.int32()),
    ("confidence", pa.float32()),
    ("top_token_id", pa.int32()),
    ("agreement", pa.bool_()),
    ("next_token_rank", pa.int32()),
    ("logsumexp", pa.float32()),
    ("value_norm", pa.float32()),
    ("activation_frequency", pa.float32()),
    ("common_last_token_id", pa.int32()),
    ("shallow_share", pa.float32()),
    # m_i over the positions of a corpus sample: equal-width bins from activation_lo to activation_hi.
    ("activation_lo", pa.float32()),
    ("activation_hi", pa.float32()),
    ("activation_histogram", pa.list_(pa.int32())),
])

#: RUN/explorer/latent_stats.parquet (a run indexed with a sparse dictionary): one row per (layer, key), key the
#: latent's index in its layer's dictionary; the latent layer page's sortable statistics (`ffkv.experiments
#: .latent_lookups`). Value statistics read the decoder row d_j as `KEY_STATS` reads v_i; activation statistics
#: count a_j > 0 (a latent's activation is its own active rule, docs/definitions.md). `KEY_STATS`'s columns, with its
#: trigger rows' count and largest activation after shallow_share.
LATENT_STATS = pa.schema([*KEY_STATS][:KEY_STATS.get_field_index("shallow_share") + 1]
                         + [pa.field("n_triggers", pa.int32()), pa.field("top_coefficient", pa.float32())]
                         + [*KEY_STATS][KEY_STATS.get_field_index("shallow_share") + 1:])
