"""Pruning (SPEC 9): perplexity against a brute-force computation, each criterion's keys against a brute-force
choice on hand-built values, and `prune` end to end on a run of ffkv-tiny."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch.nn import functional as F

from ffkv.corpus import CorpusSpec
from ffkv.errors import FfkvError
from ffkv.experiments import pruning
from ffkv.experiments.pruning import (CENSUS_GROUPS, KeyStatistics, heldout_perplexity, key_statistics,
                                      keys_to_remove, redundancy_order, removal_orders)
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.memories.active import ACTIVE_FRACTION
from ffkv.memories.pruning import masked
from ffkv.models import load_model
from ffkv.store.run import RunDir
from ffkv.tools.prune import prune
from support.helpers import loaded_tiny
from support.runs import sharpen

TOKEN_LISTS = [[5, 9, 14, 3, 77, 20, 8], [1, 40], [33], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [50, 51, 52]]


def zero_values(loaded, removed):
    """An independent copy of the model with the removed memories' values set to 0 (FF = Σ m_i·v_i + b_V)."""
    other = copy.deepcopy(loaded.model)
    view = type(loaded.view)(other)
    with torch.no_grad():
        for layer, keys in removed.items():
            view.values(layer)[list(keys)] = 0
    return other


def brute_force_perplexity(model, token_lists):
    """One example at a time, the model's own forward and cross-entropy: (perplexity, n tokens)."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for t in token_lists:
            if len(t) < 2:
                continue
            ids = torch.tensor([t])
            logits = model(input_ids=ids).logits[0].double()
            nll += float(F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum"))
            n += len(t) - 1
    return math.exp(nll / n), n


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_perplexity_equals_a_brute_force_computation(family):
    loaded = sharpen(loaded_tiny(family))
    removed = {layer: np.arange(layer, 40, 3) for layer in range(loaded.view.n_layers)}
    for chosen in ({}, removed):
        got = heldout_perplexity(loaded, TOKEN_LISTS, chosen)
        expected, n = brute_force_perplexity(zero_values(loaded, chosen), TOKEN_LISTS)
        assert got.n_tokens == n == 6 + 1 + 10 + 2  # the one-token example predicts nothing
        assert got.perplexity == pytest.approx(expected, rel=1e-6)
    # The removal moves the result far beyond float error: the comparison above can fail.
    assert abs(heldout_perplexity(loaded, TOKEN_LISTS, removed).nll - heldout_perplexity(loaded, TOKEN_LISTS).nll) > 1e-4


def test_activation_frequency_and_mean_abs_equal_a_brute_force_computation():
    """The signed active rule |m_i| > tau·s_l at the threshold given (the run's, `heldout.active_threshold`)."""
    loaded = loaded_tiny("gpt2")  # GELU: signed, tau = ACTIVE_FRACTION
    view = loaded.view
    with view.capture(("coefficients",)) as cap:
        per_example = []
        for t in TOKEN_LISTS:
            view.forward(torch.tensor([t]))
            per_example.append({l: cap["coefficients"][l][0].double() for l in range(view.n_layers)})
    every = [torch.cat([e[layer] for e in per_example]) for layer in range(view.n_layers)]
    threshold = np.array([ACTIVE_FRACTION * float(m.pow(2).mean().sqrt()) for m in every])
    stats = key_statistics(loaded, token_lists=TOKEN_LISTS, threshold=threshold)
    assert stats.positions == sum(len(t) for t in TOKEN_LISTS)
    for layer, m in enumerate(every):
        expected_freq = (m.abs() > threshold[layer]).double().mean(0).numpy()
        np.testing.assert_allclose(stats.frequency[layer], expected_freq, rtol=1e-6)
        np.testing.assert_allclose(stats.mean_abs[layer], m.abs().mean(0).numpy(), rtol=1e-6)
        np.testing.assert_allclose(stats.value_norm[layer], view.values(layer).norm(dim=1).numpy(), rtol=1e-6)
        np.testing.assert_allclose(stats.contribution[layer], m.abs().mean(0).numpy() * stats.value_norm[layer],
                                   rtol=1e-6)
    without = key_statistics(loaded, token_lists=TOKEN_LISTS)  # no threshold: no frequency, and no order by it
    assert without.frequency is None and np.array_equal(without.mean_abs, stats.mean_abs)
    with pytest.raises(FfkvError, match="needs the run's active threshold"):
        removal_orders("activation_frequency", view, without)


def hand_view(values_per_layer):
    """A tiny GPT-2 whose values are set by hand (layers x 40 x 16)."""
    loaded = loaded_tiny("gpt2")
    with torch.no_grad():
        for layer, v in enumerate(values_per_layer):
            loaded.view.values(layer).copy_(torch.as_tensor(v, dtype=torch.float32))
    return loaded.view


def brute_force_redundancy(v: np.ndarray) -> list[int]:
    """The stated rule, recomputed from scratch at every step."""
    v = v.astype(np.float64)
    norms = np.linalg.norm(v, axis=1)
    kept = list(range(len(v)))
    order = []
    while len(kept) > 1:
        scores = []
        for i in kept:
            best = max(float(v[i] @ v[j]) / (norms[i] * norms[j]) for j in kept if j != i)
            scores.append((-round(best, 12), norms[i], i))
        i = min(scores)[2]
        order.append(i)
        kept.remove(i)
    return order + kept


def test_redundancy_order_is_the_greedy_rule():
    e = np.eye(16)
    v = np.zeros((40, 16))
    v[:] = np.random.default_rng(0).normal(size=(40, 16))
    v[3] = 2 * e[0]
    v[17] = 0.5 * e[0]     # same direction as key 3, smaller: removed first
    v[25] = e[1] + 0.05 * e[2]
    v[8] = e[1]            # cos with 25 just below 1, smaller norm than 25: removed second
    order = redundancy_order(torch.as_tensor(v))
    assert order[:2].tolist() == [17, 8]
    assert order.tolist() == brute_force_redundancy(v)
    assert sorted(order.tolist()) == list(range(40))
    rand = np.random.default_rng(5).normal(size=(30, 6))
    assert redundancy_order(torch.as_tensor(rand)).tolist() == brute_force_redundancy(rand)


def test_each_criterion_chooses_the_keys_a_brute_force_sort_chooses():
    rng = np.random.default_rng(1)
    values = [rng.normal(size=(40, 16)) * rng.uniform(0.1, 3, size=(40, 1)) for _ in range(3)]
    view = hand_view(values)
    frequency = rng.integers(0, 5, size=(3, 40)) / 4.0  # many ties: broken by the lower key index
    mean_abs = rng.uniform(0, 1, size=(3, 40))
    norms = np.stack([np.linalg.norm(v, axis=1) for v in values])
    stats = KeyStatistics(norms, frequency, mean_abs, positions=100, examples=4)
    share = 0.3  # 12 keys of 40
    for criterion, score in (("activation_frequency", frequency), ("value_norm", norms),
                             ("contribution", mean_abs * norms)):
        removed = keys_to_remove(removal_orders(criterion, view, stats), share)
        for layer in range(3):
            expected = sorted(sorted(range(40), key=lambda k: (score[layer][k], k))[:12])
            assert removed[layer].tolist() == expected, criterion
    removed = keys_to_remove(removal_orders("redundancy", view, stats), share)
    for layer in range(3):
        assert removed[layer].tolist() == sorted(brute_force_redundancy(values[layer].astype(np.float32))[:12])
    first = keys_to_remove(removal_orders("random", view, stats, seed=4), share)
    again = keys_to_remove(removal_orders("random", view, stats, seed=4), share)
    other = keys_to_remove(removal_orders("random", view, stats, seed=5), share)
    assert all(len(first[l]) == 12 and first[l].tolist() == again[l].tolist() for l in range(3))
    assert any(first[l].tolist() != other[l].tolist() for l in range(3))
    assert first[0].tolist() == sorted(np.random.default_rng([4, 0]).permutation(40)[:12].tolist())


def test_census_criterion_removes_dead_keys_first_then_by_group():
    view = hand_view([np.ones((40, 16))] * 3)
    classes, values = ["other"] * 40, ["neither"] * 40
    for k in range(21, 40):
        values[k] = "prediction"
    for k in (7, 30):
        classes[k] = "dead"
    values[30] = "prediction"  # a dead key is dead, whatever its value
    for k in (2, 11, 12):
        classes[k] = "positional"
    classes[20] = "something_new"  # an unlisted class counts as other
    for k in (0, 1, 5):
        classes[k] = "detector"
    classes[39], values[39] = "detector", "suppression"  # the value type decides: a suppression memory
    census = pd.DataFrame({"layer": np.repeat(np.arange(3), 40), "key": np.tile(np.arange(40), 3),
                           "class": classes * 3, "value_type": values * 3})
    contribution = np.tile(np.arange(40)[::-1].astype(float), (3, 1))  # higher key: smaller contribution
    stats = KeyStatistics(np.ones((3, 40)), np.zeros((3, 40)), contribution, positions=1, examples=1)
    order = removal_orders("census", view, stats, census)[1]
    others = sorted(set(range(21)) - {7, 2, 11, 12, 0, 1, 5}, reverse=True)  # 20 (unlisted) among them
    # dead (30 before 7: smaller contribution), other, positional, detectors, suppression, prediction
    assert order.tolist() == [30, 7, *others, 12, 11, 2, 5, 1, 0, 39, *(k for k in range(38, 20, -1) if k != 30)]
    assert CENSUS_GROUPS[0] == "dead"
    with pytest.raises(FfkvError, match="does not cover"):
        removal_orders("census", view, stats, census[census["key"] != 3])


def test_census_criterion_orders_the_groups_of_the_census_that_analyze_writes(tmp_path):
    """On the table the census writes (not a hand-made one): every removal order walks the groups in
    CENSUS_GROUPS order, smallest contribution first within a group, and uses every class the census gives."""
    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    run, loaded = make_run(tmp_path, "llama", n=40, top_k=3)
    analyze(run, only="census", loaded=loaded, n_eval=20, progress=False)
    census = pruning.read_census(RunDir(run))
    stats = key_statistics(loaded, RunDir(run))
    groups = [pruning.census_group(c, v) for c, v in zip(census["class"], census["value_type"])]
    assert set(groups) <= set(CENSUS_GROUPS) and len(set(groups)) >= 2
    by_key = {(int(l), int(k)): g for l, k, g in zip(census["layer"], census["key"], groups)}
    for layer, order in enumerate(removal_orders("census", loaded.view, stats, census)):
        rank = [CENSUS_GROUPS.index(by_key[(layer, int(k))]) for k in order]
        assert rank == sorted(rank)
        c = stats.contribution[layer][order]
        assert all(c[i] <= c[i + 1] for i in range(len(order) - 1) if rank[i] == rank[i + 1])


def test_unknown_criterion_and_missing_census_are_clear_errors(tmp_path):
    with pytest.raises(FfkvError, match="unknown pruning criterion 'sparsity'.*activation_frequency"):
        pruning.check_criterion("sparsity")
    with pytest.raises(FfkvError, match="ffkv analyze .* --only census"):
        pruning.read_census(RunDir(tmp_path))


# --------------------------------------------------------------------------- ffkv prune, end to end
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """ffkv-tiny indexed on 40 verses of its embedded corpus by the real pipeline."""
    import ffkv

    folder = tmp_path_factory.mktemp("prune_run")
    lines = ffkv.embedded_corpus("train").read_text().splitlines()[:40]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    loaded = load_model("ffkv-tiny")
    build_index(loaded, CorpusSpec(source=str(folder / "corpus.txt"), unit="line"), folder / "run",
                IndexOptions(top_k=3), progress=False)
    return folder / "run", loaded


@pytest.mark.parametrize("criterion", ["contribution", "redundancy", "census"])
def test_prune_writes_a_smaller_model_with_the_masked_logits(tiny_run, tmp_path, criterion):
    run, loaded = tiny_run
    view = loaded.view
    if criterion == "census":
        copy_run = tmp_path / "run"
        import shutil
        shutil.copytree(run, copy_run)
        # A census table the run does not record as computed (written by hand, or by an analyze that failed) is
        # refused, not read; the census `ffkv analyze` computes is read, and the pruned model says on what.
        census = pd.DataFrame({"layer": np.repeat(np.arange(view.n_layers), view.d_m),
                               "key": np.tile(np.arange(view.d_m), view.n_layers),
                               "class": ["dead"] * view.d_m * view.n_layers,
                               "value_type": ["prediction"] * view.d_m * view.n_layers})
        RunDir(copy_run).write_metric("census", census, {})
        with pytest.raises(FfkvError, match="records no census.*--only census"):
            prune(copy_run, "census", 0.3, tmp_path / "refused")
        from ffkv.experiments import analyze

        analyze(copy_run, only="census", loaded=loaded, n_eval=20, progress=False)
        run = copy_run
    out = prune(run, criterion, 0.3, tmp_path / "pruned")
    info = json.loads((out / "ffkv_pruning.json").read_text())
    n = int(np.floor(0.3 * view.d_m + 0.5))
    assert info["d_m_after"] == view.d_m - n and info["criterion"] == criterion
    removed = {int(layer): keys for layer, keys in info["removed"].items()}
    assert all(len(keys) == n for keys in removed.values())
    if criterion == "census":
        assert info["census_provenance"] == RunDir(run).manifest().analyses["census"]["provenance"]
        census = pruning.read_census(RunDir(run))
        for layer, keys in removed.items():  # whole census groups go first (CENSUS_GROUPS order)
            rows = census[census["layer"] == layer].set_index("key")
            rank = np.array([CENSUS_GROUPS.index(pruning.census_group(rows.loc[k, "class"], rows.loc[k, "value_type"]))
                             for k in range(view.d_m)])
            kept = np.setdiff1d(np.arange(view.d_m), keys)
            assert rank[keys].max() <= rank[kept].min()
    back = load_model(str(out))
    assert back.view.d_m == view.d_m - n
    ids = torch.tensor([loaded.tokenizer.encode("In the beginning God created the heaven and the earth.")])
    with torch.no_grad(), masked(view, removed):
        expected = loaded.model(input_ids=ids).logits
    with torch.no_grad():
        got = back.model(input_ids=ids).logits
        original = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, original, atol=1e-3)
    assert back.tokenizer.encode("And God said") == loaded.tokenizer.encode("And God said")
    assert not list(tmp_path.glob(".pruned.*"))  # no temporary folder is left


def test_prune_at_share_zero_gives_the_original_logits_exactly(tiny_run, tmp_path):
    run, loaded = tiny_run
    back = load_model(str(prune(run, "random", 0.0, tmp_path / "same")))
    ids = torch.tensor([loaded.tokenizer.encode("And God said, Let there be light")])
    with torch.no_grad():
        assert torch.equal(back.model(input_ids=ids).logits, loaded.model(input_ids=ids).logits)


def test_prune_refuses_bad_input(tiny_run, tmp_path):
    run, _ = tiny_run
    (tmp_path / "exists").mkdir()
    with pytest.raises(FfkvError, match="exists"):
        prune(run, "random", 0.1, tmp_path / "exists")
    with pytest.raises(FfkvError, match="unknown pruning criterion"):
        prune(run, "magnitude", 0.1, tmp_path / "a")
    with pytest.raises(FfkvError, match=r"\[0, 1\)"):
        prune(run, "random", 1.0, tmp_path / "b")
    with pytest.raises(FfkvError, match="--only census"):
        prune(run, "census", 0.1, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_an_encoder_gets_no_curve_and_says_why(tmp_path):
    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    run, loaded = make_run(tmp_path, "bert", n=20, top_k=3)
    with pytest.raises(FfkvError, match="masked-LM encoder"):  # named: refused before anything runs
        analyze(run, only="pruning", loaded=loaded, n_eval=5, progress=False)
    done = analyze(run, only=None, loaded=loaded, n_eval=5, progress=False)  # every experiment: skipped, said why
    assert "masked-LM encoder" in done["pruning"]["skipped"]
    assert not RunDir(run).has_metric("pruning")


def test_heldout_rows_take_a_seeded_choice_up_to_the_token_cap():
    lists = [[1] * n for n in (5, 1, 9, 3, 7, 2, 4, 8)]
    assert [len(t) for _, t in pruning.heldout_rows(lists)] == [5, 9, 3, 7, 2, 4, 8]
    rows = pruning.heldout_rows(lists, max_tokens=12, seed=3)
    # Brute force: visit the two-token-or-longer examples in default_rng(3)'s order, stop before passing 12.
    usable = [t for t in lists if len(t) >= 2]
    chosen, total = [], 0
    for i in np.random.default_rng(3).permutation(len(usable)):
        if chosen and total + len(usable[i]) - 1 > 12:
            break
        chosen.append(i)
        total += len(usable[i]) - 1
    assert [len(t) for _, t in rows] == [len(usable[i]) for i in sorted(chosen)]
    assert [r for r, _ in rows] == list(range(len(rows)))
    assert sum(len(t) - 1 for _, t in rows) <= 12
    assert len(pruning.heldout_rows([[1] * 50], max_tokens=3)) == 1  # at least one example


def test_an_unreadable_census_leaves_that_criterion_out_with_a_warning(tmp_path):
    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    run, loaded = make_run(tmp_path, "gpt2", n=20, top_k=3)
    RunDir(run).write_metric("census", pd.DataFrame({"layer": [0], "key": [0], "kind": ["dead"]}), {})
    analyze(run, only="pruning", loaded=loaded, n_eval=5, progress=False)
    table = RunDir(run).read_metric("pruning")
    assert "census" not in set(table["criterion"]) and len(table) == 5 * 10
    assert "census criterion was left out" in RunDir(run).metric_description("pruning")["warnings"][0]


def test_the_curve_has_a_census_criterion_when_the_census_exists(tmp_path):
    from ffkv.experiments import analyze
    from support.experiment_runs import make_run

    run, loaded = make_run(tmp_path, "gpt2", n=20, top_k=3)
    L, d_m = loaded.view.n_layers, loaded.view.d_m
    # A census of this run's seed and held-out examples (pruning reads no other: its record says on what), whose
    # classes are then planted: a known answer.
    analyze(run, only="census", loaded=loaded, n_eval=5, progress=False)
    RunDir(run).write_metric("census", pd.DataFrame({
        "layer": np.repeat(np.arange(L), d_m), "key": np.tile(np.arange(d_m), L),
        "class": (["dead"] * 4 + ["other"] * (d_m - 4)) * L, "value_type": "neither"}), {})
    analyze(run, only="pruning", loaded=loaded, n_eval=5, progress=False)
    table = RunDir(run).read_metric("pruning")
    assert list(dict.fromkeys(table["criterion"])) == list(pruning.CRITERIA)
    census = table[table["criterion"] == "census"].set_index("share")
    assert census.loc[0.1, "n_removed"] == 4  # 10% of 40: exactly the four dead keys
    assert RunDir(run).metric_description("pruning")["census"] == "used"


@pytest.mark.parametrize("block", [1, 7, 64])  # one row, uneven blocks, one block for the whole matrix
def test_cosines_are_symmetrized_in_place_as_the_whole_mean(block, monkeypatch):
    monkeypatch.setattr(pruning, "_SYMMETRIZE_ROWS", block)
    sim = torch.as_tensor(np.random.default_rng(1).normal(size=(30, 30)))
    expected = (sim + sim.T) / 2
    assert torch.equal(pruning._symmetrized(sim.clone()), expected)
    rand = np.random.default_rng(5).normal(size=(30, 6))
    assert redundancy_order(torch.as_tensor(rand)).tolist() == brute_force_redundancy(rand)


def test_a_pruned_ffkv_tiny_loads_with_transformers_auto_classes_after_import_ffkv(tiny_run, tmp_path):
    """`import ffkv` registers ffkv's model family with AutoConfig and AutoModelForCausalLM (`ffkv.hf_auto`),
    without importing torch or transformers itself; without it, transformers does not know the model type."""
    import subprocess
    import sys

    run, loaded = tiny_run
    out = prune(run, "random", 0.3, tmp_path / "pruned")
    ids = loaded.tokenizer.encode("And God said, Let there be light")
    script = (
        "import sys, numpy as np\n"
        "import ffkv\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        "assert type(model).__name__ == 'FfkvLMForCausalLM'\n"
        f"np.save({str(tmp_path / 'logits.npy')!r}, model(torch.tensor([{ids!r}])).logits.detach().numpy())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with torch.no_grad():
        expected = load_model(str(out)).model(input_ids=torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, rtol=1e-5, atol=1e-5)
    without = subprocess.run([sys.executable, "-c", script.replace("import ffkv\n", "").replace(
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n", "")],
        capture_output=True, text=True, timeout=300)
    assert without.returncode != 0 and "ffkv_lm" in without.stderr


def test_prune_by_activation_frequency_on_a_signed_model_uses_the_runs_held_out_threshold(tmp_path):
    """`ffkv prune --criterion activation_frequency` on stories260K (SiLU-gated: signed, tau > 0): the keys it
    removes are the least often active under |m| > tau·s_l, s_l of the run's own held-out examples by brute force
    (as `ffkv analyze` reads them by default), counted over the corpus sample, each example run alone."""
    from ffkv.corpus import shared_data_dir
    from ffkv.experiments.common import eval_spec, select_held_out
    from ffkv.experiments.lookups import SAMPLE_EXAMPLES, SAMPLE_MAX_TOKENS, corpus_sample
    from ffkv.memories.active import active_fraction
    from support.helpers import held_out_scale

    data = shared_data_dir()
    if data is None or not (data / "models" / "stories260K").is_dir():
        pytest.skip("needs ../shared/data/models/stories260K")
    loaded = load_model(str(data / "models" / "stories260K"))
    view = loaded.view
    tau = active_fraction(view)
    assert view.signed and tau > 0
    run = tmp_path / "run"
    build_index(loaded, CorpusSpec(source=str(data / "tinystories" / "sample.txt"), unit="sentence"), run,
                IndexOptions(top_k=3), progress=False)
    out = prune(run, "activation_frequency", 0.25, tmp_path / "pruned", loaded=loaded)
    info = json.loads((out / "ffkv_pruning.json").read_text())
    source = info["statistics_sample"]["active_threshold"]
    assert source["tau"] == tau and source["seed"] == 0 and source["eval_corpus"]["split"] == "heldout"

    rd = RunDir(run)
    held = select_held_out(loaded, eval_spec(rd.manifest(), seed=0), 0)
    threshold = tau * held_out_scale(loaded, held)
    sample = corpus_sample(rd, n=SAMPLE_EXAMPLES, seed=0, max_tokens=SAMPLE_MAX_TOKENS)
    n = int(np.floor(0.25 * view.d_m + 0.5))
    every = {layer: [] for layer in range(view.n_layers)}
    for ids in sample:
        with torch.no_grad(), view.capture(("coefficients",)) as cap:
            view.forward(torch.tensor([list(ids)]))
        for layer in every:
            every[layer].append(cap["coefficients"][layer][0].double())
    by_sign = 0
    for layer, ms in every.items():
        m = torch.cat(ms).numpy()
        frequency = (np.abs(m) > threshold[layer]).mean(0)
        expected = np.sort(np.argsort(frequency, kind="stable")[:n])
        assert info["removed"][str(layer)] == expected.tolist(), layer
        by_sign += set(np.argsort((m > 0).mean(0), kind="stable")[:n]) != set(expected)
    assert by_sign > 0  # the rule matters here: the ReLU rule m > 0 would remove other keys


def test_pruning_latents_against_a_brute_force_model_and_latents_that_write_nothing(tmp_path):
    """A ReLU transcoder at layer 1 of the tiny GPT-2 whose 8 smallest decoder rows are 0: by value norm, removing up
    to half of its latents changes nothing (perplexity exactly the model's); every value-norm row's perplexity equals
    a copy of the model whose layer-1 MLP output loses Σ a_j·d_j of the removed latents, and the neurons' beside it a
    copy with that layer's removed values zeroed (only that layer); the neurons' own curve is the run's without
    the dictionary."""
    from ffkv.dictionaries import Dictionary
    from ffkv.dictionaries.npz_layout import save_npz
    from ffkv.experiments import analyze
    from ffkv.experiments.common import select_held_out
    from ffkv.memories.pruning import removal_count
    from support.runs import N_LINES, index_run

    plain, loaded = index_run(tmp_path / "plain")
    view, layer, n = loaded.view, 1, 16
    g = torch.Generator().manual_seed(2)
    decoder = torch.randn(n, view.d_model, generator=g) * torch.linspace(1.0, 2.0, n)[:, None]
    decoder[:8] = 0.0
    d = Dictionary(kind="transcoder", layer=layer, encoder=torch.randn(n, view.d_model, generator=g),
                   encoder_bias=torch.zeros(n), decoder=decoder, decoder_bias=torch.zeros(view.d_model),
                   activation="relu")
    corpus = tmp_path / "plain" / "corpus.txt"
    run = tmp_path / "run"
    build_index(loaded, CorpusSpec(source=str(corpus), unit="line"), run, IndexOptions(top_k=5),
                progress=False, dictionary=save_npz(d, tmp_path / "d.npz"))
    for folder in (run, plain):
        analyze(folder, only=["pruning"], eval_corpus=str(corpus), n_eval=N_LINES, progress=False, loaded=loaded)
    for table in ("pruning", "pruning_summary"):  # the neurons' curves: no latent changes them
        pd.testing.assert_frame_equal(RunDir(run).read_metric(table), RunDir(plain).read_metric(table),
                                      check_exact=True)
    table = RunDir(run).read_metric(pruning.LATENTS)
    assert set(table["criterion"]) == set(pruning.LATENT_CRITERIA) and set(table["layer"]) == {layer}
    by_norm = table[table["criterion"] == "value_norm"].set_index("share")
    for share in (0.1, 0.3, 0.5):  # the masked models' passes share batches: equal but for their rounding
        assert by_norm.loc[share, "perplexity_latents"] == pytest.approx(by_norm.loc[share, "perplexity_base"],
                                                                         rel=1e-6)

    held = select_held_out(loaded, CorpusSpec(source=str(corpus), unit="line", split="all", max_examples=N_LINES,
                                              shuffle_seed=0), 0)
    tokens = [list(ids) for _, ids in pruning.heldout_rows([e.token_ids for e in held.examples], pruning.MAX_TOKENS)]
    base, _ = brute_force_perplexity(loaded.model, tokens)
    assert by_norm["perplexity_base"].iloc[0] == pytest.approx(base, rel=1e-6)
    latent_order = np.argsort(decoder.norm(dim=1).double().numpy(), kind="stable")
    neuron_order = np.argsort(view.values(layer).float().norm(dim=1).double().numpy(), kind="stable")
    for share, row in by_norm.iterrows():
        gone = torch.as_tensor(np.sort(latent_order[:removal_count(n, share)]))
        other = copy.deepcopy(loaded.model)
        mlp = type(view)(other).blocks[layer].mlp
        mlp.register_forward_hook(lambda mod, args, out, gone=gone: out - torch.relu(
            args[0] @ d.encoder[gone].T + d.encoder_bias[gone]) @ d.decoder[gone])
        assert row["perplexity_latents"] == pytest.approx(brute_force_perplexity(other, tokens)[0], rel=1e-5)
        neurons = {layer: np.sort(neuron_order[:removal_count(view.d_m, share)])}
        assert row["perplexity_neurons"] == pytest.approx(
            brute_force_perplexity(zero_values(loaded, neurons), tokens)[0], rel=1e-5)
    assert by_norm.loc[0.9, "perplexity_latents"] != by_norm.loc[0.9, "perplexity_base"]  # the rows that write


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_masked_models_passes_in_shared_batches_equal_each_models_own_pass(family):
    """`perplexities` runs every removal's rows in one scoring pass (batches mixing the masked models); each value
    equals that model's own pass (the columns rewritten by `intervene`) but for rounding, and nothing removed
    equals the model as it is."""
    loaded = loaded_tiny(family)
    view, rng = loaded.view, np.random.default_rng(3)
    rows = pruning.heldout_rows([rng.integers(3, view.vocab_size, size=int(n)) for n in rng.integers(2, 14, 24)])
    removals = [{}, {0: np.arange(5)}, {layer: np.sort(rng.choice(view.d_m, view.d_m // 2, replace=False))
                                         for layer in range(view.n_layers)}, {1: np.arange(view.d_m - 1)}]
    shared = pruning.perplexities(loaded, rows, removals)
    for removed, got in zip(removals, shared):
        own = pruning.perplexity(loaded, rows, removed)
        assert got.n_tokens == own.n_tokens and got.nll == pytest.approx(own.nll, rel=1e-6)
    assert len({round(p.perplexity, 3) for p in shared}) == len(removals)  # each removal changed what was measured


def test_latents_switched_off_row_by_row_equal_their_off_edits():
    """`latents_off_by_row`, each row with its own latents off, equals the `intervene` off edits of those latents
    row by row (sparse and dense decoding both)."""
    from ffkv.dictionaries import Dictionary
    from ffkv.memories.interventions import Intervention, _decoded, intervene, latents_off_by_row
    from ffkv.memories.sets import Latents

    loaded = loaded_tiny("gpt2")
    view, g = loaded.view, torch.Generator().manual_seed(5)
    n = 24
    d = Dictionary(kind="transcoder", layer=1, encoder=torch.randn(n, view.d_model, generator=g),
                   encoder_bias=torch.zeros(n), decoder=torch.randn(n, view.d_model, generator=g),
                   decoder_bias=torch.zeros(view.d_model), activation="topk", k=3)
    a = torch.relu(torch.randn(40, n, generator=g)) * (torch.rand(40, n, generator=g) < 0.1)
    assert torch.allclose(_decoded(a, d.decoder), a @ d.decoder, atol=1e-5)
    ids = torch.randint(3, view.vocab_size, (3, 7), generator=g)
    off = torch.zeros(3, n, dtype=torch.bool)
    off[0, :4], off[2, ::2] = True, True
    latents = Latents(view, {1: d})
    with latents.attached():
        with latents_off_by_row(view, {1: lambda: off[:, None, :]}):
            together = loaded.model(ids).logits
        for row in range(3):
            edits = [Intervention(1, int(j), "off", kind="transcoder") for j in torch.nonzero(off[row])[:, 0]]
            with intervene(view, edits):
                alone = loaded.model(ids[row:row + 1]).logits
            assert torch.allclose(together[row], alone[0], atol=1e-5)
