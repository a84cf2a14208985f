"""The README's Library section runs as written, offline, and gives what its comments say."""

from __future__ import annotations

import inspect
import re
import resource
from pathlib import Path

import pandas as pd

README = Path(__file__).resolve().parent.parent / "README.md"


def library_block() -> str:
    section = README.read_text().split("## Library", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Library section holds one Python block"
    return blocks[0]


def test_the_library_section_runs_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    namespace: dict = {}
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    exec(compile(library_block(), str(README), "exec"), namespace)  # noqa: S102 - the README is ours
    print(f"README Library block: {resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu:.0f} s of CPU")

    run = namespace["run"]
    assert (tmp_path / "runs" / "library" / "manifest.json").exists()
    assert {"patterns", "values", "composition", "refinement"} <= set(run.metrics)
    assert namespace["values"].equals(pd.read_parquet(run.path / "metrics" / "values.parquet"))
    triggers = namespace["triggers"]
    te = pd.read_parquet(run.path / "trigger_examples.parquet").query("layer == 3 and key == 17")
    assert triggers["example_id"].tolist() == te.sort_values("rank")["example_id"].tolist() and len(triggers) == 5
    assert triggers["text"].str.len().min() > 0
    tokens = namespace["tokens"]
    assert list(tokens["end"].unique()) == ["top", "bottom"] and "p" in tokens.columns
    assert "Memory 4:17" in namespace["memory"]._repr_html_()  # rendered: layers counted from 1
    traced = namespace["traced"]
    assert traced.edited is not None and traced.generation["n"] == 10
    assert "with interventions" in traced._repr_html_()
    m = namespace["m"]
    assert tuple(m.shape[::2]) == (1, namespace["view"].d_m)


def test_the_demos_step_line_names_every_step_it_runs_and_what_it_leaves_out():
    """Issue 43: the demo's step line named 9 analyses, then analyze ran 12. Issue 44: the demo leaves some
    default steps out to end within 2 minutes, and says which and how to add them."""
    from ffkv.demo import DEMO_N_EVAL, LEFT_OUT, analyze_steps, demo_steps, left_out_line, run_demo
    from ffkv.experiments.registry import default_names, experiments

    assert set(LEFT_OUT) <= set(default_names())
    for every_step in (False, True):
        line, names = analyze_steps(every_step), demo_steps(every_step)
        named = [n for n in experiments() if re.search(rf"\b{n}\b", line)]
        assert set(named) <= set(names) and f"({len(names)} steps)" in line
        assert all(n in named or experiments()[n].section == "the explorer" for n in names)
    assert demo_steps(True) == default_names()
    assert demo_steps(False) == [n for n in default_names() if n not in LEFT_OUT]
    said = left_out_line("runs/demo")
    assert all(n in said for n in LEFT_OUT) and "`ffkv analyze runs/demo --only pruning --n-eval 1000`" in said
    # The command reads the held-out verses the demo read, as the demo recorded them: the demo gives analyze no
    # eval corpus (the run's own, ffkv-tiny's held-out split), and so does the command line it prints.
    from ffkv.cli import build_parser

    command = said.split("`")[1].split()[1:]
    args = build_parser().parse_args(command)
    assert (args.only, args.eval_corpus, args.eval_split, args.n_eval) == ("pruning", None, None, DEMO_N_EVAL)
    assert "eval_corpus=None" in inspect.getsource(run_demo)
    assert left_out_line("runs/demo", every_step=True) is None
