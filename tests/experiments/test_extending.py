"""docs/extending.md's first python block is a complete experiment that runs as written, from a file outside the
package, through the real pipeline: `ffkv index`, `ffkv analyze --plugin`, `ffkv report --plugin`, the explorer's
layer page. And the registry itself: findings by exact name, needs ordered and checked, plugins only on request."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from ffkv.errors import FfkvError
from ffkv.experiments import registry
from ffkv.experiments.registry import Experiment, Finding, Result
from ffkv.models import loading
from ffkv.store.run import RunDir
from support import tiny_cli
from support.cli_runs import run as ffkv
from support.helpers import loaded_tiny
from support.runs import corpus_lines

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def first_python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "elsewhere" / "value_norms.py"
    path.parent.mkdir()
    path.write_text(first_python_block(DOC.read_text()))
    yield path
    registry.unregister("value_norms")


def test_the_documented_experiment_runs_as_written_through_the_real_pipeline(tmp_path, plugin_file, capsys,
                                                                             monkeypatch):
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines()) + "\n")
    run = tmp_path / "run"
    assert ffkv(capsys, "index", "--model", "tiny-gpt2", "--corpus", corpus, "--unit", "line", "--out", run,
                "--top-k", 5, "--no-progress")[0] == 0
    code, out, err = ffkv(capsys, "analyze", run, "--plugin", plugin_file, "--only", "value_norms,lookups",
                          "--no-progress")
    assert code == 0, err
    assert "value_norms" in out
    rd = RunDir(run)
    # Its table in metrics/, equal to the norms computed here from the model's own weights.
    keys = rd.read_metric("value_norms_keys")
    view = loaded_tiny("gpt2").view  # the model `--model tiny-gpt2` loads (seeded)
    for layer in range(view.n_layers):
        expected = torch.linalg.vector_norm(view.values(layer).double(), dim=-1).numpy()
        got = keys[keys.layer == layer].sort_values("key")["value_norm"].to_numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert len(keys) == view.n_layers * view.d_m
    assert rd.metric_description("value_norms_keys")["statistic"].startswith("the L2 norm")
    # Its figure, drawn by its pure draw and saved by analyze, PNG and SVG, recorded by name.
    assert sorted(p.name for p in rd.figures_dir.glob("value_norms*")) == ["value_norms.png", "value_norms.svg"]
    assert rd.manifest().analyses["value_norms"]["figures"] == ["value_norms"]
    assert rd.manifest().analyses["value_norms"]["tables"] == ["value_norms", "value_norms_keys"]
    # Its section in the report: the title, the finding by exact name, the reading sentence.
    code, _, err = ffkv(capsys, "report", run, "--plugin", plugin_file)
    assert code == 0, err
    page = (run / "report.html").read_text()
    section = page[page.index('id="analysis-value_norms"'):]
    section = section[:section.index("</section>")]
    assert "Value norms: how long each memory&#39;s value vector is (a plugin)" in section
    assert "bounds how far one memory can move" in section and "In this model the mean value norm" in section
    assert "metrics/value_norms.parquet" in section
    # Its per-key table listed, without the claim that ffkv's docs describe a plugin's rows.
    assert "metrics/value_norms_keys.parquet" in section and "run-directory.md" not in section
    # Its column on the explorer's layer page, sortable, with the table's numbers.
    with TestClient(base_url="http://127.0.0.1:8000", app=_app(run)) as client:
        r = client.get("/layer/1?sort=value norm&order=desc")
        assert r.status_code == 200, r.text[:300]
    text = html.unescape(r.text)
    assert "‖v‖" in text
    top = keys[keys.layer == 0].sort_values(["value_norm", "key"], ascending=[False, True]).iloc[0]
    assert f'href="/memory/1/{int(top.key)}"' in r.text


def _app(run):
    from ffkv.explorer import create_app

    return create_app(run)


def test_a_run_never_names_code_to_run(tmp_path, plugin_file, capsys, monkeypatch):
    """Without --plugin the experiment is unknown, whatever the run holds: a run directory makes no code run."""
    assert "value_norms" not in registry.experiments()
    with pytest.raises(FfkvError, match="unknown experiment 'value_norms'"):
        registry.get("value_norms")
    registry.load_plugin(plugin_file)
    assert registry.load_plugin(plugin_file) is registry.get("value_norms")  # named twice: imported once
    registry.unregister("value_norms")
    assert "value_norms" not in registry.experiments()


def test_a_new_table_never_inherits_another_experiments_finding():
    # main's prefix rule gave values_spread Figure 4's finding (it starts with "values").
    assert registry.paper_finding("values_spread") is None
    assert registry.paper_finding("values")["figure"] == "Figure 4"
    # named by its experiment (values_negative: the signed twin of Figure 4, beyond the paper)
    assert registry.paper_finding("values_negative_keys")["figure"] == "Beyond the paper, beside Figure 4"
    spread = Experiment(name="values_spread", title="t", section="s", order=30, compute=lambda ctx, options: Result(),
                        findings={"values_spread": Finding("Elsewhere", "its own")})
    registry.register(spread)
    try:
        assert registry.paper_finding("values_spread")["finding"] == "its own"
        assert registry.experiment_of("values_spread") == "values_spread"
        assert registry.paper_finding("values")["figure"] == "Figure 4"
    finally:
        registry.unregister("values_spread")
    with pytest.raises(FfkvError, match="does not own"):  # an experiment cannot state another's finding
        Experiment(name="spread", title="t", section="s", order=30, compute=lambda ctx, options: Result(),
                   findings={"values_spread": Finding("x", "y")})


def _experiment(name, order, needs=(), after=()):
    return Experiment(name=name, title=name, section="s", order=order, compute=lambda ctx, options: Result(),
                      needs=needs, after=after)


def test_steps_run_in_the_order_their_needs_allow():
    every = {e.name: e for e in (_experiment("a", 1), _experiment("b", 2, needs=("c",)), _experiment("c", 3),
                                 _experiment("d", 4, after=("a",)), _experiment("e", 0, after=("d",)))}
    assert registry.ordered(["b"], every) == ["c", "b"]  # a need joins the steps, first
    assert registry.ordered(["d", "a"], every) == ["a", "d"]
    assert registry.ordered(["e", "d"], every) == ["d", "e"]  # after: only between named steps
    assert registry.ordered(["e"], every) == ["e"]
    # ffkv's own: the order analyze has always run them in, but that latents_beside reads explanation_scores's
    # latent table (it computes nothing: moving it first changes no result)
    assert registry.ordered(list(registry.experiments())) == [
        "patterns", "ablations", "values", "translators", "composition", "refinement", "census", "vocabulary_classes",
        "confidence_neurons", "suppressed", "membership", "explanation_scores", "latents_beside", "pruning", "lookups"]


def test_a_cycle_or_an_unknown_need_is_refused_with_one_line():
    cycle = {e.name: e for e in (_experiment("a", 1, needs=("b",)), _experiment("b", 2, needs=("a",)))}
    with pytest.raises(FfkvError, match="cycle: a -> b -> a|cycle: b -> a -> b"):
        registry.ordered(["a"], cycle)
    unknown = {"a": _experiment("a", 1, needs=("zzz",))}
    with pytest.raises(FfkvError, match="unknown experiment 'zzz'"):
        registry.ordered(["a"], unknown)
    with pytest.raises(FfkvError, match="unknown experiment 'nope'"):
        registry.ordered(["nope"], unknown)


def test_an_option_an_experiment_does_not_take_is_refused():
    membership = registry.get("membership")
    assert membership.parse_options({"n": 5}).n == 5
    with pytest.raises(FfkvError, match="unknown option 'm' of experiment membership"):
        membership.parse_options({"m": 5})
    with pytest.raises(FfkvError, match="takes no options"):
        registry.get("values").parse_options({"n": 5})


def test_a_step_reads_another_steps_result_only_when_computed_on_this_runs_seed_and_held_out_set(tmp_path):
    """pruning's census criterion: used when the census is this call's, or an earlier one's on the same seed and
    held-out examples; left out, with the reason in the table's description, when it was computed on another."""
    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    run, loaded = make_run(tmp_path, "llama", n=40, top_k=3)
    rd = RunDir(run)
    analyze(run, only="census", loaded=loaded, n_eval=20, progress=False, seed=0)
    assert rd.manifest().analyses["census"]["provenance"]["seed"] == 0
    analyze(run, only="pruning", loaded=loaded, n_eval=20, progress=False, seed=0)
    assert rd.metric_description("pruning")["census"] == "used"
    assert "census" in set(rd.read_metric("pruning")["criterion"])
    analyze(run, only="pruning", loaded=loaded, n_eval=20, progress=False, seed=1)
    note = rd.metric_description("pruning")["census"]
    assert note.startswith("metrics/census.parquet not used: it was computed on another seed")  # (and so another
    assert "--only census,pruning" in note                                                # seeded held-out subset)
    assert "census" not in set(rd.read_metric("pruning")["criterion"])
    analyze(run, only="pruning", loaded=loaded, n_eval=10, progress=False, seed=0)  # another held-out set
    assert "another eval corpus" in rd.metric_description("pruning")["census"]
    analyze(run, only="census,pruning", loaded=loaded, n_eval=10, progress=False, seed=1)  # computed in this call
    assert rd.metric_description("pruning")["census"] == "used"


def test_need_runs_a_declared_need_first_and_refuses_a_result_of_another_seed(tmp_path):
    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    seen = {}

    def reads_census(ctx, options):
        seen["layers"] = len(ctx.need("census", "census_layers"))
        return Result()

    def reads_census_undeclared(ctx, options):
        ctx.need("census")
        return Result()

    run, loaded = make_run(tmp_path, "llama", n=40, top_k=3)
    registry.register(Experiment(name="reads_census", title="t", section="s", order=30, compute=reads_census,
                                 needs=("census",)))
    registry.register(Experiment(name="undeclared", title="t", section="s", order=31,
                                 compute=reads_census_undeclared))
    try:
        done = analyze(run, only="reads_census", loaded=loaded, n_eval=20, progress=False, seed=0)
        assert list(done) == ["census", "reads_census"]  # the need ran first, in the same call
        assert seen["layers"] == loaded.view.n_layers
        with pytest.raises(FfkvError, match=r"^undeclared needs census: it was computed on another seed.* than this "
                                            r"call's; run `ffkv analyze .* --only census,undeclared`$"):
            analyze(run, only="undeclared", loaded=loaded, n_eval=20, progress=False, seed=3)
    finally:
        registry.unregister("reads_census")
        registry.unregister("undeclared")


def test_every_experiment_is_on_the_step_contract():
    """compute(ctx, options) -> Result and a pure draw(result) -> figures: no experiment writes its own tables,
    figures or record (analyze does, `run_step`), and none is left on the former run(ctx)."""
    import dataclasses
    import inspect

    for name, experiment in registry.builtin().items():
        assert list(inspect.signature(experiment.compute).parameters)[:2] == ["ctx", "options"], name
        if experiment.draw is not None:
            assert list(inspect.signature(experiment.draw).parameters) == ["result"], name
        source = inspect.getsource(inspect.getmodule(experiment.compute))
        for writer in ("ctx.write_table(", "ctx.record(", "save_figure(", "def run(ctx"):
            assert writer not in source, f"{name} calls {writer}"
    assert "run" not in {f.name for f in dataclasses.fields(Experiment)}


def test_analyze_saves_what_draw_returns_and_removes_the_figures_it_no_longer_draws(tmp_path):
    """A figure an earlier analyze drew for an experiment and this one does not (refinement's other projection once
    the two agree) is removed, with its record; another experiment's figures are left alone."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    both = {"on": True}

    def compute(ctx, options):
        result = Result(ctx.view.n_layers, record={"both": both["on"]})
        result.add("steps", pd.DataFrame({"layer": range(ctx.view.n_layers)}), how="by hand")
        return result

    def draw(result):
        names = ["steps", "steps_extra"] if result.record["both"] else ["steps"]
        return {name: plt.figure() for name in names}

    run, loaded = make_run(tmp_path, "llama", n=40, top_k=3)
    rd = RunDir(run)
    (rd.figures_dir).mkdir(exist_ok=True)
    rd.figure_path("stepsother", "png").write_bytes(b"another's")  # not this experiment's name: kept
    registry.register(Experiment(name="steps", title="t", section="s", order=30, compute=compute, draw=draw))
    try:
        analyze(run, only="steps", loaded=loaded, progress=False)
        assert sorted(p.name for p in rd.figures_dir.glob("steps*")) == [
            "steps.png", "steps.svg", "steps_extra.png", "steps_extra.svg", "stepsother.png"]
        assert rd.manifest().analyses["steps"]["figures"] == ["steps", "steps_extra"]
        assert rd.metric_description("steps")["how"] == "by hand"
        both["on"] = False
        analyze(run, only="steps", loaded=loaded, progress=False)
        assert sorted(p.name for p in rd.figures_dir.glob("steps*")) == ["steps.png", "steps.svg", "stepsother.png"]
        assert rd.manifest().analyses["steps"]["figures"] == ["steps"]
        # A table named for another experiment is refused, not written over that experiment's.
        registry.register(Experiment(name="stepping", title="t", section="s", order=31,
                                     compute=lambda ctx, options: Result(tables={"steps": pd.DataFrame()})))
        with pytest.raises(FfkvError, match="made the table 'steps', a name it does not own"):
            analyze(run, only="stepping", loaded=loaded, progress=False)
        assert rd.metric_description("steps")["how"] == "by hand"
    finally:
        registry.unregister("steps")
        registry.unregister("stepping")
    assert not plt.get_fignums()  # every figure drawn was closed
