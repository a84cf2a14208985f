"""`ffkv train-dictionary` (ffkv.tools.train_dictionary, ffkv.dictionaries.train): the trainer learns, its
measures equal their definitions recomputed by brute force, loss recovered is 1 for a transcoder that is the
FF layer and 0 for the mean, a run killed with SIGKILL and resumed ends with the same bytes, and sparsify reads
what it writes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from ffkv.corpus import CorpusSpec, iter_examples
from ffkv.dictionaries.dictionary import Dictionary
from ffkv.dictionaries.sparsify_layout import read_sparsify
from ffkv.dictionaries.train import TopKTranscoder, TranscoderShape, learning_rate, train_step
from ffkv.errors import FfkvError, Interrupted
from ffkv.tools.train_dictionary import TrainDictionaryOptions, measure_fidelity, train_dictionaries
from support.helpers import loaded_tiny

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
WORDS = "the a of and to in is was he she it they king lord house land water fire came went said saw".split()


def _corpus(folder: Path, lines: int = 600, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path = folder / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(lines)))
    return path


def _train(loaded, corpus: Path, out: Path, **options):
    spec = CorpusSpec(source=str(corpus), unit="line", split="train", max_tokens=60)
    heldout = CorpusSpec(source=str(corpus), unit="line", split="heldout", max_tokens=60)
    opts = TrainDictionaryOptions(**{"layers": (0, 2), "expansion_factor": 4, "k": 4, "tokens": 6000,
                                     "batch_size": 16, "lr": 3e-4, "eval_tokens": 100_000, **options})
    return train_dictionaries(loaded, lambda: iter_examples(spec, loaded.tokenizer),
                              lambda: iter_examples(heldout, loaded.tokenizer), opts, out, progress=False,
                              corpus=spec.to_dict()), heldout


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    loaded = loaded_tiny("llama")
    result, heldout = _train(loaded, _corpus(folder), folder / "out")
    return loaded, result, heldout


def test_training_lowers_the_fvu_and_writes_sparsify_folders(llama_run):
    loaded, result, _ = llama_run
    curve = result.record["curve"]["rows"]
    assert len(curve) == result.record["training"]["steps"] > 10
    for column in (1, 2):
        first = sum(row[column] for row in curve[:3]) / 3
        last = sum(row[column] for row in curve[-3:]) / 3
        assert last < 0.8 * first, (column, first, last)
    for row in result.rows:
        assert row["fvu"] < 0.9
    for layer in (0, 2):
        d = read_sparsify(result.out / f"layers.{layer}.mlp")
        assert (d.kind, d.layer, d.activation, d.k, d.n_latents) == ("transcoder", layer, "topk", 4, 4 * 16)
    table = pd.read_parquet(result.out / "fidelity.parquet")
    assert list(table["layer"]) == [0, 2] and not (result.out / "checkpoint.pt").exists()


def test_fvu_and_dead_latents_equal_a_brute_force_recomputation(llama_run):
    loaded, result, heldout = llama_run
    view = loaded.view
    examples = [e for e in iter_examples(heldout, loaded.tokenizer) if len(e.token_ids) >= 2]
    for row in result.rows:
        d = read_sparsify(result.out / f"layers.{row['layer']}.mlp")
        xs, ys = [], []
        for e in examples:  # one unpadded example at a time: nothing shared with the batched pass
            with view.capture(("ff_in", "ff_out"), layers=[row["layer"]]) as cap:
                view.forward(torch.tensor([list(e.token_ids)]))
            xs.append(cap["ff_in"][row["layer"]][0])
            ys.append(cap["ff_out"][row["layer"]][0])
        x, y = torch.cat(xs).double(), torch.cat(ys).double()
        acts = d.to(dtype=torch.float64).encode(x)
        reconstruction = acts @ d.decoder.double() + d.decoder_bias.double()
        expected = float(((y - reconstruction) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())
        assert row["eval_tokens"] == len(x)
        assert row["fvu"] == pytest.approx(expected, rel=1e-4)
        assert row["dead_latents"] == int(((acts > 0).sum(0) == 0).sum())


def test_a_transcoder_that_is_the_ff_layer_recovers_all_the_loss_and_the_mean_none(tmp_path):
    # OPT's FF is relu(x·W1ᵀ + b1)·W2ᵀ + b2: a topk transcoder keeping all d_m latents is exactly that layer.
    loaded = loaded_tiny("opt")
    view = loaded.view
    examples = list(iter_examples(CorpusSpec(source=str(_corpus(tmp_path, 40)), unit="line", max_tokens=60),
                                  loaded.tokenizer))
    layer = 1
    down = view.arch.down_proj(view.blocks[layer])
    exact = Dictionary(kind="transcoder", layer=layer, encoder=view.keys(layer).detach().clone(),
                       encoder_bias=view.key_bias(layer).detach().clone(), decoder=view.values(layer).detach().clone(),
                       decoder_bias=down.bias.detach().clone(), activation="topk", k=view.d_m)
    mean = torch.randn(view.d_model)
    as_mean = Dictionary(kind="transcoder", layer=layer, encoder=torch.randn(8, view.d_model), encoder_bias=torch.zeros(8),
                         decoder=torch.zeros(8, view.d_model), decoder_bias=mean.clone(), activation="topk", k=2)
    for planted, recovered in ((exact, 1.0), (as_mean, 0.0)):
        _, (row,) = measure_fidelity(loaded, examples, {layer: planted}, {layer: mean}, eval_tokens=10_000)
        assert row["loss_mean_ablated"] > row["loss_original"]
        assert row["loss_recovered"] == pytest.approx(recovered, abs=1e-5)


def test_learning_rate_warms_up_then_decays_to_zero():
    assert learning_rate(1.0, 0, 1000) == pytest.approx(1 / 50)
    assert learning_rate(1.0, 50, 1000) == 1.0
    assert learning_rate(1.0, 1000, 1000) == 0.0


def test_a_step_on_fixed_activations_lowers_the_fvu():
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = torch.relu(x @ torch.randn(16, 48)) @ torch.randn(48, 16)
    t = TopKTranscoder(16, TranscoderShape(4, 8, skip=True), seed=1)
    opt = torch.optim.Adam(t.parameters(), lr=1e-2)
    t.initialise_biases(x, y)
    losses = [train_step(t, opt, x, y, 1e-2)[0] for _ in range(60)]
    assert losses[0] == pytest.approx(1.0, abs=1e-3)  # zero decoder, mean bias: the mean's FVU
    assert losses[-1] < 0.5


def test_a_step_of_one_token_takes_no_step_and_leaves_the_weights_finite(tmp_path):
    # One token's FF output has no variance: its FVU is 0/0, and a step on it would make every weight NaN.
    loaded = loaded_tiny("gpt2")
    words = _corpus(tmp_path, 200).read_text().splitlines()
    corpus = tmp_path / "mixed.txt"
    corpus.write_text("\n".join(line for i, line in enumerate(words) for line in ((line, "a") if i % 4 else (line,))))
    result, _ = _train(loaded, corpus, tmp_path / "out", layers=(1,), batch_size=1, tokens=1500)
    assert result.record["training"]["steps"] > 40
    d = read_sparsify(result.out / "h.1.mlp")
    assert all(bool(torch.isfinite(t).all()) for t in (d.encoder, d.decoder, d.skip if d.skip is not None else d.decoder))
    fvus = [row[1] for row in result.record["curve"]["rows"]]
    assert all(fvu == fvu for fvu in fvus) and result.rows[0]["fvu"] < 1


def test_a_diverged_training_is_refused_before_anything_is_written(tmp_path):
    loaded = loaded_tiny("gpt2")
    with pytest.raises(FfkvError, match=r"the training diverged: the transcoders of layers 1, 3 hold NaN or infinite "
                                        r"weights after \d+ steps, and nothing was written; delete .*checkpoint.pt"):
        _train(loaded, _corpus(tmp_path, 200), tmp_path / "out", lr=1e38, tokens=1500)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint.pt"]


def test_refusals(tmp_path, llama_run):
    loaded, result, _ = llama_run
    with pytest.raises(FfkvError, match="layer 4 does not exist"):
        TrainDictionaryOptions(layers=(3,)).validate(3, 16)
    with pytest.raises(FfkvError, match="k must be"):
        TrainDictionaryOptions(layers=(0,), expansion_factor=1, k=17).validate(3, 16)
    with pytest.raises(FfkvError, match="already holds trained transcoders"):
        _train(loaded, _corpus(tmp_path), result.out)


def test_latents_sets_a_width_that_is_no_multiple_of_d_model(tmp_path):
    loaded = loaded_tiny("llama")
    result, _ = _train(loaded, _corpus(tmp_path, 200), tmp_path / "out", layers=(1,), latents=37, tokens=600)
    d = read_sparsify(result.out / "layers.1.mlp")
    assert d.n_latents == 37 and result.rows[0]["n_latents"] == 37
    assert json.loads((result.out / "layers.1.mlp" / "cfg.json").read_text())["num_latents"] == 37
    assert result.record["options"]["latents"] == 37 and result.to_text().startswith("37-latent TopK")
    assert TrainDictionaryOptions(layers=(0,), latents=37).peak_lr(16) == pytest.approx(2e-4 / (37 / 2 ** 14) ** 0.5)
    with pytest.raises(FfkvError, match=r"k must be in 1\.\.37 \(37 latents\)"):
        TrainDictionaryOptions(layers=(0,), latents=37, k=38).validate(3, 16)
    with pytest.raises(FfkvError, match="latents must be at least 1"):
        TrainDictionaryOptions(layers=(0,), latents=0).validate(3, 16)
    both = _cli(["--model", "tiny-gpt2", "--corpus", "x", "--layers", "1", "--out", str(tmp_path / "no"),
                 "--latents", "37", "--expansion-factor", "4"])
    assert both.wait(timeout=300) == 2 and "not allowed with argument" in both.stderr.read()


def test_training_repeats_its_bytes_resumed_or_not_on_one_thread_or_two(tmp_path):
    # Steps of 16 examples: enough decoder rows gathered that torch would sum the gather's gradient with parallel
    # atomic adds, in an order that changes run to run.
    loaded = loaded_tiny("gpt2")
    corpus = _corpus(tmp_path)
    spec = CorpusSpec(source=str(corpus), unit="line", split="train", max_tokens=60)
    heldout = CorpusSpec(source=str(corpus), unit="line", split="heldout", max_tokens=60)
    options = TrainDictionaryOptions(layers=(0, 2), expansion_factor=4, k=4, skip=True, tokens=6000, batch_size=16,
                                     lr=3e-4, eval_tokens=2000)

    def train(out: Path, examples=None, resume: bool = False):
        return train_dictionaries(loaded, examples or (lambda: iter_examples(spec, loaded.tokenizer)),
                                  lambda: iter_examples(heldout, loaded.tokenizer), options, tmp_path / out,
                                  resume=resume, checkpoint_seconds=3600, progress=False, corpus=spec.to_dict())

    def pressing_ctrl_c_at(n: int):  # the n-th example read: Ctrl-C, which stops training at the end of its step
        def examples():
            for i, example in enumerate(iter_examples(spec, loaded.tokenizer)):
                if i == n:
                    os.kill(os.getpid(), signal.SIGINT)
                yield example
        return examples

    def weights(out: str) -> list[str]:
        return [hashlib.sha256((tmp_path / out / layer / "sae.safetensors").read_bytes()).hexdigest()
                for layer in ("h.0.mlp", "h.2.mlp")]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        train("first")
        train("second")
        with pytest.raises(Interrupted, match="continue with --resume"):
            train("resumed", pressing_ctrl_c_at(100))
        resumed = train("resumed", resume=True)
        torch.set_num_threads(1)
        train("one thread")
    finally:
        torch.set_num_threads(threads)
    assert resumed.record["training"]["steps"] == 14
    assert weights("second") == weights("first"), "two uninterrupted runs on 2 threads differ"
    assert weights("resumed") == weights("first"), "a run resumed after Ctrl-C differs from an uninterrupted one"
    assert weights("one thread") == weights("first"), "a run on 1 thread differs from one on 2"


def _cli(args: list[str], **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    return subprocess.Popen([sys.executable, "-m", "support.tiny_cli", "train-dictionary", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_kill_9_then_resume_gives_the_same_bytes(tmp_path):
    corpus = _corpus(tmp_path, 1500)
    common = ["--model", "tiny-gpt2", "--corpus", str(corpus), "--unit", "line", "--layers", "1,3",
              "--expansion-factor", "4", "-k", "4", "--skip", "--tokens", "30000", "--batch-size", "8",
              "--eval-tokens", "2000", "--checkpoint-seconds", "0", "--no-progress"]
    whole = _cli([*common, "--out", str(tmp_path / "whole")])
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err
    steps = json.loads((tmp_path / "whole" / "training.json").read_text())["training"]["steps"]

    killed = _cli([*common, "--out", str(tmp_path / "killed")])
    checkpoint = tmp_path / "killed" / "checkpoint.pt"
    deadline = time.time() + 300
    while not checkpoint.exists() and killed.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a few steps on: the kill may land mid-step or mid-checkpoint
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "killed" / "training.json").exists()
    refused = _cli([*common, "--out", str(tmp_path / "killed")])
    assert refused.wait(timeout=300) == 2 and "--resume" in refused.stderr.read()
    # where the kill landed, for the failure's message
    at = torch.load(checkpoint, weights_only=True)["step"]

    resumed = _cli([*common, "--out", str(tmp_path / "killed"), "--resume"])
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    record = json.loads((tmp_path / "killed" / "training.json").read_text())
    assert record["training"]["steps"] == steps

    def differing(a: str, b: str) -> list[str]:
        return [f"{layer}/{name}" for layer in ("h.0.mlp", "h.2.mlp") for name in ("sae.safetensors", "cfg.json")
                if (tmp_path / a / layer / name).read_bytes() != (tmp_path / b / layer / name).read_bytes()]

    differs = differing("whole", "killed")
    assert not differs, f"{', '.join(differs)} differ after a resume from step {at} of {steps}"
    assert pd.read_parquet(tmp_path / "whole" / "fidelity.parquet").equals(
        pd.read_parquet(tmp_path / "killed" / "fidelity.parquet"))


def test_sparsify_reads_what_it_writes(llama_run, tmp_path):
    sparsify = pytest.importorskip("sparsify", reason="needs eai-sparsify (pip install eai-sparsify)")
    loaded, result, _ = llama_run
    coders = sparsify.SparseCoder.load_many(str(result.out), local=True)
    assert sorted(coders) == ["layers.0.mlp", "layers.2.mlp"]
    torch.manual_seed(0)
    x = torch.randn(50, 16)
    for name, coder in coders.items():
        ours = read_sparsify(result.out / name)
        assert coder.cfg.transcode and coder.cfg.k == ours.k
        with torch.no_grad():
            theirs = coder(x).sae_out
        torch.testing.assert_close(theirs, ours(x), rtol=1e-5, atol=1e-5)


def test_the_shipped_ffkv_tiny_transcoder_fits_its_model_and_reconstructs_its_layer():
    from ffkv.dictionaries.dictionary import check_against
    from ffkv.models import load_model
    from ffkv.models.default_corpus import default_corpus_path

    folder = SRC / "ffkv" / "assets" / "ffkv-tiny-transcoders"
    d = read_sparsify(folder / "h.3.mlp").to(dtype=torch.float32)
    loaded = load_model("ffkv-tiny")
    check_against({3: d}, loaded.view.n_layers, loaded.view.d_model)
    assert (d.kind, d.n_latents, d.k) == ("transcoder", 512, 16)
    recorded = pd.read_parquet(folder / "fidelity.parquet").iloc[0]
    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", split="heldout")
    means = {3: torch.zeros(loaded.view.d_model)}
    _, (row,) = measure_fidelity(loaded, iter_examples(spec, loaded.tokenizer), {3: d}, means, eval_tokens=10_000)
    assert row["fvu"] == pytest.approx(recorded["fvu"], rel=1e-3)
    assert row["loss_spliced"] == pytest.approx(recorded["loss_spliced"], rel=1e-4)
