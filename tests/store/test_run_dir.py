"""RunDir names every path of the contract and reads metrics tables by name; annotations live in the store."""

from __future__ import annotations

import pandas as pd
import pytest

from ffkv.errors import FfkvError
from ffkv.store.annotations import Annotations, consensus, read_labels
from ffkv.store.manifest import Identity, Manifest, ModelInfo
from ffkv.store.run import RunDir


def test_every_path_of_the_contract(tmp_path):
    run = RunDir(tmp_path)
    assert run.manifest_path == tmp_path / "manifest.json" and run.table("examples") == tmp_path / "examples.parquet"
    assert run.metric_path("values") == tmp_path / "metrics" / "values.parquet"
    assert run.figure_path("values", "svg") == tmp_path / "figures" / "values.svg"
    assert run.annotations_path == tmp_path / "annotations" / "labels.parquet"
    assert run.cache_dir == tmp_path / "explorer" and run.report_path == tmp_path / "report.html"
    assert run.partial == tmp_path / ".partial"
    assert "no run" in repr(run)


def test_metrics_round_trip_with_their_description(tmp_path):
    run = RunDir(tmp_path)
    run.write_manifest(Manifest(
        identity=Identity(model_id="m", weights_sha256="abc", dtype="float32", corpus={}, corpus_fingerprint="f",
                          index={"top_k": 5, "mode": "example"}),
        model=ModelInfo(id="m", family="GPT-2", n_layers=3, d_m=40, d_model=16, vocab_size=97, dtype="float32",
                        gated=False, parallel=False, encoder=False, resid_mid="sequential"),
        corpus={}, index={}, status="complete"))
    assert run.metric_names() == [] and not run.has_metric("values")
    with pytest.raises(FfkvError, match="no metrics table 'values'.*ffkv analyze"):
        run.read_metric("values")
    table = pd.DataFrame({"layer": [0, 1], "agreement_rate": [0.0, 0.5]})
    run.write_metric("values", table, {"projection": "identity"})
    assert run.metric_names() == ["values"] and run.has_metric("values")
    pd.testing.assert_frame_equal(run.read_metric("values"), table)
    assert run.metric_description("values") == {"name": "values", "projection": "identity"}
    assert list(run.read_metric("values", columns=["layer"]).columns) == ["layer"]
    record = run.manifest().tables["metrics/values.parquet"]  # what it was when written, for every later read
    assert record["rows"] == 2 and record["step"] == "values" and record["size"] == run.metric_path("values").stat().st_size
    assert record["columns"] == {"layer": "int64", "agreement_rate": "double"} and len(record["sha256"]) == 64


def test_figures_prefer_png(tmp_path):
    run = RunDir(tmp_path)
    run.figures_dir.mkdir()
    for name in ("b.svg", "b.png", "a.svg"):
        (run.figures_dir / name).write_bytes(b"x")
    assert {k: v.name for k, v in run.figure_names().items()} == {"a": "a.svg", "b": "b.png"}


def test_annotations_upsert_persist_and_agree(tmp_path):
    store = Annotations(tmp_path)
    store.save(1, 2, "shallow", "ends with 'of'", "ann")
    store.save(1, 2, "semantic", "places", "ann")
    store.save(1, 2, "both", "", "bob")
    store.save(1, 3, "none", "", "bob")
    table = read_labels(tmp_path)
    assert len(table) == 3 and set(table.annotator) == {"ann", "bob"}
    assert Annotations(tmp_path).of(1, 2)[0]["label"] in ("semantic", "both")
    assert list(table.columns) == ["layer", "key", "label", "description", "annotator", "time"]
    assert str(pd.read_parquet(RunDir(tmp_path).annotations_path).layer.dtype) == "int16"
    agreed = consensus(table).set_index(["layer", "key"])["human_label"]
    assert agreed[(1, 2)] == "both" and agreed[(1, 3)] == "none"  # a tie goes to the alphabetically first
    with pytest.raises(FfkvError, match="unknown label"):
        store.save(0, 0, "deep")
    assert consensus(read_labels(tmp_path / "none")).empty
