"""manifest.json of a run directory, typed: what was run, on what, with which versions, and its status.

The JSON layout is the public contract of docs/run-directory.md; `Manifest.from_dict`
validates it (required fields and their types, the format version, the status) and
`Manifest.to_dict` writes it back field for field. Fields this version of ffkv does not
know are kept in `extra` and written back unchanged, so an older ffkv never drops what a
newer one recorded.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from ffkv.errors import FfkvError
from ffkv.store.lock import Holder

#: Version of the run-directory contract this ffkv writes and reads (docs/run-directory.md).
FORMAT_VERSION = 3
KIND = "ffkv-run"
#: running: a process writes it (see `process`); interrupted: stopped at a checkpoint (Ctrl-C);
#: failed: stopped by an error (see `error`); complete: every table written.
STATUSES = ("running", "interrupted", "failed", "complete")


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour shapes the results."""
    import numpy
    import pyarrow
    import torch
    import transformers

    import ffkv

    return {
        "ffkv": ffkv.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
    }


class ManifestError(FfkvError):
    """A manifest.json that this ffkv cannot read: the message names the field and what to do."""


def _require(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in data:
        raise ManifestError(f"{where} lacks the field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ManifestError(f"{where}: field {name!r} should be {expected}, got {type(value).__name__}")
    return value


def _objects(data: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    """An optional field holding name -> object (`analyses`, `tables`), checked."""
    value = data.get(name) or {}
    if not isinstance(value, Mapping):
        raise ManifestError(f"{where}: field {name!r} should be dict, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, Mapping):
            raise ManifestError(f"{where}: field {name!r}: {key!r} should be dict, got {type(item).__name__}")
    return value


@dataclass(frozen=True)
class ModelInfo:
    """The analysed model's shape and kind (manifest["model"])."""

    id: str
    family: str
    n_layers: int
    d_m: int
    d_model: int
    vocab_size: int
    dtype: str
    gated: bool
    parallel: bool
    encoder: bool
    resid_mid: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "manifest.json") -> "ModelInfo":
        kinds = {"id": str, "family": str, "n_layers": int, "d_m": int, "d_model": int, "vocab_size": int,
                 "dtype": str, "gated": bool, "parallel": bool, "encoder": bool, "resid_mid": str}
        return cls(**{name: _require(data, name, kind, f"{where} model") for name, kind in kinds.items()})


@dataclass(frozen=True)
class Process:
    """The process that writes (or last wrote) a run's index (manifest["process"]).

    Attributes:
        pid, host: the process and the machine it runs on.
        command: the ffkv command (`index`, `merge`).
        started: when it started; heartbeat: when it last said it was alive (ISO 8601).
    """

    pid: int
    host: str
    command: str
    started: str
    heartbeat: str

    @classmethod
    def from_dict(cls, data: Any, where: str = "manifest.json") -> "Process":
        w = f"{where} process"
        if not isinstance(data, Mapping):
            raise ManifestError(f"{w} should be an object, got {type(data).__name__}")
        kinds = {"pid": int, "host": str, "command": str, "started": str, "heartbeat": str}
        return cls(**{name: _require(data, name, kind, w) for name, kind in kinds.items()})

    @classmethod
    def of(cls, holder: Holder) -> "Process":
        """The record of a lock holder, its heartbeat now."""
        return cls(pid=holder.pid, host=holder.host, command=holder.command, started=holder.started,
                   heartbeat=holder.started)

    def holder(self) -> Holder:
        return Holder(pid=self.pid, host=self.host, command=self.command, started=self.started)


@dataclass(frozen=True)
class Identity:
    """What defines a run's result; a run resumes only into a folder with an equal identity.

    Attributes:
        shard: (i, n) for the run of one shard of `ffkv index --shard i/n`, else None.
        batching: the batching options, recorded for shards only (they must cut the same
            batches to merge exactly); batching never changes a one-process result.
    """

    model_id: str
    weights_sha256: str
    dtype: str
    corpus: dict[str, Any]
    corpus_fingerprint: str
    index: dict[str, Any]
    shard: tuple[int, int] | None = None
    batching: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "manifest.json") -> "Identity":
        w = f"{where} identity"
        shard = data.get("shard")
        if shard is not None and (not isinstance(shard, (list, tuple)) or len(shard) != 2):
            raise ManifestError(f"{w}: field 'shard' should be [i, n], got {shard!r}")
        return cls(model_id=_require(data, "model_id", str, w), weights_sha256=_require(data, "weights_sha256", str, w),
                   dtype=_require(data, "dtype", str, w), corpus=dict(_require(data, "corpus", dict, w)),
                   corpus_fingerprint=_require(data, "corpus_fingerprint", str, w),
                   index=dict(_require(data, "index", dict, w)),
                   shard=(int(shard[0]), int(shard[1])) if shard is not None else None,
                   batching=dict(data["batching"]) if data.get("batching") is not None else None)

    def to_dict(self) -> dict[str, Any]:
        out = {"model_id": self.model_id, "weights_sha256": self.weights_sha256, "dtype": self.dtype,
               "corpus": dict(self.corpus), "corpus_fingerprint": self.corpus_fingerprint, "index": dict(self.index)}
        if self.shard is not None:
            out["shard"] = list(self.shard)
        if self.batching is not None:
            out["batching"] = dict(self.batching)
        return out

    @property
    def shard_of(self) -> tuple[int, int]:
        """(i, n): this run's shard, (0, 1) for a whole run."""
        return self.shard if self.shard is not None else (0, 1)

    def unsharded(self) -> "Identity":
        """The identity of the whole run that this shard is part of."""
        return replace(self, shard=None, batching=None)

    def differences(self, other: "Identity") -> list[str]:
        """What differs between two identities, each as the option that sets it with its two values
        ("top_k 10 (given: 5)"), the recorded one first; where the corpus lies is no difference (`same_result`)."""
        def flat(identity: "Identity") -> dict[str, Any]:
            data = identity.to_dict()
            out = {}
            for name, value in data.items():
                if isinstance(value, dict):
                    out.update({key: v for key, v in value.items() if not (name == "corpus" and key == "source")})
                elif name not in ("corpus_fingerprint", "weights_sha256"):
                    out[name] = value
            return out

        mine, theirs = flat(self), flat(other)
        found = [f"{key} {mine.get(key)!r} (given: {theirs.get(key)!r})" for key in dict.fromkeys([*mine, *theirs])
                 if mine.get(key) != theirs.get(key)]
        if self.weights_sha256 != other.weights_sha256 and self.model_id == other.model_id:
            found.append("the model's weights (their sha256)")
        if self.corpus_fingerprint != other.corpus_fingerprint and not found:
            found.append("the corpus's content (its fingerprint)")
        return found

    def same_result(self, other: "Identity") -> bool:
        """Whether two identities define the same result: equal but for where the corpus lies.

        The corpus is known by its content (`corpus_fingerprint`), so a relative and an
        absolute path, or a copy elsewhere, name the same corpus.
        """
        def key(identity: "Identity") -> dict[str, Any]:
            data = identity.to_dict()
            data["corpus"] = {k: v for k, v in data["corpus"].items() if k != "source"}
            return data
        return key(self) == key(other)


@dataclass
class Manifest:
    """A run's manifest.json (docs/run-directory.md).

    Attributes:
        identity: what defines the result (`Identity`).
        model: the model's shape (`ModelInfo`).
        corpus: the corpus options (`ffkv.corpus.CorpusSpec.to_dict`).
        index: top_k, mode, sign, and the batching used (speed only).
        versions: library versions (`library_versions`).
        status: running, interrupted, failed or complete (`STATUSES`).
        process: the process that writes the index, or last wrote it (None once complete).
        error: why the run failed (status failed), one line.
        timings: index_seconds, and more.
        counts: examples and tokens, once complete.
        analyses: per experiment of `ffkv analyze`, what it wrote and how.
        tables: per table written (path relative to the run), its size, rows, columns, sha256 and the
            step that wrote it (`ffkv.store.integrity.describe`), checked before each read.
        files: per file written that is not a table (a figure ``figures/NAME.png``, ``.svg``; the translators
            ``translators/translators.npz``, ``.json``), its size, sha256 and the step that wrote it
            (`ffkv.store.integrity.describe_file`), checked before it is read (a figure before the report embeds it).
        analyzing: while an `ffkv analyze` runs (and after one that did not finish): its ``steps``, those
            ``done``, its ``status`` (running, interrupted, failed), ``error`` and ``process``; absent after
            an analyze that finished.
        updated: when the manifest was last written (ISO 8601).
        merged_from: the shard runs a merged run was made from.
        extra: fields this ffkv does not know, kept as they were.
    """

    identity: Identity
    model: ModelInfo
    corpus: dict[str, Any]
    index: dict[str, Any]
    versions: dict[str, str] = field(default_factory=dict)
    status: str = "running"
    process: Process | None = None
    error: str | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    analyses: dict[str, dict[str, Any]] = field(default_factory=dict)
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    analyzing: dict[str, Any] | None = None
    updated: str | None = None
    merged_from: list[str] | None = None
    format_version: int = FORMAT_VERSION
    kind: str = KIND
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------ reading
    @property
    def top_k(self) -> int:
        """Trigger examples kept per key."""
        return int(self.identity.index["top_k"])

    @property
    def mode(self) -> str:
        """example (one prefix per example per key) or prefix."""
        return str(self.identity.index["mode"])

    @property
    def sign(self) -> str:
        """Trigger directions indexed: ``positive`` (largest coefficients) or ``both`` (also the most
        negative); runs of format 1 and 2 predate the option and are ``positive``."""
        return str(self.identity.index.get("sign") or "positive")

    @property
    def control_keys(self) -> int:
        """Random control memories indexed per layer (`ffkv.memories.controls`); 0 for runs indexed without
        (before ffkv indexed a control, or with ``--control-keys 0``)."""
        return int(self.identity.index.get("control_keys") or 0)

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "manifest.json") -> "Manifest":
        """Validate and type a manifest read from JSON; `where` names it in errors."""
        try:
            return cls._parse(data, where)
        except (TypeError, ValueError, AttributeError) as error:  # a field of the wrong shape, deeper down
            raise ManifestError(f"{where} cannot be read: {type(error).__name__}: {str(error).splitlines()[0]}") \
                from None

    @classmethod
    def _parse(cls, data: Mapping[str, Any], where: str) -> "Manifest":
        if not isinstance(data, Mapping):
            raise ManifestError(f"{where} should hold a JSON object, got {type(data).__name__}")
        version = _require(data, "format_version", int, where)
        if version > FORMAT_VERSION:
            raise ManifestError(f"{where} has format version {version}, newer than this ffkv reads "
                                f"({FORMAT_VERSION}); upgrade ffkv")
        if version < 1:
            raise ManifestError(f"{where} has format version {version}; versions start at 1")
        kind = data.get("kind", KIND)
        if kind != KIND:
            raise ManifestError(f"{where} is a {kind!r} file, not an ffkv run manifest")
        status = _require(data, "status", str, where)
        if status not in STATUSES:
            raise ManifestError(f"{where}: status {status!r} is not one of {', '.join(STATUSES)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        analyses = _objects(data, "analyses", where)
        tables = _objects(data, "tables", where)
        files = _objects(data, "files", where)
        analyzing = data.get("analyzing")
        if analyzing is not None and not isinstance(analyzing, Mapping):
            raise ManifestError(f"{where}: field 'analyzing' should be an object, got {type(analyzing).__name__}")
        return cls(
            identity=Identity.from_dict(_require(data, "identity", dict, where), where),
            model=ModelInfo.from_dict(_require(data, "model", dict, where), where),
            corpus=dict(_require(data, "corpus", dict, where)),
            index=dict(_require(data, "index", dict, where)),
            versions=dict(data.get("versions") or {}),
            status=status,
            process=Process.from_dict(data["process"], where) if data.get("process") is not None else None,
            error=str(data["error"]) if data.get("error") is not None else None,
            timings=dict(data.get("timings") or {}),
            counts=dict(data.get("counts") or {}),
            analyses={str(k): dict(v) for k, v in analyses.items()},
            tables={str(k): dict(v) for k, v in tables.items()},
            files={str(k): dict(v) for k, v in files.items()},
            analyzing=dict(analyzing) if analyzing is not None else None,
            updated=data.get("updated"),
            merged_from=list(data["merged_from"]) if data.get("merged_from") is not None else None,
            format_version=version,
            kind=kind,
            extra={k: v for k, v in data.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of manifest.json, in the contract's field order."""
        out: dict[str, Any] = {"format_version": self.format_version, "kind": self.kind, "status": self.status,
                               "identity": self.identity.to_dict(), "model": asdict(self.model),
                               "corpus": dict(self.corpus), "index": dict(self.index),
                               "versions": dict(self.versions), "timings": dict(self.timings)}
        if self.process is not None:
            out["process"] = asdict(self.process)
        if self.error is not None:
            out["error"] = self.error
        if self.updated is not None:
            out["updated"] = self.updated
        if self.counts:
            out["counts"] = dict(self.counts)
        if self.analyses:
            out["analyses"] = {k: dict(v) for k, v in self.analyses.items()}
        if self.tables:
            out["tables"] = {k: dict(v) for k, v in self.tables.items()}
        if self.files:
            out["files"] = {k: dict(v) for k, v in self.files.items()}
        if self.analyzing is not None:
            out["analyzing"] = dict(self.analyzing)
        if self.merged_from is not None:
            out["merged_from"] = list(self.merged_from)
        out.update(self.extra)
        return out


__all__ = ["FORMAT_VERSION", "STATUSES", "Identity", "Manifest", "ManifestError", "ModelInfo", "Process",
           "library_versions"]
