"""`ffkv train-dictionary --resume` from a checkpoint someone else made: a real training interrupted with Ctrl-C,
its checkpoint then changed in one entry. Each such checkpoint is refused before any of it is used, in one line
(exit 2) that names the file and the entry: an optimizer moment of the wrong size or strides (which the
fused Adam kernel would write out of bounds), a weight of the wrong shape, a missing layer, a firing record of
the wrong size, counts that are text or negative, NaN weights (refused before a step trains on them, nothing
written). An
untouched checkpoint resumes, and one made under another thread count says that its bytes may differ."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ffkv.models import loading
from support import tiny_cli
from support.cli_runs import error_line, run

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
WORDS = "the a of and to in is was he she it they king lord house land water fire came went said saw".split()


def _args(corpus: Path, out: Path) -> list[str]:
    return ["train-dictionary", "--model", "tiny-gpt2", "--corpus", str(corpus), "--unit", "line", "--layers", "1,3",
            "--expansion-factor", "4", "-k", "4", "--skip", "--tokens", "30000", "--batch-size", "8",
            "--eval-tokens", "2000", "--checkpoint-seconds", "0", "--no-progress", "--out", str(out)]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """(corpus, the folder of a training of layers 1 and 3 stopped by Ctrl-C after a few steps, its checkpoint
    loaded as torch loads it)."""
    import random

    folder = tmp_path_factory.mktemp("interrupted")
    rng = random.Random(0)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(1500)))
    out = folder / "out"
    checkpoint = out / "checkpoint.pt"

    def press_ctrl_c():  # once the first checkpoint is written: the run stops at the end of the step in flight
        deadline = time.time() + 300
        while not checkpoint.exists() and time.time() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
        presser = threading.Thread(target=press_ctrl_c)
        presser.start()
        from ffkv import cli

        code = cli.main(_args(corpus, out))
        presser.join()
    assert code == 130 and not (out / "training.json").exists()
    saved = torch.load(checkpoint, weights_only=True)
    assert 0 < saved["tokens_done"] < 30000
    return corpus, out, saved


@pytest.fixture
def tiny_gpt2(monkeypatch):
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])


def _crafted(interrupted, tmp_path: Path, change) -> tuple[Path, Path]:
    """(corpus, a copy of the interrupted folder whose checkpoint `change` altered in place)."""
    corpus, out, _ = interrupted
    copy = Path(shutil.copytree(out, tmp_path / "out"))
    saved = torch.load(copy / "checkpoint.pt", weights_only=True)
    change(saved)
    torch.save(saved, copy / "checkpoint.pt")
    return corpus, copy


def _set(path: tuple, value):
    def change(saved):
        *parents, last = path
        for key in parents:
            saved = saved[key]
        saved[last] = value(saved[last]) if callable(value) else value
    return change


CRAFTED = {
    "a weight of the wrong shape": (_set(("transcoders", 0, "decoder"), torch.zeros(64, 15)),
                                    "transcoders[0].decoder has shape (64, 15), not (64, 16)"),
    "a missing layer": (lambda saved: saved["transcoders"].pop(2), "transcoders lacks 2"),
    "a layer too many": (lambda saved: saved["fired"].update({1: saved["fired"][0]}), "fired holds unexpected 1"),
    "a firing record of the wrong size": (_set(("fired", 2), torch.zeros(63, dtype=torch.bool)),
                                          "fired[2] has shape (63,), not (64,)"),
    "a firing record of numbers": (_set(("fired", 2), lambda t: t.float()),
                                   "fired[2] is torch.float32, not torch.bool"),
    "examples done as text": (_set(("examples_done",), "12"), "examples_done is '12' (str), not a count"),
    "negative examples done": (_set(("examples_done",), -5), "examples_done is -5 (int), not a count"),
    "a count past any slice": (_set(("examples_done",), 2 ** 64),
                               "examples_done is 18446744073709551616, more than 9223372036854775807"),
    "a bool for the step": (_set(("step",), True), "step is True (bool), not a count"),
    "NaN weights": (_set(("transcoders", 2, "encoder"), lambda t: torch.full_like(t, float("nan"))),
                    "transcoders[2].encoder holds 1024 NaN or infinite value(s)"),
    "an infinite FF output sum": (_set(("ff_out_sum", 0), lambda t: t.index_fill(0, torch.tensor([3]), float("inf"))),
                                  "ff_out_sum[0] holds 1 NaN or infinite value(s)"),
    "a negative second moment": (_set(("optimizers", 0, "state", 1, "exp_avg_sq"), lambda t: t - 1),
                                 "optimizers[0].state[1].exp_avg_sq holds 64 value(s) below 0"),
    "a step count of moments that is no whole number": (
        _set(("optimizers", 2, "state", 0, "step"), lambda t: t + 0.5),
        "optimizers[2].state[0].step holds value(s) that are not whole numbers"),
    "moments for some parameters only": (lambda saved: saved["optimizers"][0]["state"].pop(4),
                                         "optimizers[0].state lacks 4"),
    "an unfused optimizer": (_set(("optimizers", 0, "param_groups", 0, "fused"), False),
                             "optimizers[0].param_groups[0].fused is False (bool), not True (bool)"),
    "a curve row of the wrong width": (lambda saved: saved["curve"][-1].pop(), "curve[" ),
    "an FVU as text": (_set(("last_fvu", 0), "0.5"), "last_fvu[0] is '0.5' (str), not a number"),
    "a negative elapsed time": (_set(("elapsed",), -1.0), "elapsed is -1.0, below 0"),
    "an unknown entry": (_set(("extra",), 1), "the top level holds unexpected 'extra'"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_checkpoint_is_refused_in_one_line_before_training(case, interrupted, tmp_path, capsys, tiny_gpt2):
    change, expected = CRAFTED[case]
    corpus, out = _crafted(interrupted, tmp_path, change)
    before = (out / "checkpoint.pt").read_bytes()
    code, _, err = run(capsys, *_args(corpus, out), "--resume")
    line = error_line(err)
    assert code == 2, err
    assert f"the checkpoint {out / 'checkpoint.pt'} cannot be resumed: {expected}" in line, line
    assert "choose another --out" in line
    # nothing trained, nothing written: the checkpoint as it was, no transcoder folder
    assert (out / "checkpoint.pt").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt"]


#: Moments the fused Adam kernel would write out of bounds (a segfault): run in a process of their own.
OUT_OF_BOUNDS = {
    "a moment of three elements": (torch.zeros(3), "has shape (3,), not (64, 16)"),
    "a moment whose strides view one element as many": (torch.zeros(1).expand(64, 16),
                                                        "has strides (0, 0), not those of a contiguous tensor"),
}


@pytest.mark.parametrize("case", OUT_OF_BOUNDS)
def test_an_optimizer_moment_the_kernel_would_write_out_of_bounds_is_refused(case, interrupted, tmp_path):
    moment, expected = OUT_OF_BOUNDS[case]
    corpus, out = _crafted(interrupted, tmp_path, _set(("optimizers", 0, "state", 2, "exp_avg"), moment))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    done = subprocess.run([sys.executable, "-m", "support.tiny_cli", *_args(corpus, out), "--resume"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    line = error_line(done.stderr)
    assert f"checkpoint.pt cannot be resumed: optimizers[0].state[2].exp_avg {expected}" in line, line


def test_an_untouched_checkpoint_resumes_and_another_thread_count_is_told(interrupted, tmp_path, capsys, tiny_gpt2):
    corpus, out = _crafted(interrupted, tmp_path, lambda saved: None)  # torch's own load and save: the same state
    threads = torch.get_num_threads()
    recorded = interrupted[2]["arithmetic"]
    assert recorded == {"device": "cpu", "threads": threads}
    torch.set_num_threads(threads + 1)
    try:
        code, _, err = run(capsys, *_args(corpus, out), "--resume")
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err
    assert (out / "training.json").exists() and not (out / "checkpoint.pt").exists()
    warnings = [line for line in err.splitlines() if line.startswith("ffkv: warning: ")]
    assert len(warnings) == 1, err
    assert (f"was trained on the CPU with {threads} thread{'s' * (threads != 1)} (OMP_NUM_THREADS={threads}) and "
            f"continues on the CPU with {threads + 1} threads" in warnings[0]), warnings
    assert "differ in their last bits" in warnings[0]
