"""The run contract: manifest.json round trips field for field, is versioned, and is validated with
messages that name the field."""

from __future__ import annotations

import json
import re

import pytest

from ffkv.errors import DamagedRun, FfkvError
from ffkv.store import atomic, schemas
from ffkv.store.manifest import FORMAT_VERSION, Identity, Manifest, ManifestError, ModelInfo, Process
from ffkv.store.run import RunDir


def _manifest(**changes) -> Manifest:
    index = {"top_k": 5, "mode": "example"}
    base = Manifest(
        identity=Identity(model_id="m", weights_sha256="abc", dtype="float32", corpus={"source": "c.txt", "unit": "line"},
                          corpus_fingerprint="f", index=index),
        model=ModelInfo(id="m", family="GPT-2", n_layers=3, d_m=40, d_model=16, vocab_size=97, dtype="float32",
                        gated=False, parallel=False, encoder=False, resid_mid="sequential"),
        corpus={"source": "c.txt", "unit": "line"}, index={**index, "batching": {"batch_size": 4}},
        versions={"ffkv": "0.1.0"}, timings={"index_seconds": 1.5})
    for name, value in changes.items():
        setattr(base, name, value)
    return base


def test_round_trip_through_the_run_directory(tmp_path):
    run = RunDir(tmp_path)
    written = _manifest(status="complete", counts={"examples": 3, "tokens": 9},
                        analyses={"values": {"tables": ["values"], "seconds": 0.1}})
    run.write_manifest(written)
    read = run.manifest()
    assert read == written and read.updated is not None
    data = json.loads(run.manifest_path.read_text())
    assert data["format_version"] == FORMAT_VERSION and data["kind"] == "ffkv-run"
    assert list(data)[:9] == ["format_version", "kind", "status", "identity", "model", "corpus", "index", "versions",
                              "timings"]
    assert Manifest.from_dict(data).to_dict() == data  # field for field
    assert read.top_k == 5 and read.mode == "example" and read.complete


def test_unknown_fields_are_kept_and_shards_round_trip(tmp_path):
    run = RunDir(tmp_path)
    shard = _manifest(identity=Identity(model_id="m", weights_sha256="abc", dtype="float32", corpus={},
                                        corpus_fingerprint="f", index={"top_k": 5, "mode": "example"},
                                        shard=(1, 4), batching={"batch_size": 4}))
    data = shard.to_dict()
    data["written_by_a_newer_minor"] = {"x": 1}
    run.manifest_path.write_text(json.dumps(data))
    again = run.manifest()
    assert again.identity.shard == (1, 4) and again.identity.shard_of == (1, 4)
    assert again.identity.unsharded().shard is None and again.identity.unsharded().batching is None
    run.update_manifest(status="interrupted")
    assert json.loads(run.manifest_path.read_text())["written_by_a_newer_minor"] == {"x": 1}
    with pytest.raises(AttributeError):
        run.update_manifest(no_such_field=1)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("model"), "lacks the field 'model'"),
    (lambda d: d["model"].pop("d_m"), "model lacks the field 'd_m'"),
    (lambda d: d["model"].update(n_layers="3"), "'n_layers' should be int"),
    (lambda d: d["model"].update(gated=1), "'gated' should be bool"),
    (lambda d: d["identity"].pop("weights_sha256"), "identity lacks the field 'weights_sha256'"),
    (lambda d: d["identity"].update(shard=[1]), "'shard' should be \\[i, n\\]"),
    (lambda d: d.update(status="done"), "status 'done' is not one of"),
    (lambda d: d.update(format_version=FORMAT_VERSION + 1), "newer than this ffkv reads"),
    (lambda d: d.update(format_version=0), "versions start at 1"),
    (lambda d: d.update(kind="other"), "not an ffkv run manifest"),
    (lambda d: d.update(analyses=[1]), "'analyses' should be dict"),
])
def test_validation_names_the_field(tmp_path, change, message):
    data = _manifest().to_dict()
    change(data)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message):
        RunDir(tmp_path).manifest()


def test_unreadable_and_missing_manifests(tmp_path):
    with pytest.raises(FfkvError, match="not an ffkv run directory"):
        RunDir(tmp_path).manifest()
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(FfkvError, match="cannot read"):
        RunDir(tmp_path).manifest()
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ManifestError, match="JSON object"):
        RunDir(tmp_path).manifest()


def test_prepare_and_require_complete(tmp_path):
    run = RunDir(tmp_path / "run")
    identity = _manifest().identity
    assert run.prepare(identity, resume=False) is None
    with pytest.raises(FfkvError, match="nothing to resume"):
        run.prepare(identity, resume=True)
    run.write_manifest(_manifest(status="interrupted"))
    with pytest.raises(FfkvError, match="add --resume"):
        run.prepare(identity, resume=False)
    assert run.prepare(identity, resume=True).status == "interrupted"
    other = Identity(**{**identity.__dict__, "weights_sha256": "other"})
    with pytest.raises(FfkvError, match="different run"):
        run.prepare(other, resume=True)
    with pytest.raises(FfkvError, match="not complete"):
        run.require_complete()
    run.update_manifest(status="complete")
    with pytest.raises(DamagedRun, match="examples.parquet is missing.*index the corpus again"):
        run.require_complete()  # a complete run is read only with its two tables
    for name, schema in (("examples", schemas.EXAMPLES), ("trigger_examples", schemas.TRIGGER_EXAMPLES)):
        atomic.write_parquet(run.table(name), schema.empty_table())
    assert run.require_complete().complete
    with pytest.raises(FfkvError, match="already holds this run"):
        run.prepare(identity, resume=True)


def test_process_and_error_round_trip_and_are_validated(tmp_path):
    run = RunDir(tmp_path)
    process = Process(pid=12, host="h", command="index", started="2026-01-01T00:00:00+0000",
                      heartbeat="2026-01-01T00:01:00+0000")
    written = _manifest(status="failed", process=process, error="No space left on device (x.parquet)")
    run.write_manifest(written)
    assert run.manifest() == written
    data = json.loads(run.manifest_path.read_text())
    assert data["process"]["pid"] == 12 and data["error"].startswith("No space")
    data["process"]["pid"] = "twelve"
    with pytest.raises(ManifestError, match="process: field 'pid' should be int"):
        Manifest.from_dict(data)
    assert "process" not in _manifest(status="complete").to_dict()


def test_unfinished_runs_say_why_without_resume(tmp_path):
    run = RunDir(tmp_path / "run")
    identity = _manifest().identity
    process = Process(pid=12, host="h", command="index", started="s", heartbeat="b")
    for manifest, words in [(_manifest(status="failed", error="No space left on device"),
                             "holds a failed run (error: No space left on device) of the same job; add --resume"),
                            (_manifest(status="running", process=process),
                             "holds a run whose writer `ffkv index` (pid 12 on h, since s) stopped without saving "
                             "(killed or crashed) of the same job; add --resume")]:
        run.write_manifest(manifest)
        with pytest.raises(FfkvError, match=re.escape(words)):
            run.prepare(identity, resume=False)
        assert run.prepare(identity, resume=True).status == manifest.status
    moved = Identity(**{**identity.__dict__, "corpus": {**identity.corpus, "source": "/elsewhere/c.txt"}})
    assert moved.same_result(identity) and moved != identity  # a corpus is known by its fingerprint
    assert run.prepare(moved, resume=True) is not None
