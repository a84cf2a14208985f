"""What `ffkv compare` left in a run (RUN/compare), read without the model: the explorer's memory page names each
memory's best match in the other model (`match_of`). The tables are written by `ffkv.tools.compare`."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ffkv.errors import FfkvError

#: Gurnee et al. 2024's cut-off on the excess correlation of a universal neuron.
EXCESS_CUT = 0.5
#: The folder under run A the tables go to by default.
FOLDER = "compare"


def read_matches(run: str | Path) -> pd.DataFrame | None:
    """RUN/compare/keys.parquet where a comparison was written there (for the explorer), else None."""
    path = Path(run) / FOLDER / "keys.parquet"
    if not path.is_file():
        return None
    try:
        table = pd.read_parquet(path)
    except (OSError, ValueError) as error:  # pyarrow's errors are OSError or ValueError subclasses
        raise FfkvError(f"{path} is damaged ({type(error).__name__}); run `ffkv compare` again") from None
    missing = {"layer", "key", "best_match", "correlation", "excess"} - set(table.columns)
    if missing:
        raise FfkvError(f"{path}: not a compare table (missing {', '.join(sorted(missing))})")
    return table


def match_of(run: str | Path, layer: int, key: int) -> dict | None:
    """The best match of memory (layer, key) (0-based) in the model RUN/compare compared this run's with, as the
    explorer's memory page shows it: model_b, run_b, layer, key, correlation, excess, universal; None without one."""
    table = read_matches(run)
    if table is None:
        return None
    row = table[(table["layer"] == layer) & (table["key"] == key)]
    if row.empty or int(row["best_match"].iloc[0]) < 0:
        return None
    about = describe(Path(run) / FOLDER)
    excess = float(row["excess"].iloc[0])
    return {"model_b": about.get("model_b"), "run_b": about.get("run_b"), "layer": layer,
            "key": int(row["best_match"].iloc[0]), "correlation": float(row["correlation"].iloc[0]),
            "excess": excess, "universal": excess > EXCESS_CUT}


def describe(folder: str | Path) -> dict:
    """compare.json of a written comparison; a missing or damaged one is refused naming the file."""
    path = Path(folder) / "compare.json"
    try:
        about = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FfkvError(f"{path} cannot be read ({type(error).__name__}); run `ffkv compare` again") from error
    if not isinstance(about, dict):
        raise FfkvError(f"{path} is not a compare description (a JSON object); run `ffkv compare` again")
    return about
