"""`ffkv analyze`: run the paper's experiments on a complete run directory.

Each experiment declares ``compute(ctx, options) -> Result`` and a pure ``draw(result) -> figures``
(`ffkv.experiments.registry`); `run_step` writes what they return, the same way for every experiment:
RUN/metrics/NAME*.parquet with their descriptions, RUN/figures/NAME*.{png,svg}, and the record in
manifest['analyses']. They share one `RunContext`: the model is
loaded once, value projections made by `values` are reused by `composition`, and
`composition` and `refinement` read the same single forward pass over the held-out
examples. What was run, with which projection, is merged into manifest['analyses'].

Under torchrun (`torchrun --nproc-per-node N -m ffkv.cli analyze RUN`) the call opens one
process group; each rank runs its share of every forward pass and of the values scan,
every rank then holds what one process computes (`ffkv.parallel`), and rank
0 alone writes the tables, figures and manifest: the same as one process writes.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ffkv import threads
from ffkv.allocator import release
from ffkv.experiments import latent_kinds, registry
from ffkv.experiments.common import Projections, RunContext, check_only, eval_spec, open_run, text_measured
from ffkv.experiments.encoders import applicability_table, skipped_reason
from ffkv.experiments.fidelity import write_fidelity
from ffkv.errors import DamagedRun, FfkvError, one_line
from ffkv.memories.sets import refuse_unused_dictionary
from ffkv.parallel import is_writer, local_device, process_group, wait_for_writer
from ffkv.store import integrity
from ffkv.store.run import RunDir


def analyze(
    run_dir: str | Path,
    only: Sequence[str] | str | None = None,
    eval_corpus: Any = None,
    eval_split: str | None = None,
    n_eval: int = 4000,
    projection: str | None = None,
    progress: bool = True,
    loaded: Any = None,
    device: str = "cpu",
    dtype: str | None = None,
    seed: int = 0,
    options: dict[str, dict] | None = None,
    dictionary_at: str | Path | None = None,
    left_out: Mapping[str, str] | None = None,
) -> dict[str, dict]:
    """Run experiments on a complete run and add their tables and figures to it.

    Args:
        run_dir: a run directory written by `ffkv index`.
        only: experiment names (or "a,b") to run; default every registered experiment but the optional ones,
            which run only when named (``only="translators"``). They run in the order their declared needs
            allow (`ffkv.experiments.registry.ordered`).
        eval_corpus: the held-out examples: None for the run's own corpus (split "heldout"),
            a corpus path (read with the run's unit options), or a `CorpusSpec` (or its dict).
            Always cut to a seeded subset of `n_eval` (`ffkv.experiments.common.eval_spec`).
        eval_split: the split of `eval_corpus` (default: heldout for the run's corpus, all for another).
        n_eval: number of held-out examples (docs/definitions.md: 4,000).
        projection: None or "default" for ffkv's defaults (docs/definitions.md) (identity for values, sub-updates and
            Figure 8's FF outputs; final normalization for residual-stream vectors and for every
            vector of Figures 9-11), "paper" for the released code's choices (identity for every
            vector, the raw residual with no final normalization), or "identity" / "final-norm"
            for every vector. Figures 9-11 are also computed under the other residual projection
            (metrics/refinement_projections.parquet) and drawn when they differ.
        progress: show progress bars.
        loaded: the run's model, already loaded (else loaded from manifest['model']['id']).
        device, dtype: where and how to load the model when `loaded` is not given (under
            torchrun "cuda" means each rank's own GPU, cuda:LOCAL_RANK).
        seed: seeds key samples and held-out positions.
        options: experiment name -> its own options, e.g. {"membership": {"member_corpus": A,
            "nonmember_corpus": B, "n": 1000}}. An experiment with a ``skip_reason(ctx)`` that gives a
            reason is skipped with a note when it was not named in `only`, and refused (the reason as the
            error) when it was.
        dictionary_at: where the sparse dictionary the run was indexed with lies now, if its files moved
            (`ffkv.dictionaries.reopen`: checked to be the same files); default: where the run records it.
        left_out: experiments of the call not to run, each with why: recorded as skipped with that reason (as
            `ffkv status` lists them), as `ffkv demo` leaves a slow one out.

    Returns:
        name -> what each experiment recorded (tables, figures, projection, options).
    """
    every = registry.experiments()
    for name in dict(options or {}):  # an option of no experiment, or one it does not take, is refused
        registry.get(name).parse_options((options or {})[name])
    names = (registry.ordered(check_only(only, tuple(every))) if only is not None else registry.default_names())
    projections = Projections.choose(projection)
    run = RunDir(run_dir)
    recorded = run.require_complete()
    refuse_damaged(run, recorded, names)  # before the model loads
    refuse_unused_dictionary(recorded.index.get("dictionary"), dictionary_at, run.path)
    run, manifest, loaded = open_run(run_dir, loaded, local_device(device), dtype)
    spec = eval_spec(manifest, eval_corpus, eval_split, n_eval, seed) if any(every[n].held_out for n in names) else None
    ctx = RunContext(run, manifest, loaded, projections=projections, progress=progress, seed=seed, eval_spec=spec,
                     n_eval=n_eval, options=dict(options or {}), dictionary_at=dictionary_at)
    ctx.steps = tuple(names)  # what a step's skip_reason may count on this call to compute (before it runs)
    skipped = {name: why for name in names if (why := (left_out or {}).get(name) or skip_reason(name, ctx))}
    ctx.steps = tuple(name for name in names if name not in skipped)
    asked = [name for name in skipped if name not in (left_out or {})]
    if asked and only is not None:  # asked for by name: refused before anything runs
        why = skipped[asked[0]]
        raise FfkvError(why if why.startswith(asked[0]) else f"{asked[0]}: {why}")
    # One writer of the run at a time (rank 0 of a torchrun job writes; the group is not open yet).
    lock = run.lock("analyze") if int(os.environ.get("RANK", "0")) == 0 else nullcontext()
    with lock as holder, process_group(loaded.view.device), progress_record(run, holder, names, skipped):
        if progress and spec is not None and is_writer():
            print(f"analyze: held-out text: {text_measured(spec)}", flush=True)
        for name in names:
            if name in skipped:  # not asked for by name: skipped, with the reason kept in the manifest
                ctx.analyses[name] = {"skipped": skipped[name]}
                continue
            start = time.perf_counter()
            if progress and is_writer():  # which step, of the steps run; each step's own bar shows its time left
                print(f"analyze [{ctx.steps.index(name) + 1}/{len(ctx.steps)}] {name}", flush=True)
            run_step(ctx, every[name])
            ctx.analyses[name]["seconds"] = round(time.perf_counter() - start, 3)
            if holder is not None:
                step_done(run, name)
        if loaded.view.encoder:
            ctx.write_table("encoder_applicability", applicability_table(),
                            note="which of the paper's figures apply to a masked-LM encoder, and why "
                                 "(ffkv.experiments.encoders)")
        if ctx.has_latents:
            ctx.write_table("latent_applicability", latent_kinds.applicability_table(),
                            note="which studies read the dictionary's latents beside the neurons, and why the "
                                 "others do not (ffkv.experiments.latent_kinds)")
        if spec is not None:
            held = ctx.held_out()
            indexed = manifest.identity.corpus
            for name in (n for n in names if every[n].held_out and n not in skipped):
                ctx.analyses[name]["held_out_overlaps_index"] = (
                    spec.source == indexed.get("source") and indexed.get("split", "all") in ("all", "heldout"))
                ctx.analyses[name]["n_examples"] = len(held.examples)
        if is_writer():
            write_fidelity(run)
            current, ran_with = run.manifest().analyses, threads.current()
            for name, info in ctx.analyses.items():
                current[name] = {**info, "projections": projections.to_dict(), "seed": seed, "threads": ran_with,
                                 "provenance": ctx.provenance(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            run.update_manifest(analyses=current, analyzing=None)
    return ctx.analyses


def run_step(ctx: RunContext, experiment: registry.Experiment) -> registry.Result:
    """One experiment's step: its ``compute`` with its options; then its tables written (atomically, with their
    descriptions), its figures drawn and saved (PNG + SVG, atomically; rank 0 alone under torchrun), the figures
    an earlier analyze drew for it and this one did not removed, and what it records kept for the manifest."""
    ctx.step = experiment.name
    try:
        result = experiment.compute(ctx, experiment.parse_options(ctx.options.get(experiment.name)))
        if not isinstance(result, registry.Result):
            raise FfkvError(f"experiment {experiment.name}: compute returned {type(result).__name__}, not a Result")
        check_names(experiment.name, result.tables, "table")
        for table, df in result.tables.items():
            ctx.write_table(table, df, **result.meta.get(table, {}))
        figures = save_figures(ctx.run, experiment, result) if is_writer() else []
        ctx.record(experiment.name, **{"tables": list(result.tables), "figures": figures, **result.record})
        wait_for_writer()  # a later step that reads these tables from disk (pruning the census) finds them on every rank
    finally:
        ctx.step = None
        release()  # what the step freed goes back to the system before the next one (`ffkv.allocator`)
    return result


def save_figures(run: RunDir, experiment: registry.Experiment, result: registry.Result) -> list[str]:
    """Draw `result` and save each figure as RUN/figures/NAME.{png,svg}; remove those the run's record of the
    experiment lists and this draw did not make (e.g. a projection's figures no longer shown). Returns the names."""
    from ffkv.experiments.figures import plt, save_figure

    drawn = dict(experiment.draw(result)) if experiment.draw is not None else {}
    written: list[Path] = []
    try:
        check_names(experiment.name, drawn, "figure")
        for name, figure in drawn.items():
            written += save_figure(figure, run.path, name)
    finally:  # none left open when one fails to save
        for figure in drawn.values():
            plt.close(figure)
    manifest = run.manifest()
    for path in written:  # each figure is recorded as a table is: `ffkv status` and the report check it
        run.record_file(manifest, path, experiment.name)
    before = manifest.analyses.get(experiment.name) or {}
    for name in before.get("figures") or ():
        stem = str(name).removesuffix(".png").removesuffix(".svg")
        if stem not in drawn and registry.experiment_of(stem) == experiment.name:
            for fmt in ("png", "svg"):
                run.figure_path(stem, fmt).unlink(missing_ok=True)
                manifest.files.pop(f"figures/{stem}.{fmt}", None)
    run.write_manifest(manifest)
    return list(drawn)


def check_names(experiment: str, names, kind: str) -> None:
    """Refuse a table or figure an experiment does not own: its names are NAME and NAME_* (its files never stand
    in for another experiment's)."""
    for name in names:
        if name != experiment and not str(name).startswith(experiment + "_"):
            raise FfkvError(f"experiment {experiment} made the {kind} {name!r}, a name it does not own (its tables "
                            f"and figures are {experiment} and {experiment}_*)")


def refuse_damaged(run: RunDir, manifest, steps: Sequence[str]) -> None:
    """Refuse, before anything runs, a run with a damaged table that this call would read and not rewrite:
    every metrics table but those of `steps` (the fidelity table reads them all; pruning the census), and the
    human labels where `patterns` runs (its agreement with them)."""
    for found in integrity.survey(run, manifest):
        if found.state == "damaged" and found.path.startswith("annotations/") and "patterns" in steps:
            raise DamagedRun(f"{found.line(run.path)} (`ffkv analyze --only patterns` reads it)")
        if found.state != "damaged" or not found.path.startswith("metrics/"):
            continue
        step = integrity.step_of(manifest, found.path)
        if step not in steps and step not in integrity.EVERY_ANALYZE:
            raise DamagedRun(f"{found.line(run.path)} (this analyze reads it; or add {step} to --only)")


@contextmanager
def progress_record(run: RunDir, holder, names: Sequence[str], skipped: Mapping[str, str]) -> Iterator[None]:
    """Keep the manifest's `analyzing` while the steps run (their names, those done: `step_done`), marked
    interrupted or failed if they stop; `ffkv status` names an analyze that did not finish (kill -9 leaves
    it `running`, with its lock free). `holder` is None where this process does not write (torchrun rank > 0)."""
    if holder is None:
        yield
        return
    steps = [name for name in names if name not in skipped]
    process = {"pid": holder.pid, "host": holder.host, "command": holder.command, "started": holder.started}
    run.update_manifest(analyzing={"status": "running", "steps": steps, "done": [], "process": process})
    try:
        yield
    except BaseException as error:
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        try:
            info = dict(run.manifest().analyzing or {})
            run.update_manifest(analyzing={**info, "status": status, "error": one_line(error)})
        except (OSError, FfkvError):
            pass  # a full disk: the record stays `running`, which `ffkv status` reads as cut off
        raise


def step_done(run: RunDir, name: str) -> None:
    """Record in the manifest's `analyzing` that step `name` finished."""
    info = dict(run.manifest().analyzing or {})
    info["done"] = [*info.get("done", []), name]
    run.update_manifest(analyzing=info)


def skip_reason(name: str, ctx: RunContext) -> str | None:
    """Why experiment `name` cannot run on this run (None when it can): it does not apply to a masked-LM encoder
    (`ffkv.experiments.encoders`), or the module's own ``skip_reason(ctx)`` (e.g. membership without a known
    training split). The one rule `analyze` skips (not named) or refuses (named in `only`) by."""
    experiment = registry.get(name)
    if not experiment.applies(ctx.view.encoder):
        return skipped_reason(name)
    return experiment.skip_reason(ctx) if experiment.skip_reason is not None else None

