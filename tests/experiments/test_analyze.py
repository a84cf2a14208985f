"""`analyze`: every experiment on one run, what it records, and errors that say what to do."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from support.experiment_runs import make_run
from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.experiments import EXPERIMENTS, analyze
from ffkv.experiments.common import eval_spec
from ffkv.experiments.registry import experiments as registered
from ffkv.experiments.registry import paper_finding, reading
from ffkv.store.run import RunDir

FIGURES = ("patterns", "ablations", "values", "values_rank", "composition", "composition_active",
           "refinement", "refinement_agreement", "refinement_confidence")
#: The paper's experiments, each a metrics table ("lookups" writes RUN/explorer/, tested in test_lookups.py).
#: membership needs the model's training split: skipped here (noted in the manifest), tested in test_membership.py;
#: "pruning", beyond the paper, is not per layer: tests/experiments/test_pruning.py; "latents_beside" writes nothing
#: for a run without a dictionary (this one): tests/experiments/test_latents_beside.py.
STUDIES = tuple(name for name in EXPERIMENTS if name not in ("lookups", "membership", "pruning", "latents_beside"))
#: Studies whose NAME.parquet is not per layer (the census: one row per key), and their per-layer table.
PER_LAYER = {"census": "census_layers"}


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_every_experiment_writes_tables_figures_and_manifest(tmp_path, family):
    run, loaded = make_run(tmp_path, family, n=50, top_k=5)
    done = analyze(run, loaded=loaded, n_eval=20, progress=False)
    assert list(done) == list(EXPERIMENTS)
    for name in FIGURES:
        if family == "bert" and name == "ablations":  # does not carry over to an encoder (test_encoders.py)
            continue
        for fmt in ("png", "svg"):
            assert (run / "figures" / f"{name}.{fmt}").stat().st_size > 0
        assert paper_finding(name) is not None
    assert not list(run.rglob("*.tmp"))  # atomic writes leave no temporary files
    manifest = json.loads((run / "manifest.json").read_text())
    assert set(manifest["analyses"]) == set(EXPERIMENTS)
    assert "skipped" in manifest["analyses"]["membership"]
    assert manifest["analyses"]["refinement"]["projections"] == {"choice": "default", "values_and_sub_updates": "identity",
                                                                   "residuals": "final-norm"}
    # The fidelity table: one row per measured finding, each with its rule and verdict.
    table = pd.read_parquet(run / "metrics" / "fidelity.parquet")
    assert {"Figure 4", "Figure 7", "Figure 8", "Figure 9", "Figure 11"} <= set(table["figure"])
    assert table["rule"].str.len().min() > 20 and str(table["reproduces"].dtype) == "boolean"
    # n = 20 examples: no verdict on any held-out finding, each row naming the fix.
    held_out = table[table["table"].isin(["composition", "refinement", "refinement_projections"])]
    assert held_out["reproduces"].isna().all()
    assert held_out["verdict"].str.contains("pass --eval-corpus or --eval-split all").all()
    assert manifest["analyses"]["composition"]["held_out_overlaps_index"] is True  # indexed split "all"
    for name in STUDIES:
        if not registered()[name].applies(loaded.view.encoder):  # does not carry over to an encoder: said so
            assert "skipped" in manifest["analyses"][name]
            continue
        table = pd.read_parquet(run / "metrics" / f"{name}.parquet")
        layers = pd.read_parquet(run / "metrics" / f"{PER_LAYER.get(name, name)}.parquet")
        assert list(layers["layer"]) == list(range(loaded.view.n_layers))
        assert reading(name, table)
    for name in ("composition_examples", "refinement_examples"):
        assert {"example_id", "position", "layer"} <= set(pd.read_parquet(run / "metrics" / f"{name}.parquet").columns)
    for name in ("patterns_keys", "values_keys") + (("ablations_prefixes",) if family != "bert" else ()):
        assert {"layer", "key"} <= set(pd.read_parquet(run / "metrics" / f"{name}.parquet").columns)


def test_projection_choice_is_recorded_everywhere(tmp_path):
    run, loaded = make_run(tmp_path, "gpt_neo", n=40)
    analyze(run, only=["values", "refinement"], projection="identity", loaded=loaded, n_eval=10, progress=False)
    assert RunDir(run).metric_description("refinement")["residual_projection"] == "identity"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["analyses"]["values"]["projections"]["residuals"] == "identity"
    analyze(run, only="values", projection="final-norm", loaded=loaded, progress=False)
    assert RunDir(run).metric_description("values")["projection"] == "final-norm"
    assert set(json.loads((run / "manifest.json").read_text())["analyses"]) == {"values", "refinement"}


def test_errors_say_what_to_do(tmp_path):
    with pytest.raises(FfkvError, match="not an ffkv run directory"):
        analyze(tmp_path, progress=False)
    run, loaded = make_run(tmp_path / "r", "gpt2", n=30)
    with pytest.raises(FfkvError, match="unknown experiment 'valuez' in only=; did you mean 'values'"):
        analyze(run, only="values,valuez", loaded=loaded, progress=False)
    with pytest.raises(FfkvError, match="unknown experiment 'pattern' in only=; did you mean 'patterns'"):
        analyze(run, only="pattern", loaded=loaded, progress=False)
    with pytest.raises(FfkvError, match="unknown experiment 'zzz' in only=; choose from"):
        analyze(run, only="zzz", loaded=loaded, progress=False)
    with pytest.raises(FfkvError, match="unknown projection"):
        analyze(run, only="values", projection="layer-norm", loaded=loaded, progress=False)
    with pytest.raises(FfkvError, match="--n-eval"):
        analyze(run, only="composition", n_eval=0, loaded=loaded, progress=False)
    (tmp_path / "other.txt").write_text("\n")
    with pytest.raises(FfkvError):
        analyze(run, only="composition", eval_corpus=CorpusSpec(source=str(tmp_path / "other.txt")), loaded=loaded,
                progress=False)


def test_eval_spec(tmp_path):
    run, _ = make_run(tmp_path, "gpt2", n=20)
    manifest = RunDir(run).manifest()
    assert eval_spec(manifest).split == "heldout"
    other = eval_spec(manifest, str(tmp_path / "corpus.txt"), "train")
    assert other.split == "train" and other.unit == "line"
    assert eval_spec(manifest, n_eval=7).max_examples == 7 and eval_spec(manifest, other).source == other.source


def test_warnings_speak_the_words_of_what_the_user_runs(fresh_run, capsys, monkeypatch):
    """Issue 43: the README's Library block printed `FfkvWarning: composition: ... pass --eval-corpus or --eval-split
    all (and --n-eval)` (flags, not the function's arguments), followed by an echoed line of ffkv's own source. A
    warning raised through the library names the arguments and is attributed to the caller's line; through the
    command line, it names the flags."""
    import warnings

    import ffkv
    from ffkv import cli
    from ffkv.errors import FfkvWarning

    run, loaded = fresh_run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ffkv.analyze(ffkv.open_run(run, loaded), only="composition", n_eval=20, progress=False)
    ours = [w for w in caught if issubclass(w.category, FfkvWarning)]
    assert ours, "composition on 20 examples warns about its n"
    text = str(ours[0].message)
    assert 'pass eval_corpus= or eval_split="all" (and n_eval=)' in text and "--eval-corpus" not in text
    assert all(w.filename == __file__ for w in ours), [w.filename for w in ours]  # never a line of ffkv's
    from ffkv.models import loading
    from support import tiny_cli

    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    assert cli.main(["analyze", str(run), "--only", "composition", "--n-eval", "20", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "ffkv: warning: composition:" in err and "pass --eval-corpus or --eval-split all (and --n-eval)" in err
    assert "eval_corpus=" not in err


def test_a_study_left_out_is_recorded_with_why_and_status_lists_it(tmp_path, capsys):
    """`ffkv demo` leaves the pruning curves out: analyze records them as skipped with the demo's reason, and
    `ffkv status` lists them with it (not run, not silently absent). The steps run are counted without it (a new
    user saw [11/13] followed by [13/13])."""
    from ffkv.store.state import run_state

    run, loaded = make_run(tmp_path)
    capsys.readouterr()
    done = analyze(run, only=["values", "pruning", "census"], left_out={"pruning": "left out here: why"},
                   progress=True, loaded=loaded)
    counted = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("analyze [")]
    assert counted == ["[1/2]", "[2/2]"]
    assert done["pruning"] == {"skipped": "left out here: why"} and "tables" in done["values"]
    assert RunDir(run).manifest().analyses["pruning"]["skipped"] == "left out here: why"
    assert "  skipped: pruning: left out here: why" in run_state(run).lines()
    assert not RunDir(run).has_metric("pruning")
