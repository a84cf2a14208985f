"""One held-out pass per analyze: composition, refinement and suppressed read the same forward pass
(`ffkv.experiments.heldout.read_held_out`), and each reads from it exactly what its own pass gave it."""

from __future__ import annotations

import numpy as np
import pytest

from support.experiment_runs import make_run
from support.helpers import loaded_tiny
from ffkv.experiments import analyze
from ffkv.experiments.common import RunContext, eval_spec, open_run
from ffkv.experiments.heldout import EvalReader, active_threshold, capture_eval, held_out_rows
from ffkv.experiments.composition import LatentReader
from ffkv.experiments.suppressed import KnowingReader, LatentKnowingReader, capture
from ffkv.store.run import RunDir


def _context(run, loaded, steps=()):
    _, manifest, _ = open_run(run, loaded)
    ctx = RunContext(RunDir(run), manifest, loaded, eval_spec=eval_spec(manifest, None, None, 40, 0), progress=False)
    ctx.steps = tuple(steps)
    return ctx


def _n_batches(ctx) -> int:
    return sum(1 for _ in ctx.batches(held_out_rows(ctx)))


def _count_forwards(monkeypatch, view) -> list[int]:
    calls = [0]
    forward = view.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(view, "forward", counted)
    return calls


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_pass_serves_every_reader_with_what_its_own_pass_gives(tmp_path, monkeypatch, family):
    run, loaded = make_run(tmp_path, family, n=80, loaded=loaded_tiny(family, bos=(family == "llama")))
    alone_eval = capture_eval(_context(run, loaded))
    alone_knowing = capture(_context(run, loaded))
    shared = _context(run, loaded, steps=("composition", "refinement", "suppressed"))
    active_threshold(shared)  # the active rule's own pass (a signed model's) comes first, outside the count
    calls = _count_forwards(monkeypatch, loaded.view)
    together_eval = capture_eval(shared)
    passes = calls[0]
    together_knowing = capture(shared)
    assert calls[0] == passes > 0  # suppressed read the pass composition ran: no forward of its own
    assert passes == _n_batches(shared)
    for name in ("n_active", "ff_top", "ff_matches", "post_matches", "final", "partner"):
        np.testing.assert_array_equal(getattr(together_eval, name), getattr(alone_eval, name))
    for name, value in alone_knowing.items():
        np.testing.assert_array_equal(together_knowing[name], value)
    # and the latents' readers of composition and suppressed, which read nothing on a run without latents
    assert set(shared._shared["held_out_pass"]) == {EvalReader, KnowingReader, LatentReader, LatentKnowingReader}


def test_a_failing_co_reader_stays_its_own_steps_failure(tmp_path, monkeypatch):
    run, loaded = make_run(tmp_path, "gpt2", n=60, loaded=loaded_tiny("gpt2"))
    ctx = _context(run, loaded, steps=("composition", "suppressed"))

    def broken(self, idx, state):
        raise RuntimeError("planted")

    monkeypatch.setattr(KnowingReader, "read", broken)
    assert capture_eval(ctx).final.shape == (len(ctx.held_out().examples),)  # composition's pass finishes
    with pytest.raises(RuntimeError, match="planted"):  # suppressed then runs its own pass and fails there
        capture(ctx)


def test_analyze_runs_the_held_out_pass_once_for_its_three_readers(tmp_path, monkeypatch):
    run, loaded = make_run(tmp_path, "gpt2", n=80, loaded=loaded_tiny("gpt2"))
    ctx = _context(run, loaded)
    n_batches = _n_batches(ctx)
    calls = _count_forwards(monkeypatch, loaded.view)
    analyze(run, only="composition,refinement,suppressed", loaded=loaded, n_eval=40, progress=False)
    assert loaded.view.signed  # GELU: the active rule's scale takes a coefficient-only pass of its own
    assert calls[0] == 2 * n_batches  # that pass and one held-out pass; none of suppressed's own


def test_the_lookups_read_the_values_scan_and_write_what_their_own_scan_writes(tmp_path, monkeypatch):
    """`analyze --only values,lookups` projects each layer's values once per sign (the values experiment's scan of
    direction +1 is the lookups'); the explorer's tables it writes are those `--only lookups` writes alone."""
    import pandas as pd

    from ffkv.experiments import common, lookups as lookup_step

    run, loaded = make_run(tmp_path, "llama", n=80, loaded=loaded_tiny("llama", bos=True))
    analyze(run, only="lookups", loaded=loaded, n_eval=40, progress=False)
    cache = RunDir(run).cache_dir
    alone = {name: pd.read_parquet(cache / name) for name in ("value_top_tokens.parquet", "key_stats.parquet")}
    scans: list[tuple[int, int]] = []

    def counted(view, layer, projection, targets, **kwargs):
        scans.append((layer, kwargs.get("sign", 1)))
        return scan(view, layer, projection, targets, **kwargs)

    scan = common.scan_values
    monkeypatch.setattr(common, "scan_values", counted)
    monkeypatch.setattr(lookup_step, "scan_values", counted)
    analyze(run, only="values,lookups", loaded=loaded, n_eval=40, progress=False)
    n_layers = loaded.view.n_layers
    assert sorted(scans) == sorted((layer, sign) for layer in range(n_layers) for sign in (1, -1))
    for name, table in alone.items():
        pd.testing.assert_frame_equal(pd.read_parquet(cache / name), table)
