"""A run's DuckDB database (RUN/explorer/explorer.duckdb) opened as a file someone else may have made.

DuckDB reads files by itself: a view or macro stored in a database can call ``read_text('/some/file')``,
``read_csv`` or ``ATTACH``, and ``read_only=True`` does not stop it. Every connection ffkv opens on a run's
database (`open_database`) switches DuckDB's file access off and locks its configuration, so that no query,
stored or sent, can switch it back; and before the connection is handed out, the database must hold the
tables ffkv writes with their columns, and nothing else that runs (no views, no macros): one line naming the
file otherwise (`DamagedRun`). ffkv's own writes (`ffkv.experiments.lookups.build_database`) build a new file
from the run's Parquet tables and never open an existing one; they, and ffkv's in-memory queries of those tables,
may read exactly the files they name (`confine`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import duckdb

from ffkv.errors import DamagedRun

#: What a connection on a run's database may do: no files, no extensions, settings fixed.
SAFE_CONFIG = {"enable_external_access": False, "lock_configuration": True}
#: The tables of explorer.duckdb (`ffkv.experiments.lookups.build_database`) and the columns ffkv reads of each.
EXPLORER_TABLES: dict[str, tuple[str, ...]] = {
    "texts": ("example_id", "token_ids", "text"),
    "triggers": ("layer", "key", "direction", "rank", "coefficient", "example_id", "position", "next_token_id",
                 "last_token_id", "m_start", "m_length", "m_offset"),
    "triggers_by_example": ("example_id", "layer", "key", "direction", "rank", "coefficient", "position",
                            "last_token_id"),
}
#: The tables explorer.duckdb also holds for a run indexed with a sparse dictionary (``key``: the latent).
LATENT_TABLES: dict[str, tuple[str, ...]] = {
    "latent_triggers": ("layer", "key", "rank", "coefficient", "example_id", "position", "next_token_id",
                        "last_token_id", "m_start", "m_length", "m_offset"),
    "latent_triggers_by_example": ("example_id", "layer", "key", "rank", "coefficient", "position", "last_token_id"),
}


#: The command that writes explorer.duckdb again, for a refusal that cannot name the run.
REBUILD = "rebuild it with `ffkv analyze RUN --only lookups`"


def open_database(path: str | Path, fix: str = REBUILD, tables: Mapping[str, tuple[str, ...]] = EXPLORER_TABLES
                  ) -> duckdb.DuckDBPyConnection:
    """A read-only connection on the database at `path` that can read nothing beyond it.

    Args:
        tables: the tables it must hold, each with the columns its readers use (more columns are allowed).
        fix: the command that writes the database again, for the refusal's line.

    Raises:
        DamagedRun: not a DuckDB database, a table or column missing, or a view or macro stored in it.
    """
    path = Path(path)
    try:
        con = duckdb.connect(str(path), read_only=True, config=dict(SAFE_CONFIG))
    except duckdb.Error as error:
        raise DamagedRun(f"{path} is damaged (not a DuckDB database ffkv can open: "
                         f"{str(error).splitlines()[0][:120]}): {fix}") from None
    try:
        why = _foreign(con, tables)
    except duckdb.Error as error:
        why = f"its catalog cannot be read: {str(error).splitlines()[0][:120]}"
    if why is not None:
        con.close()
        raise DamagedRun(f"{path} is damaged ({why}): {fix}")
    return con


def confine(con: duckdb.DuckDBPyConnection, files: Sequence[str | Path] = (),
            directories: Sequence[str | Path] = ()) -> duckdb.DuckDBPyConnection:
    """A connection ffkv opened itself (a new database, or none) that reads a run's Parquet tables: it may read
    exactly `files` and use `directories` (a spill folder), then its other file access is switched off and its
    configuration locked (`SAFE_CONFIG`), as on a run's database, so that no query it runs reaches another file."""
    con.execute("SET allowed_paths = ?", [[str(f) for f in files]])
    con.execute("SET allowed_directories = ?", [[str(d) for d in directories]])
    for name, value in SAFE_CONFIG.items():
        con.execute(f"SET {name} = {str(value).lower()}")
    return con


def _foreign(con: duckdb.DuckDBPyConnection, tables: Mapping[str, tuple[str, ...]]) -> str | None:
    """What in the database ffkv did not write, or None."""
    views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
    if views:
        return f"it holds view(s) ffkv never writes: {', '.join(views[:3])}"
    macros = [r[0] for r in con.execute("SELECT DISTINCT function_name FROM duckdb_functions() "
                                        "WHERE NOT internal").fetchall()]
    if macros:
        return f"it holds function(s) ffkv never writes: {', '.join(macros[:3])}"
    found: dict[str, set[str]] = {}
    for table, column in con.execute("SELECT table_name, column_name FROM duckdb_columns() "
                                     "WHERE NOT internal").fetchall():
        found.setdefault(table, set()).add(column)
    for table, columns in tables.items():
        if table not in found:
            return f"it lacks the table {table}"
        lacking = [c for c in columns if c not in found[table]]
        if lacking:
            return f"its table {table} lacks the column(s) {', '.join(lacking)}"
    return None


__all__ = ["EXPLORER_TABLES", "LATENT_TABLES", "REBUILD", "SAFE_CONFIG", "confine", "open_database"]
