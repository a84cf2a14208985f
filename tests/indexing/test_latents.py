"""A sparse dictionary's latents indexed in the pass of the neurons (SPEC section 11, `ffkv.memories.latent_keys`):
exact against a brute force over every prefix, token detectors found, a dead latent without triggers, the
neurons' table untouched, resume exact, a dictionary of another model refused."""

from __future__ import annotations

import os
import signal

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from ffkv.corpus import CorpusSpec
from ffkv.dictionaries import Dictionary, save_npz
from ffkv.errors import FfkvError
from ffkv.indexing.indexer import BatchOptions, IndexOptions, build_index
from ffkv.memories.latent_keys import LatentKeys
from ffkv.memories.latent_keys import SparseCoefficients
from ffkv.memories.projection import logits
from ffkv.store.run import RunDir
from indexing.test_exactness import assert_same, write_corpus
from support.helpers import loaded_tiny

PLANTED = "tacgod"  # the tokens the detectors fire on (characters of write_corpus's words)
DETECTOR_LAYER = 0


def token_local(loaded):
    """The tiny GPT-2 with attention's outputs and the position embedding zeroed: every layer's FF input (and
    output) at a position is then a function of that position's token alone."""
    with torch.no_grad():
        loaded.model.transformer.wpe.weight.zero_()
        for block in loaded.model.transformer.h:
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
    return loaded


def vocabulary_inputs(loaded, layer: int, quantity: str = "ff_in") -> torch.Tensor:
    """(V, d) the FF input (or output) of `layer` at each token of the vocabulary, each run alone."""
    view = loaded.view
    ids = torch.arange(view.vocab_size)[:, None]
    with view.capture((quantity,)) as cap:
        view.forward(ids, torch.ones_like(ids))
    return cap[quantity][layer][:, 0].detach()


def detector_transcoder(loaded, activation: str) -> Dictionary:
    """Latent i fires only where the token is PLANTED[i] (its key separates that token's FF input from every
    other token's), and writes that token's unembedding; the last latent is dead (never fires)."""
    view, tok = loaded.view, loaded.tokenizer
    x = vocabulary_inputs(loaded, DETECTOR_LAYER)
    center = loaded.model.transformer.h[DETECTOR_LAYER].ln_2.bias.detach()  # LayerNorm outputs lie on a sphere
    planted = [tok.encode(ch)[0] for ch in PLANTED]
    rows, biases = [], []
    for t in planted:
        row = x[t] - center
        score = x @ row
        others = torch.cat([score[:t], score[t + 1:]])
        assert score[t] - others.max() > 1e-2, "the detector's token must stand apart"
        rows.append(row)
        biases.append(-(score[t] + others.max()) / 2)
    rows.append(torch.randn(view.d_model))
    biases.append(torch.tensor(-1e4))  # dead: never positive
    n = len(rows)
    embedding = view.unembedding.detach()
    decoder = torch.stack([embedding[t] for t in planted] + [torch.randn(view.d_model)]) * 3
    return Dictionary(kind="transcoder", layer=DETECTOR_LAYER, encoder=torch.stack(rows).detach(),
                      encoder_bias=torch.stack(biases).detach().float(), decoder=decoder,
                      decoder_bias=torch.zeros(view.d_model), activation=activation,
                      k=2 if activation == "topk" else None,
                      threshold=torch.full((n,), 1e-3) if activation == "jumprelu" else None)


def random_dictionary(view, layer: int, kind: str, activation: str, n: int = 24, seed: int = 0) -> Dictionary:
    g = torch.Generator().manual_seed(seed)
    d = view.d_model
    return Dictionary(kind=kind, layer=layer, encoder=torch.randn(n, d, generator=g),
                      encoder_bias=torch.randn(n, generator=g) * 0.5, decoder=torch.randn(n, d, generator=g),
                      decoder_bias=torch.randn(d, generator=g), activation=activation,
                      k=5 if activation == "topk" else None,
                      threshold=torch.rand(n, generator=g) if activation == "jumprelu" else None,
                      input_bias=torch.randn(d, generator=g) if kind == "sae" else None)


def brute_force_latents(loaded, lines, dictionaries, k, mode="example"):
    """Every prefix run alone; each dictionary's latents from the site its key reads by `Dictionary.encode`; per
    latent the k examples with the largest activation at their strongest prefix (the first on a tie; in mode
    prefix, the k largest prefixes), ties by lower example id, then position; only entries where the latent fired
    (a > 0)."""
    view, tok = loaded.view, loaded.tokenizer
    rows = []
    for eid, line in enumerate(lines):
        ids = tok.encode(line)
        for j in range(1, len(ids) + 1):
            with view.capture(("ff_in", "ff_out")) as cap:
                view.forward(torch.tensor([ids[:j]]), torch.ones(1, j, dtype=torch.long))
            if ids[j - 1] in tok.special_ids:
                continue
            nxt = ids[j] if j < len(ids) else -1
            for layer, d in dictionaries.items():
                site = "ff_in" if d.kind == "transcoder" else "ff_out"
                a = d.encode(cap[site][layer][0, -1])
                rows += [(layer, key, float(a[key]), eid, j - 1, nxt) for key in range(d.n_latents)]
    every = pd.DataFrame(rows, columns=["layer", "key", "coefficient", "example_id", "position", "next_token_id"])
    df = every
    if mode == "example":
        df = df.sort_values(["layer", "key", "example_id", "coefficient", "position"],
                            ascending=[True, True, True, False, True])
        df = df.groupby(["layer", "key", "example_id"], sort=False).head(1)
    df = df.sort_values(["layer", "key", "coefficient", "example_id", "position"],
                        ascending=[True, True, False, True, True])
    df = df.groupby(["layer", "key"], sort=False).head(k).copy()
    df["rank"] = df.groupby(["layer", "key"]).cumcount()
    df["direction"] = 1
    df = df[df["coefficient"] > 0]
    return df.sort_values(["layer", "key", "rank"]).reset_index(drop=True), every


def _spec(tmp_path):
    return CorpusSpec(source=str(tmp_path / "corpus.txt"), unit="line")


def _read(run, name):
    return pd.read_parquet(run.table(name))


@pytest.mark.parametrize("activation", ["topk", "relu", "jumprelu"])
def test_token_detectors_are_found_exactly(tmp_path, activation):
    """The acceptance: a transcoder of known token detectors and one dead latent, on one layer of three."""
    lines = write_corpus(tmp_path / "corpus.txt", n=19)
    loaded = token_local(loaded_tiny("gpt2"))
    view, tok = loaded.view, loaded.tokenizer
    d = detector_transcoder(loaded, activation)
    expected, every = brute_force_latents(loaded, lines, {DETECTOR_LAYER: d}, k=4)
    run = build_index(loaded, _spec(tmp_path), tmp_path / "run", IndexOptions(top_k=4, control_keys=8),
                      BatchOptions(batch_size=3, window_batches=2), progress=False, dictionary={DETECTOR_LAYER: d})
    result = _read(run, "latent_trigger_examples")
    assert set(result["layer"]) == {DETECTOR_LAYER}
    assert_same(result, expected, every, "example")
    # A detector has one value wherever its token is (the FF input of layer 0 is a function of the token, computed
    # alike in every prefix), so its entries tie: they break by lower example id, at the first position.
    fired = every[every["coefficient"] > 0]
    assert set(fired["key"]) == set(range(len(PLANTED))) and (fired.groupby("key")["coefficient"].nunique() == 1).all()
    pd.testing.assert_frame_equal(result[["key", "rank", "example_id", "position", "next_token_id"]].astype("int64"),
                                  expected[["key", "rank", "example_id", "position", "next_token_id"]].astype("int64"))
    planted = [tok.encode(ch)[0] for ch in PLANTED]
    for i, t in enumerate(planted):
        mine = result[result["key"] == i]
        assert len(mine) == min(4, sum(PLANTED[i] in line for line in lines)) > 0
        for eid, pos in zip(mine["example_id"].tolist(), mine["position"].tolist()):  # at its token's first place
            ids = tok.encode(lines[eid])
            assert ids[pos] == t and ids.index(t) == pos
    dead = d.n_latents - 1
    assert not (result["key"] == dead).any()
    # The values' top tokens are the planted ones.
    top = logits(view, d.decoder[:-1], "identity").argmax(dim=-1)
    assert top.tolist() == planted
    # The control: one table of the same layout, its keys borrowed from real latents.
    control = _read(run, "latent_control_trigger_examples")
    keys = _read(run, "latent_control_keys")
    assert set(control["layer"]) <= {DETECTOR_LAYER} and (control["coefficient"] > 0).all()
    assert len(keys) == 8 and keys["source_key"].between(0, d.n_latents - 1).all()
    manifest = run.manifest()
    assert manifest.index["dictionary"][str(DETECTOR_LAYER)]["kind"] == "transcoder"
    assert {"latent_trigger_examples.parquet", "latent_control_trigger_examples.parquet",
            "latent_control_keys.parquet"} <= set(manifest.tables)


@pytest.mark.parametrize("family,mode", [("gpt2", "example"), ("gpt2", "prefix"), ("llama", "example")])
def test_dictionaries_of_some_layers_at_both_sites_equal_brute_force(tmp_path, family, mode):
    """An SAE (reads the FF output) on layer 0 and a TopK transcoder on layer 2 of an unmodified model (GELU, and
    gated): each latent's triggers equal the brute force; no state for layer 1."""
    lines = write_corpus(tmp_path / "corpus.txt", n=15)
    loaded = loaded_tiny(family)
    dictionaries = {0: random_dictionary(loaded.view, 0, "sae", "relu"),
                    2: random_dictionary(loaded.view, 2, "transcoder", "topk", seed=1)}
    expected, every = brute_force_latents(loaded, lines, dictionaries, k=3, mode=mode)
    assert (expected["layer"] == 0).any() and (expected["layer"] == 2).any()
    for batch_size in (1, 4):
        run = build_index(loaded, _spec(tmp_path), tmp_path / f"run-{batch_size}", IndexOptions(top_k=3, mode=mode),
                          BatchOptions(batch_size=batch_size, window_batches=2), progress=False,
                          dictionary=dictionaries)
        result = _read(run, "latent_trigger_examples")
        assert set(result["layer"]) == {0, 2} and (result["direction"] == 1).all()
        assert_same(result, expected, every, mode)


@pytest.mark.parametrize("mode", ["example", "prefix"])
def test_a_topk_dictionary_reduced_sparse_writes_the_dense_reductions_tables(tmp_path, monkeypatch, mode):
    """The TopK detectors (entries that tie across examples and positions, a dead latent) with a random TopK
    transcoder beside them: the latent tables of the sparse reduction equal, byte for byte, those of the dense
    (B, T, n_latents) activations reduced as the neurons are."""
    lines = write_corpus(tmp_path / "corpus.txt", n=17)
    loaded = token_local(loaded_tiny("gpt2"))
    dictionaries = {DETECTOR_LAYER: detector_transcoder(loaded, "topk"),
                    2: random_dictionary(loaded.view, 2, "transcoder", "topk", seed=4)}
    options, batching = IndexOptions(top_k=4, mode=mode, control_keys=5), BatchOptions(batch_size=3, window_batches=2)
    sparse = build_index(loaded, _spec(tmp_path), tmp_path / "sparse", options, batching, progress=False,
                         dictionary=dictionaries)
    coefficients = LatentKeys.coefficients

    def dense(self, layer, x):
        return tuple(c.dense() if isinstance(c, SparseCoefficients) else c for c in coefficients(self, layer, x))

    monkeypatch.setattr(LatentKeys, "coefficients", dense)
    dense_run = build_index(loaded, _spec(tmp_path), tmp_path / "dense", options, batching, progress=False,
                            dictionary=dictionaries)
    table = _read(sparse, "latent_trigger_examples")
    detectors = table[table["layer"] == DETECTOR_LAYER]
    assert set(detectors["key"]) == set(range(len(PLANTED))) and len(lines) > 4
    assert detectors.duplicated(["key", "coefficient"]).any()  # ties, broken by example id and position
    assert (table["layer"] == 2).any()
    for name in ("latent_trigger_examples", "latent_control_trigger_examples", "latent_control_keys",
                 "trigger_examples"):
        assert sparse.table(name).read_bytes() == dense_run.table(name).read_bytes(), name


def test_the_neurons_table_is_the_same_with_a_dictionary(tmp_path):
    write_corpus(tmp_path / "corpus.txt", n=13)
    loaded = loaded_tiny("gpt2")
    options, batching = IndexOptions(top_k=3, control_keys=4), BatchOptions(batch_size=4)
    plain = build_index(loaded, _spec(tmp_path), tmp_path / "plain", options, batching, progress=False)
    with_dict = build_index(loaded, _spec(tmp_path), tmp_path / "dict", options, batching, progress=False,
                            dictionary={1: random_dictionary(loaded.view, 1, "transcoder", "topk"),
                                        2: random_dictionary(loaded.view, 2, "sae", "relu")})  # the last FF output
    for name in ("trigger_examples", "control_trigger_examples", "control_keys", "examples"):
        assert plain.table(name).read_bytes() == with_dict.table(name).read_bytes(), name
    assert not plain.table("latent_trigger_examples").exists()


def test_control_latents_follow_the_stated_rule(tmp_path):
    """Control latent c of a TopK dictionary fires, with relu(pre_c), where pre_c beats the k-th largest real
    pre-activation; of a ReLU dictionary, relu(pre_c); rows keep the borrowed latent's norm and bias."""
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    for activation in ("topk", "relu", "jumprelu"):
        d = random_dictionary(view, 1, "transcoder", activation)
        keys = LatentKeys({1: d}, 50, seed=3, device="cpu")
        c = keys.controls[1]
        torch.testing.assert_close(c.encoder.norm(dim=1), d.encoder[c.source].norm(dim=1))
        torch.testing.assert_close(c.encoder_bias, d.encoder_bias[c.source])
        x = torch.randn(2, 7, view.d_model)
        latents, control = keys.coefficients(1, x)
        if activation == "topk":  # its k active latents per position, as they are
            assert isinstance(latents, SparseCoefficients) and latents.indices.shape == (2, 7, d.k)
            latents = latents.dense()
        torch.testing.assert_close(latents, d.encode(x), rtol=0, atol=0)
        pre = x @ c.encoder.T + c.encoder_bias
        expected = torch.relu(pre)
        if activation == "topk":
            kth = d.pre_activations(x).topk(d.k, dim=-1).values[..., -1:]
            expected = expected * (pre > kth)
        if activation == "jumprelu":
            expected = expected * (pre > c.threshold)
        torch.testing.assert_close(control, expected)
        assert (control > 0).any() and (control == 0).any()
        again = LatentKeys({1: d}, 50, seed=3, device="cpu").controls[1]
        assert torch.equal(again.encoder, c.encoder)


def test_resume_with_latents_equals_uninterrupted(tmp_path):
    lines = [f"line {i} " + "ab" * (i % 7) for i in range(40)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    loaded = loaded_tiny("gpt2")
    dictionaries = {1: random_dictionary(loaded.view, 1, "transcoder", "topk"),
                    2: random_dictionary(loaded.view, 2, "sae", "jumprelu", seed=2)}
    options = IndexOptions(top_k=5, control_keys=6)
    batching = BatchOptions(batch_size=4, window_batches=2, checkpoint_seconds=0, part_rows=5)
    whole = build_index(loaded, _spec(tmp_path), tmp_path / "whole", options, batching, progress=False,
                        dictionary=dictionaries)

    def ctrl_c(n_windows):
        if n_windows == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        build_index(loaded, _spec(tmp_path), tmp_path / "cut", options, batching, progress=False,
                    after_window=ctrl_c, dictionary=dictionaries)
    other = {1: random_dictionary(loaded.view, 1, "transcoder", "topk", seed=5), 2: dictionaries[2]}
    with pytest.raises(FfkvError, match="different run"):
        build_index(loaded, _spec(tmp_path), tmp_path / "cut", options, batching, progress=False, resume=True,
                    dictionary=other)
    with pytest.raises(FfkvError, match="different run"):
        build_index(loaded, _spec(tmp_path), tmp_path / "cut", options, batching, progress=False, resume=True)
    resumed = build_index(loaded, _spec(tmp_path), tmp_path / "cut", options, batching, progress=False, resume=True,
                          dictionary=dictionaries)
    for name in ("trigger_examples", "latent_trigger_examples", "latent_control_trigger_examples",
                 "latent_control_keys", "examples"):
        assert whole.table(name).read_bytes() == resumed.table(name).read_bytes(), name
    assert len(pq.read_table(resumed.table("latent_trigger_examples"))) > 0


def test_a_dictionary_of_another_model_is_refused_in_one_line(tmp_path):
    write_corpus(tmp_path / "corpus.txt", n=5)
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    wide = Dictionary(kind="transcoder", layer=1, encoder=torch.randn(8, view.d_model + 1),
                      encoder_bias=torch.zeros(8), decoder=torch.randn(8, view.d_model + 1),
                      decoder_bias=torch.zeros(view.d_model + 1), activation="relu")
    far = random_dictionary(view, view.n_layers, "transcoder", "relu")
    for name, d, problem in (("wide.npz", wide, "width"), ("far.npz", far, "layers")):
        path = tmp_path / name
        save_npz(d, path)
        with pytest.raises(FfkvError, match=problem) as caught:
            build_index(loaded, _spec(tmp_path), tmp_path / f"run-{name}", IndexOptions(top_k=2), progress=False,
                        dictionary=path)
        message = str(caught.value)
        assert str(path) in message and "\n" not in message
        assert not (tmp_path / f"run-{name}").exists()


def test_the_command_indexes_a_dictionary_folder_and_refuses_another_models(tmp_path, capsys, monkeypatch):
    """`ffkv index --dictionary DIR` on a sparsify folder of one layer; a dictionary of another width stops with one
    error line naming its file, before any run is written."""
    from ffkv import cli
    from ffkv.dictionaries import save_sparsify
    from ffkv.models import loading
    from support import tiny_cli

    monkeypatch.setattr(loading, "LOADERS", [tiny_cli.loader, *loading.LOADERS])
    write_corpus(tmp_path / "corpus.txt", n=9)
    view = loaded_tiny("gpt2").view
    folder = save_sparsify(random_dictionary(view, 1, "transcoder", "topk"), tmp_path / "dicts" / "h.1.mlp")

    def index(out, path):
        code = cli.main(["index", "--model", "tiny-gpt2", "--corpus", str(tmp_path / "corpus.txt"), "--unit", "line",
                         "--out", str(tmp_path / out), "--top-k", "3", "--control-keys", "4", "--no-progress",
                         "--dictionary", str(path)])
        return code, capsys.readouterr()

    code, (out, err) = index("run", folder.parent)
    assert code == 0, err
    run = RunDir(tmp_path / "run")
    assert set(_read(run, "latent_trigger_examples")["layer"]) == {1}
    assert run.manifest().index["dictionary"]["1"]["path"] == str(folder)
    wide = Dictionary(kind="transcoder", layer=1, encoder=torch.randn(8, view.d_model + 2),
                      encoder_bias=torch.zeros(8), decoder=torch.randn(8, view.d_model + 2),
                      decoder_bias=torch.zeros(view.d_model + 2), activation="relu")
    save_npz(wide, tmp_path / "wide.npz")
    code, (out, err) = index("refused", tmp_path / "wide.npz")
    lines = [line for line in err.splitlines() if line.startswith("ffkv: error:")]
    assert code == 2 and len(lines) == 1 and str(tmp_path / "wide.npz") in lines[0] and "Traceback" not in err
    assert not (tmp_path / "refused" / "manifest.json").exists()
    with pytest.raises(SystemExit):
        cli.main(["index", "--help"])
    assert "--dictionary" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["example", "prefix"])
def test_shards_merge_to_the_latent_tables_of_one_process(tmp_path, mode):
    from ffkv.indexing.merge import merge_runs

    lines = [f"{'ab cd ef'[: 1 + i % 8]} line {i % 13} {'xyz' * (i % 5)}" for i in range(50)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    loaded = loaded_tiny("gpt2")
    dictionaries = {0: random_dictionary(loaded.view, 0, "transcoder", "topk"),
                    2: random_dictionary(loaded.view, 2, "sae", "relu", n=10, seed=3)}
    options, batching = IndexOptions(top_k=5, mode=mode, control_keys=6), BatchOptions(batch_size=4, window_batches=3)
    single = build_index(loaded, _spec(tmp_path), tmp_path / "single", options, batching, progress=False,
                         dictionary=dictionaries)
    shards = [build_index(loaded, _spec(tmp_path), tmp_path / f"s{i}", options, batching, progress=False,
                          shard=(i, 3), dictionary=dictionaries) for i in range(3)]
    merged = merge_runs([s.path for s in reversed(shards)], tmp_path / "merged")
    for name in ("trigger_examples", "latent_trigger_examples", "latent_control_trigger_examples",
                 "latent_control_keys"):
        assert single.table(name).read_bytes() == merged.table(name).read_bytes(), name
    assert "latent_trigger_examples.parquet" in merged.manifest().tables
