"""Column types of the run directory's public tables (documented in docs/run-directory.md)."""

import pyarrow as pa

EXAMPLES = pa.schema([
    ("example_id", pa.int64()),
    ("token_ids", pa.list_(pa.int32())),
    ("text", pa.string()),
])

TRIGGER_EXAMPLES = pa.schema([
    ("layer", pa.int16()),
    ("key", pa.int32()),
    ("rank", pa.int16()),
    ("coefficient", pa.float32()),
    ("example_id", pa.int64()),
    ("position", pa.int32()),
    ("next_token_id", pa.int32()),
])
