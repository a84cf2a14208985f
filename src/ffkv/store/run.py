"""The run directory: one per model and corpus, readable without ffkv (docs/definitions.md).

`RunDir` names every path of the contract (docs/run-directory.md) and is the one way
the rest of ffkv reads and writes a run:

    RUN/manifest.json                what was run, on what, with which versions; status (`Manifest`)
    RUN/examples.parquet             example_id, token_ids, text
    RUN/trigger_examples.parquet     layer, key, direction, rank, coefficient, example_id, position, next_token_id
    RUN/metrics/NAME.parquet         tables of `ffkv analyze` (`read_metric`, `write_metric`)
    RUN/figures/NAME.{png,svg}       figures of `ffkv analyze`
    RUN/annotations/labels.parquet   human pattern labels (`ffkv.store.annotations`)
    RUN/explorer/                    the explorer's derived lookup tables (a cache)
    RUN/report.html                  `ffkv report`
    RUN/.partial/                    checkpoints of an unfinished run (removed when complete)
    RUN/.lock                        held by the one process that writes the run (`lock`), naming it
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from ffkv.errors import DamagedRun, FfkvError, StorageError, one_line
from ffkv.store import atomic, integrity, ranges, schemas
from ffkv.store.lock import Holder, exclusive, now_iso
from ffkv.store.manifest import FORMAT_VERSION, Identity, Manifest, Process

if TYPE_CHECKING:  # pandas is imported where a table is read: `ffkv index` never needs it
    import pandas as pd

#: The writer lock's file (`RunDir.lock`); it alone does not make a folder "not empty".
LOCK_NAME = ".lock"

#: Key of a metrics table's schema metadata that holds how it was computed (JSON).
DESCRIPTION_KEY = integrity.DESCRIPTION_KEY
#: Where a run's memories come from: the model's own keys, or a sparse dictionary's latents (`read_triggers`).
SOURCES = ("neurons", "latents")


class RunDir:
    """A run directory on disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        try:
            manifest = self.manifest() if self.exists() else None
        except FfkvError:
            manifest = None
        if manifest is None:
            return f"RunDir({str(self.path)!r}, no run)"
        m = manifest.model
        return (f"RunDir({str(self.path)!r}, {manifest.status}: {m.id}, {m.n_layers} layers x {m.d_m} memories, "
                f"top-{manifest.top_k}, {len(self.metric_names())} metrics tables)")

    # ---------------------------------------------------------------- paths
    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def partial(self) -> Path:
        """Folder for checkpoints and table parts of an unfinished run."""
        return self.path / ".partial"

    def table(self, name: str) -> Path:
        """Path of a top-level table: ``examples`` or ``trigger_examples``."""
        return self.path / f"{name}.parquet"

    @property
    def metrics_dir(self) -> Path:
        return self.path / "metrics"

    def metric_path(self, name: str) -> Path:
        """RUN/metrics/NAME.parquet."""
        return self.metrics_dir / f"{name}.parquet"

    @property
    def figures_dir(self) -> Path:
        return self.path / "figures"

    def figure_path(self, name: str, fmt: str = "png") -> Path:
        """RUN/figures/NAME.FMT (png or svg)."""
        return self.figures_dir / f"{name}.{fmt}"

    @property
    def annotations_path(self) -> Path:
        """RUN/annotations/labels.parquet: human pattern labels of the model's neurons."""
        return self.labels_path("neurons")

    def labels_path(self, source: str = "neurons") -> Path:
        """Where the human pattern labels of one source of memories lie: RUN/annotations/labels.parquet for the
        neurons, RUN/annotations/latent_labels.parquet for the latents of the run's dictionary (the same schema;
        ``key`` is the latent)."""
        if source not in SOURCES:
            raise FfkvError(f"unknown source of memories {source!r}; choose from {', '.join(SOURCES)}")
        return self.path / "annotations" / ("labels.parquet" if source == "neurons" else "latent_labels.parquet")

    @property
    def cache_dir(self) -> Path:
        """RUN/explorer: lookup tables derived from the run (rebuilt when the index changes)."""
        return self.path / "explorer"

    @property
    def report_path(self) -> Path:
        return self.path / "report.html"

    @property
    def lock_path(self) -> Path:
        """RUN/.lock: held by the process that writes the run; records its pid, host, command and start."""
        return self.path / LOCK_NAME

    # ------------------------------------------------------------- writers
    @contextmanager
    def lock(self, command: str, create: bool = False) -> Iterator[Holder]:
        """Be the one writer of this run for the block, or raise `RunLocked` naming the writer.

        Args:
            command: the ffkv command that writes (`index`, `analyze`, ...), recorded in the lock.
            create: create the run directory when missing (`ffkv index`, `merge`); otherwise
                a missing directory is an error.

        Temporary files that a killed writer left behind are removed once the lock is held.
        """
        if create:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise StorageError(f"cannot create the run directory {self.path} ({error.strerror}): "
                                   "choose another --out") from None
        elif not self.path.is_dir():
            raise FfkvError(f"{self.path} is not an ffkv run directory (no such folder); run `ffkv index` first")
        with exclusive(self.lock_path, command, f"run {self.path}") as holder:
            self.clean_temporary()
            yield holder

    def clean_temporary(self) -> None:
        """Remove what a killed writer may have left: temporary files of atomic writes, and the
        checkpoints of a run that completed. Only the lock holder may call it."""
        complete = False
        try:
            complete = self.exists() and self.manifest().complete
        except FfkvError:
            pass
        if complete and self.partial.is_dir():
            shutil.rmtree(self.partial, ignore_errors=True)
        for folder in (self.path, self.partial, self.metrics_dir, self.figures_dir, self.cache_dir,
                       self.annotations_path.parent, self.path / "translators"):
            atomic.clean_stale(folder)

    # ------------------------------------------------------------- manifest
    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> Manifest:
        """The manifest, or a clear error when this is not a run directory or it cannot be read."""
        if not self.path.exists():
            raise FfkvError(f"{self.path}: no such folder (a run is the folder `ffkv index --out` writes)")
        if not self.manifest_path.exists():
            raise FfkvError(f"{self.path} is not an ffkv run directory (no manifest.json); run `ffkv index` first")
        try:
            data = json.loads(self.manifest_path.read_text())
        except OSError as exc:
            raise StorageError(f"cannot read {self.manifest_path}: {one_line(exc)}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DamagedRun(f"cannot read {self.manifest_path}: it is damaged (not JSON: {str(exc).splitlines()[0]}),"
                             " and a run cannot be read without its manifest") from None
        return Manifest.from_dict(data, str(self.manifest_path))

    def write_manifest(self, manifest: Manifest) -> None:
        """Write the manifest atomically, stamping the time it was updated."""
        manifest.updated = now_iso()
        atomic.write_json(self.manifest_path, manifest.to_dict())

    def update_manifest(self, **fields: Any) -> Manifest:
        """Read, set fields of the `Manifest`, write back atomically."""
        manifest = self.manifest()
        for name, value in fields.items():
            if not hasattr(manifest, name):
                raise AttributeError(f"a manifest has no field {name!r}")
            setattr(manifest, name, value)
        self.write_manifest(manifest)
        return manifest

    def require_complete(self) -> Manifest:
        """The manifest of a finished index whose two tables read as written, or an error saying what to do."""
        if self.path.exists() and not self.path.is_dir():
            raise FfkvError(f"{self.path} is a file; give a run directory")
        manifest = self.manifest()
        if not manifest.complete:
            raise FfkvError(
                f"run {self.path} is not complete (status {manifest.status!r}); "
                "finish it with `ffkv index ... --resume`"
            )
        for rel in self.index_tables(manifest):
            self.require_table(rel, manifest)
        return manifest

    def index_tables(self, manifest: Manifest) -> list[str]:
        """The tables the index wrote (relative paths): examples and trigger examples, and those its manifest
        records of the random-key control and of the dictionary's latents (a run indexed with ``--dictionary``
        must hold its latents' trigger examples, recorded or not)."""
        found = list(integrity.INDEX_TABLES)
        found += [rel for rel, record in manifest.tables.items()
                  if record.get("step") in integrity.INDEX_STEPS and rel not in found]
        latent = self.table("latent_trigger_examples").name
        if manifest.identity.index.get("dictionary") and latent not in found:
            found.append(latent)
        return found

    # ------------------------------------------------------------ integrity
    def require_table(self, rel: str, manifest: Manifest | None = None, verify: bool = False) -> None:
        """Raise `DamagedRun` naming the file and the command that rewrites it unless the table `rel`
        (``examples.parquet``, ``metrics/values.parquet``) reads as recorded when written
        (`ffkv.store.integrity`: its size, footer, rows, columns and own name; with `verify`, the SHA-256 of its
        bytes too, as `ffkv status --verify`)."""
        found = self.table_problem(rel, manifest, verify)
        if found is not None:
            raise DamagedRun(found.line(self.path))

    def table_problem(self, rel: str, manifest: Manifest | None = None,
                      verify: bool = False) -> integrity.Problem | None:
        """What is wrong with the table `rel` against its record (`require_table`'s check), with the command that
        rewrites it; None when it reads as written."""
        manifest = manifest or self.manifest()
        step = integrity.step_of(manifest, rel)
        return integrity.problem(self.path, rel, manifest.tables.get(rel),
                                 integrity.rewrite_command(self.path, rel, step), schemas.INDEX_EXPECTED.get(rel),
                                 verify)

    def record_table(self, manifest: Manifest, rel: str, step: str) -> None:
        """Record in `manifest` (not yet written) what the table `rel` is, just written by `step`."""
        manifest.tables[rel] = integrity.describe(self.path / rel, step)

    def record_file(self, manifest: Manifest, path: Path, step: str) -> None:
        """Record in `manifest` (not yet written) what the file `path` of the run (not a table: a figure
        RUN/figures/NAME.FMT, the translators) is, just written by `step`."""
        manifest.files[path.relative_to(self.path).as_posix()] = integrity.describe_file(path, step)

    def require_file(self, path: Path, manifest: Manifest | None = None) -> None:
        """Raise `DamagedRun` naming the file and the command that rewrites it unless the recorded file `path`
        has the size it was written with (`ffkv.store.integrity.file_problems`; an unrecorded file passes)."""
        manifest = manifest or self.manifest()
        found = integrity.file_problems(self, manifest, only=path.relative_to(self.path).as_posix())
        if found:
            raise DamagedRun(found[0].line(self.path))

    def _damaged(self, rel: str, error: BaseException, what: str = "it cannot be read") -> DamagedRun:
        """The one line for a table that passed the footer check but failed to read (or, `what`, to hold what it
        should)."""
        try:
            step = integrity.step_of(self.manifest(), rel)
        except FfkvError:
            step = None
        return DamagedRun(f"{self.path / rel} is damaged ({what}: {one_line(error)}): "
                          f"{integrity.rewrite_command(self.path, rel, step)}")

    def prepare(self, identity: Identity, resume: bool) -> Manifest | None:
        """Check that the folder can hold this run; return the existing manifest when resuming.

        Call it holding the lock (`lock`). Raises a clear error for a folder that holds a
        different run, a finished run, an unfinished run without ``--resume``, or other files.
        """
        if self.path.exists() and not self.path.is_dir():
            raise FfkvError(f"output path {self.path} is a file; give a directory for the run")
        if not self.exists():
            if resume:
                raise FfkvError(f"nothing to resume in {self.path}: no run was started there")
            # A writer killed before its first manifest leaves at most the lock and .partial/ (no
            # checkpoint: those come after the manifest); the folder is then as good as empty.
            if self.path.exists() and any(p.name not in (LOCK_NAME, self.partial.name) for p in self.path.iterdir()):
                raise FfkvError(f"output directory {self.path} is not empty and holds no ffkv run; choose a new --out")
            return None
        manifest = self.manifest()
        if not manifest.complete and manifest.format_version < FORMAT_VERSION:
            raise FfkvError(f"output directory {self.path} holds an unfinished run of an older ffkv (run format "
                            f"{manifest.format_version}; this ffkv writes {FORMAT_VERSION}), which it cannot "
                            "continue; choose a new --out")
        if not manifest.identity.same_result(identity):
            raise FfkvError(f"output directory {self.path} holds a different run (recorded there, then what was given: "
                            f"{'; '.join(manifest.identity.differences(identity)) or 'its identity'}); give the same "
                            "ones to resume it, or choose a new --out")
        if manifest.complete:
            raise FfkvError(f"output directory {self.path} already holds this run, complete; nothing to do")
        if not resume:
            raise FfkvError(f"output directory {self.path} holds {_unfinished(manifest)} of the same job; "
                            "add --resume to continue it, or choose a new --out")
        return manifest

    @contextmanager
    def writing(self, manifest: Manifest, holder: Holder, again: str) -> Iterator[None]:
        """Mark the run `running` by `holder` for the block (hold the lock); an error in it marks the
        run `failed`, with the error, and Ctrl-C `interrupted`. A filesystem error becomes one line
        that says so and how to go on (`again`: e.g. "rerun the same command with --resume")."""
        manifest.status, manifest.error = "running", None
        manifest.process = Process.of(holder)
        self.write_manifest(manifest)
        try:
            yield
        except KeyboardInterrupt:
            self._stopped(manifest, "interrupted")
            raise
        except Exception as error:
            marked = self._stopped(manifest, "failed", one_line(error))
            if isinstance(error, OSError):
                state = "is marked failed" if marked else "could not be marked failed (`ffkv status` shows it stopped)"
                raise StorageError(f"{one_line(error)}; the run in {self.path} {state}: fix that, then {again}") \
                    from error
            raise

    def heartbeat(self, manifest: Manifest) -> None:
        """Record that the writing process is alive (manifest process.heartbeat)."""
        if manifest.process is not None:
            manifest.process = replace(manifest.process, heartbeat=now_iso())
        self.write_manifest(manifest)

    def _stopped(self, manifest: Manifest, status: str, error: str | None = None) -> bool:
        """Record how the writer stopped; False when even that cannot be written (a full disk)."""
        manifest.status, manifest.error = status, error
        try:
            self.heartbeat(manifest)
        except OSError:
            return False
        return True

    # ---------------------------------------------------------- trigger table
    def read_triggers(self, direction: "schemas.Direction | str | int" = "positive", filters: list | None = None,
                      control: bool = False, source: str = "neurons") -> pd.DataFrame:
        """Rows of trigger_examples.parquet of one direction, in file order (layer, key, direction, rank).

        Args:
            direction: a `Direction` by name or integer: ``positive`` / 1 (a key's largest coefficients, the
                paper's trigger examples), ``negative`` / -1 (its most negative ones, indexed with ``--sign both``),
                or ``both``.
            filters: more pyarrow filters, e.g. ``[("layer", "=", 3)]``.
            control: read the random control memories' trigger examples instead
                (control_trigger_examples.parquet, `ffkv.memories.controls`); an error for a run indexed
                without a control.
            source: ``neurons`` (the model's keys) or ``latents`` (a sparse dictionary's, indexed with
                ``--dictionary``: latent_trigger_examples.parquet, or latent_control_trigger_examples.parquet
                with `control`); a latent's ``key`` column is its latent index. Latents have one direction
                (their activations are never negative): ``negative`` is refused for them.

        Returns:
            The table's columns, `direction` included (+1 for every row of a run of format 1 or 2,
            which predates the column).

        Raises:
            FfkvError: `direction` is unknown, or ``negative`` for a run that holds only the positive one.
        """
        if direction != "both":
            direction = schemas.Direction.parse(direction)
        if source not in SOURCES:
            raise FfkvError(f"unknown source of memories {source!r}; choose from {', '.join(SOURCES)}")
        table = ("control_" if control else "") + "trigger_examples"
        if source == "latents":
            if not self.table("latent_trigger_examples").is_file():
                raise FfkvError(f"{self.path} holds no latents: index with --dictionary PATH to index a sparse "
                                "dictionary's latents beside the model's keys")
            if direction == schemas.Direction.NEGATIVE:
                raise FfkvError("a latent's activation is never negative: latents have positive trigger examples "
                                "only")
            table = "latent_" + table
        path = self.table(table)
        if source == "latents" and not control:
            self.require_table(path.name)
        if control and not path.is_file():
            raise FfkvError(f"{self.path} holds no random-key control (indexed before ffkv indexed one, or with "
                            "--control-keys 0); index again to get it")
        if control:
            self.require_table(path.name)
        try:
            signed = "direction" in pq.read_schema(path).names
        except (pa.ArrowException, OSError) as error:
            raise self._damaged(path.name, error) from None
        if direction == schemas.Direction.NEGATIVE and not signed:
            raise FfkvError(f"{self.path} holds only the positive trigger direction (indexed before ffkv kept "
                            "both); index again to get the negative one")
        wanted = list(filters or [])
        if signed and direction != "both":
            wanted.append(("direction", "=", int(direction)))
        import pandas as pd

        try:
            df = pd.read_parquet(path, filters=wanted or None)
        except (pa.ArrowException, OSError) as error:
            raise self._damaged(path.name, error) from None
        manifest = self.manifest()
        outside = ranges.problem(ranges.spans(df), ranges.sizes(manifest, path.name), manifest.top_k)
        if outside is not None:
            raise self._damaged(path.name, ValueError(outside), "its ids lie outside the run's shape")
        if not signed:
            df.insert(list(df.columns).index("key") + 1, "direction", pd.Series(1, index=df.index, dtype="int8"))
        elif direction == schemas.Direction.NEGATIVE and not len(df) and manifest.sign != "both":
            raise FfkvError(f"{self.path} was indexed with --sign positive: it holds no negative trigger examples; "
                            "index again with --sign both")
        return df

    # --------------------------------------------------------------- metrics
    def metric_names(self) -> list[str]:
        """Names of the metrics tables present (RUN/metrics/NAME.parquet), sorted."""
        return sorted(p.stem for p in self.metrics_dir.glob("*.parquet")) if self.metrics_dir.is_dir() else []

    def has_metric(self, name: str) -> bool:
        return self.metric_path(name).is_file()

    def read_metric(self, name: str, columns: list[str] | None = None) -> pd.DataFrame:
        """A metrics table by name, checked against its record (`require_table`), or a clear error naming the
        experiment that writes it."""
        path = self.metric_path(name)
        if not path.is_file():
            manifest = self.manifest()
            step = integrity.step_of(manifest, f"metrics/{name}.parquet")
            if step is None:
                raise FfkvError(f"{self.path} has no metrics table {name!r}; run `ffkv analyze {self.path}` first")
        self.require_table(f"metrics/{name}.parquet")
        import pandas as pd

        lacking = sorted(set(columns or ()) - set(pq.read_schema(path).names))
        if lacking:
            raise self._damaged(f"metrics/{name}.parquet", ValueError(f"no column {', '.join(lacking)}"))
        try:
            return pd.read_parquet(path, columns=columns)
        except (pa.ArrowException, OSError) as error:
            raise self._damaged(f"metrics/{name}.parquet", error) from None

    def metric_description(self, name: str) -> dict[str, Any]:
        """How a metrics table was computed: the JSON in its schema metadata (empty when absent)."""
        try:
            meta = pq.read_schema(self.metric_path(name)).metadata or {}
            return json.loads(meta.get(DESCRIPTION_KEY, b"{}"))
        except (pa.ArrowException, OSError, ValueError) as error:
            raise self._damaged(f"metrics/{name}.parquet", error) from None

    def write_metric(self, name: str, table: pd.DataFrame, description: Mapping[str, Any],
                     step: str | None = None) -> Path:
        """Write RUN/metrics/NAME.parquet atomically, with `description` in its schema metadata, and record it in
        the manifest (`record_table`; `step`: the `ffkv analyze` experiment that writes it, default `name`).
        Call it holding the run's lock."""
        arrow = pa.Table.from_pandas(table.reset_index(drop=True), preserve_index=False)
        metadata = dict(arrow.schema.metadata or {})
        metadata[DESCRIPTION_KEY] = json.dumps({"name": name, **description}, default=str).encode()
        path = self.metric_path(name)
        atomic.write_parquet(path, arrow.replace_schema_metadata(metadata))
        manifest = self.manifest()
        self.record_table(manifest, f"metrics/{name}.parquet", step or name)
        self.write_manifest(manifest)
        return path

    # --------------------------------------------------------------- figures
    def figure_names(self) -> dict[str, Path]:
        """NAME -> RUN/figures/NAME.png (or .svg when there is no PNG), sorted by name."""
        found: dict[str, Path] = {}
        for path in sorted(self.figures_dir.glob("*.svg")) + sorted(self.figures_dir.glob("*.png")):
            found[path.stem] = path  # a PNG replaces the SVG of the same name
        return dict(sorted(found.items()))


def _unfinished(manifest: Manifest) -> str:
    """"an interrupted run", "a failed run (error: ...)", or "a run whose writer stopped without saving" (a
    `running` manifest read holding the lock: its process was killed or crashed)."""
    if manifest.status == "failed":
        return f"a failed run (error: {manifest.error or 'unknown'})"
    if manifest.status == "running":
        who = manifest.process.holder().describe() if manifest.process else "its writer"
        return f"a run whose writer {who} stopped without saving (killed or crashed)"
    return "an interrupted run"


__all__ = ["DESCRIPTION_KEY", "LOCK_NAME", "RunDir"]
