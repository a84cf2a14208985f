"""Results bought from a language model, kept as they arrive: nothing finished is lost to a kill or a failure.

A `Journal` keeps rows keyed by a column (a prompt's hash by default). Finished rows go to small atomic Parquet chunks
(RUN/journal/NAME/CHUNK.parquet, `ffkv.store.atomic`) every `every` rows or `seconds`, whichever comes
first; `close` folds the chunks into the table the command writes (a metrics table, `RunDir.write_metric`, or
a plain file) and removes them. A command killed with ``kill -9`` leaves its chunks; the next one reads them
with the table (`done`), so a resumed command sends only the prompts whose hash is not there yet.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ffkv.errors import DamagedRun, one_line
from ffkv.store import atomic
from ffkv.store.run import RunDir

#: The column every journal row is keyed by.
KEY = "prompt_sha256"


class Journal:
    """Rows keyed by a column (`KEY` by default), appended in atomic chunks, folded into one table at `close`.

    Args:
        run: the run directory (its lock held by the caller).
        name: the table's name: RUN/metrics/NAME.parquet when `metric`, else RUN/journal/NAME.parquet.
        metric: whether the folded table is a metrics table, recorded in the manifest as written by `step`.
        step: the command that writes it (``explain``, ``score``).
        key: the column that names a row (`KEY` by default).
        columns: the columns every row holds (the key among them): a chunk or table without them is not this
            journal's, and is refused before anything is asked (`DamagedRun`, naming it and how to remove it).
    """

    def __init__(self, run: RunDir, name: str, metric: bool, step: str, every: int = 8, seconds: float = 10.0,
                 key: str = KEY, columns: tuple[str, ...] = ()):
        self.run, self.name, self.metric, self.step, self.key = run, name, metric, step, key
        self.columns = tuple(dict.fromkeys((key, *columns)))
        self.every, self.seconds = every, seconds
        self.folder = run.path / "journal" / name
        self.pending: list[dict] = []
        self.last = time.monotonic()

    @property
    def table_path(self) -> Path:
        return self.run.metric_path(self.name) if self.metric else self.run.path / "journal" / f"{self.name}.parquet"

    def _read(self, path: Path) -> pd.DataFrame:
        try:
            rows = pq.read_table(path).to_pandas()
        except (pa.ArrowException, OSError) as error:
            raise DamagedRun(f"{path} is damaged ({one_line(error)}); delete it (`rm {path}`) to ask the model "
                             "again for what it held") from None
        lacking = [c for c in self.columns if c not in rows.columns]
        if lacking and (len(rows) or path.parent == self.folder):
            raise DamagedRun(f"{path} is not a table of ffkv {self.step}'s {self.name} (it lacks the column(s) "
                             f"{', '.join(lacking[:4])}); delete it (`rm {path}`) and run `ffkv {self.step}` again")
        return rows

    def done(self) -> pd.DataFrame:
        """Every row kept so far (the table's and the chunks'), one per key (the first kept)."""
        parts = [self._read(self.table_path)] if self.table_path.is_file() else []
        if self.folder.is_dir():
            atomic.clean_stale(self.folder)
            parts += [self._read(p) for p in sorted(self.folder.glob("*.parquet"))]
        parts = [p for p in parts if len(p)]
        if not parts:
            return pd.DataFrame({self.key: pd.Series(dtype=str)})
        rows = pd.concat(parts, ignore_index=True)
        return rows.drop_duplicates(self.key, keep="first").reset_index(drop=True)

    def add(self, row: Mapping[str, Any]) -> None:
        """Keep one finished row (written with the next chunk)."""
        self.pending.append(dict(row))
        if len(self.pending) >= self.every or time.monotonic() - self.last >= self.seconds:
            self.flush()

    def flush(self) -> None:
        """Write the rows not yet written as one atomic chunk."""
        self.last = time.monotonic()
        if not self.pending:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        chunk = pa.Table.from_pandas(pd.DataFrame(self.pending), preserve_index=False)
        atomic.write_parquet(self.folder / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet", chunk)
        self.pending = []

    def close(self, description: Mapping[str, Any], order: Callable[[pd.DataFrame], pd.DataFrame] | None = None) \
            -> pd.DataFrame:
        """Flush, fold every row into the table (atomically), remove the chunks; the table's rows. With no row at
        all (the first request failed) nothing is written: a table of no rows would read as a finished one."""
        self.flush()
        rows = self.done()
        if order is not None:
            rows = order(rows)
        if not len(rows):
            return rows
        if self.metric:
            self.run.write_metric(self.name, rows, description, step=self.step)
        else:
            self.table_path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_parquet(self.table_path, pa.Table.from_pandas(rows, preserve_index=False))
        for chunk in sorted(self.folder.glob("*.parquet")) if self.folder.is_dir() else ():
            chunk.unlink()
        return rows


__all__ = ["KEY", "Journal"]
