"""`ffkv locate`: causal tracing recovers a fact planted in one known FF layer and memory (GPT-2, Llama-style
gated, ffkv's own LM), and its tables, figures and command line are what they say."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from ffkv.errors import FfkvError
from ffkv.memories.patching import Restore, corrupt_and_restore, embedding_std
from ffkv.memories.view import MemoryView
from ffkv.models.loading import LoadedModel
from ffkv.tools.locate import (
    Fact,
    LocateOptions,
    default_window,
    intervene_command,
    locate,
    read_facts,
    subject_positions,
    trace_fact,
    window_layers,
    write_locate,
)
from support.helpers import CharTokenizer, loaded_tiny

PLANTED_LAYER, PLANTED_KEY, ANSWER = 1, 7, 60
PROMPT, SUBJECT = "xyQ", "Q"   # the subject is the last token: with attention switched off, it reaches the
#                                prediction only through the residual stream at its own position


def _ffkv_lm() -> LoadedModel:
    from ffkv.models.tiny_lm import FfkvLMConfig, FfkvLMForCausalLM

    torch.manual_seed(0)
    model = FfkvLMForCausalLM(FfkvLMConfig(vocab_size=97, hidden_size=16, num_layers=3, num_heads=2,
                                           intermediate_size=40, max_position_embeddings=32, dropout=0.0)).eval()
    model.requires_grad_(False)
    return LoadedModel(model, CharTokenizer(), MemoryView(model), "tiny-ffkv_lm", "float32", "cpu")


def planted(family: str) -> LoadedModel:
    """A tiny model whose next-token prediction after PROMPT is ANSWER, through memory PLANTED_KEY of
    PLANTED_LAYER alone: every attention module's weights are zero (attention outputs 0), every FF value and
    value bias is zero except that memory's, whose key fires on the subject's FF input and whose value writes
    the answer's unembedding row."""
    loaded = _ffkv_lm() if family == "ffkv_lm" else loaded_tiny(family)
    view = loaded.view
    with torch.no_grad():
        for block in view.blocks:
            for p in view.arch.attention(block).parameters():
                p.zero_()
        for layer in range(view.n_layers):
            view.values(layer).zero_()
            if view.value_bias(layer) is not None:
                view.value_bias(layer).zero_()
        ids = torch.tensor([CharTokenizer().encode(PROMPT)])
        with view.capture(("ff_in", "resid_mid"), layers=[PLANTED_LAYER]) as cap:
            view.forward(ids)
        x = cap["ff_in"][PLANTED_LAYER][0, -1]
        direction = x / x.norm() ** 2
        view.keys(PLANTED_LAYER)[PLANTED_KEY] = 6.0 * direction      # k·x = 6 on the clean subject
        if view.key_bias(PLANTED_LAYER) is not None:
            view.key_bias(PLANTED_LAYER)[PLANTED_KEY] = -3.0
        if view.gated:
            view.up(PLANTED_LAYER)[PLANTED_KEY] = 6.0 * direction
        with view.capture(("coefficients",), layers=[PLANTED_LAYER]) as m:
            view.forward(ids)
        m_clean = m["coefficients"][PLANTED_LAYER][0, -1, PLANTED_KEY]
        e = view.unembedding[ANSWER]
        e.mul_(3.0 / e.norm())                                        # a logit the final norm cannot drown
        # The clean memory writes the answer's direction at 10x the residual's norm: it decides the prediction.
        scale = 10.0 * cap["resid_mid"][PLANTED_LAYER][0, -1].norm() / m_clean
        view.values(PLANTED_LAYER)[PLANTED_KEY] = scale * e / e.norm()
    return loaded


@pytest.mark.parametrize("family", ["gpt2", "llama", "ffkv_lm"])
def test_tracing_recovers_the_planted_layer_and_memory(family):
    loaded = planted(family)
    options = LocateOptions(samples=8, window=1, candidates=40, top_memories=3)
    t = trace_fact(loaded, Fact(PROMPT, SUBJECT), options)
    assert t.answer_id == ANSWER and t.p_clean > 0.5
    assert t.total_effect > 0.4, "the corruption must destroy the fact"
    ie = t.indirect_effect("ff_out")[:, -1]
    assert int(np.argmax(ie)) == PLANTED_LAYER
    assert ie[PLANTED_LAYER] > 0.8 * t.total_effect
    others = np.delete(ie, PLANTED_LAYER)
    np.testing.assert_allclose(others, 0.0, atol=1e-6)  # their FF outputs are zero clean and corrupted alike
    np.testing.assert_allclose(t.indirect_effect("attn_out"), 0.0, atol=1e-6)  # attention is off
    assert t.cell == (PLANTED_LAYER, len(PROMPT) - 1)
    top = t.memories.iloc[0]
    assert int(top.key) == PLANTED_KEY and int(top.layer) == PLANTED_LAYER
    assert top.indirect_effect > 0.8 * t.total_effect
    assert (t.memories.indirect_effect.iloc[1:].abs() < 1e-6).all()  # no other memory writes anything
    assert intervene_command(t, 1, "runs/x") == f"ffkv intervene runs/x --off {PLANTED_LAYER + 1}:{PLANTED_KEY}"


def test_the_hidden_state_restores_the_fact_up_to_the_last_subject_token():
    t = trace_fact(planted("gpt2"), Fact(PROMPT, SUBJECT), LocateOptions(samples=8, window=1))
    ie = t.indirect_effect("hidden")
    # At the subject's position every layer's output carries the fact (through the residual stream);
    # positions before it are not corrupted and nothing reads them.
    assert (ie[:, -1] > 0.8 * t.total_effect).all()
    np.testing.assert_allclose(ie[:, :-1], 0.0, atol=1e-6)


def test_restoring_from_the_clean_row_is_the_clean_run():
    """Restoring the first block's output at the corrupted positions makes every later state up to them clean
    (later positions read the corrupted ones inside the first block's attention, and stay corrupted)."""
    loaded = loaded_tiny("gpt2")
    view = loaded.view
    ids = torch.tensor([CharTokenizer().encode("hello world")]).expand(3, -1)
    subject = [2, 3]
    noise = torch.randn(3, 2, view.d_model)
    noise[0] = 0
    with view.capture(("resid_post",), layers=[view.n_layers - 1]) as clean:
        view.forward(ids[:1])
    restores = [Restore("hidden", 0, 1, 3, p) for p in subject]
    with corrupt_and_restore(view, tuple(ids.shape), subject, noise, restores), \
            view.capture(("resid_post",), layers=[view.n_layers - 1]) as cap:
        view.forward(ids)
    last, want = cap["resid_post"][view.n_layers - 1], clean["resid_post"][view.n_layers - 1].expand(3, -1, -1)
    torch.testing.assert_close(last[:, :4], want[:, :4])
    assert not torch.allclose(last[1:, 4:], want[1:, 4:])
    with corrupt_and_restore(view, tuple(ids.shape), subject, noise), \
            view.capture(("resid_post",), layers=[view.n_layers - 1]) as cap:
        view.forward(ids)
    assert not torch.allclose(cap["resid_post"][view.n_layers - 1][1:], clean["resid_post"][view.n_layers - 1])


def test_embedding_std_is_the_embedding_matrix_std():
    loaded = loaded_tiny("gpt2")
    w = loaded.model.transformer.wte.weight.double()
    assert embedding_std(loaded.view) == pytest.approx(float(w.std(unbiased=False)), rel=1e-9)


@pytest.mark.parametrize("family", ["opt", "gptj", "gpt_neox_parallel", "mistral", "qwen2", "gpt_neo"])
def test_every_causal_family_traces(family):
    loaded = loaded_tiny(family)
    t = trace_fact(loaded, Fact("the cat sat", "cat"), LocateOptions(samples=2, candidates=5))
    L, T = loaded.view.n_layers, len(t.token_ids)
    assert set(t.effects) == {"hidden", "ff_out", "attn_out"}
    assert all(v.shape == (L, T) and np.isfinite(v).all() for v in t.effects.values())
    # Before the subject nothing is corrupted, so restoring there changes nothing.
    for v in t.effects.values():
        np.testing.assert_allclose(v[:, :t.subject[0]], t.p_corrupted, atol=1e-6)
    # Restoring the last layer's hidden state at the last position gives the clean prediction exactly.
    assert t.effects["hidden"][L - 1, T - 1] == pytest.approx(t.p_clean, abs=1e-6)


def test_encoders_are_refused():
    with pytest.raises(FfkvError, match="encoder"):
        trace_fact(loaded_tiny("bert"), Fact("the cat sat", "cat"))


def test_subject_positions_and_refusals():
    loaded = loaded_tiny("gpt2")
    assert subject_positions(loaded, "the cat sat", "cat") == [3, 4, 5, 6]  # " cat": its leading space too
    with pytest.raises(FfkvError, match="does not occur"):
        subject_positions(loaded, "the cat sat", "dog")
    with pytest.raises(FfkvError, match="window"):
        trace_fact(loaded, Fact("the cat sat", "cat"), LocateOptions(window=9))


def test_windows_follow_rome():
    assert list(window_layers(5, 10, 48)) == list(range(0, 10))
    assert list(window_layers(20, 10, 48)) == list(range(15, 25))
    assert list(window_layers(47, 10, 48)) == list(range(42, 48))
    assert list(window_layers(2, 1, 3)) == [2]
    assert default_window(48) == 10 and default_window(3) == 1 and default_window(12) == 2


def test_facts_file_and_written_outputs(tmp_path):
    facts = tmp_path / "facts.jsonl"
    facts.write_text(json.dumps({"prompt": PROMPT, "subject": SUBJECT}) + "\n\n"
                     + json.dumps({"prompt": "ab cd", "subject": "ab", "attribute": "e"}) + "\n")
    read = read_facts(facts)
    assert read == [Fact(PROMPT, SUBJECT), Fact("ab cd", "ab", "e")]
    loaded = planted("gpt2")
    options = LocateOptions(samples=3, window=1, candidates=10)
    tracings = locate(loaded, read, options)
    assert tracings[1].answer_id == CharTokenizer().encode(" ")[0]  # "e" continues "ab cd" after a space
    paths = write_locate(tracings, tmp_path / "out", options, "planted")
    names = sorted(p.name for p in paths)
    assert names == sorted(["locate_facts.parquet", "locate_effects.parquet", "locate_memories.parquet", "locate.json",
                            "locate_fact_0.png", "locate_fact_0.svg", "locate_fact_1.png", "locate_fact_1.svg"])
    effects = pd.read_parquet(tmp_path / "out" / "locate_effects.parquet")
    first = effects[(effects.fact == 0) & (effects.kind == "ff_out")]
    assert len(first) == loaded.view.n_layers * len(PROMPT)
    row = first[(first.layer == PLANTED_LAYER) & (first.position == 2)].iloc[0]
    assert row.indirect_effect == pytest.approx(tracings[0].indirect_effect("ff_out")[PLANTED_LAYER, 2])
    assert bool(row.subject) and row.token == CharTokenizer().token_strings(CharTokenizer().encode("Q"))[0]
    facts_table = pd.read_parquet(tmp_path / "out" / "locate_facts.parquet")
    assert facts_table.total_effect.iloc[0] == pytest.approx(tracings[0].total_effect)
    assert not list((tmp_path / "out").glob(".*.tmp"))


@pytest.mark.parametrize("line, message", [("not json", "not JSON"), ('{"prompt": "a"}', "subject"),
                                           ('{"prompt": "a", "subject": "a", "answer": 3}', "answer")])
def test_damaged_facts_files_are_named(tmp_path, line, message):
    path = tmp_path / "facts.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(FfkvError, match=message):
        read_facts(path)


def test_the_papers_fairseq_model_traces(tmp_path):
    """The adaptive input's output is what is corrupted (`Architecture.embed` names it for fairseq)."""
    import ffkv.models  # noqa: F401 - registers the loaders
    from ffkv.models.loading import load_model
    from models.test_fairseq_lm import _write_checkpoint

    _write_checkpoint(tmp_path, cfg=True)
    loaded = load_model(str(tmp_path))
    t = trace_fact(loaded, Fact("w3 w20 w7 well", "w20"), LocateOptions(samples=2, candidates=4))
    L, T = loaded.view.n_layers, len(t.token_ids)
    assert t.p_corrupted != pytest.approx(t.p_clean, abs=1e-6)
    assert t.effects["hidden"][L - 1, T - 1] == pytest.approx(t.p_clean, abs=1e-6)
    np.testing.assert_allclose(t.effects["ff_out"][:, :t.subject[0]], t.p_corrupted, atol=1e-6)


@pytest.mark.parametrize("kind", ["transcoder", "sae"])
def test_tracing_names_the_latent_that_carries_the_planted_fact(kind):
    """A dictionary at the planted layer whose latent 3 reconstructs the planted memory's write (a transcoder
    latent reading the FF input with the memory's key; an SAE latent reading the FF output along its value) and
    whose other latents write nothing: restoring latent 3 at the cell restores the fact, the others do nothing."""
    from ffkv.dictionaries import Dictionary
    from ffkv.memories.sets import Latents

    loaded = planted("gpt2")
    view = loaded.view
    ids = torch.tensor([CharTokenizer().encode(PROMPT)])
    with torch.no_grad(), view.capture(("coefficients",), layers=[PLANTED_LAYER]) as m:
        view.forward(ids)
    m_clean = float(m["coefficients"][PLANTED_LAYER][0, -1, PLANTED_KEY])
    value = view.values(PLANTED_LAYER)[PLANTED_KEY].detach().clone()
    g = torch.Generator().manual_seed(1)
    n, d = 8, view.d_model
    encoder, decoder = torch.randn(n, d, generator=g), torch.zeros(n, d)
    bias = torch.zeros(n)
    if kind == "transcoder":  # a_3 = relu(k·x - 3): 3 on the clean subject, as the memory's pre-activation
        encoder[3], bias[3] = view.keys(PLANTED_LAYER)[PLANTED_KEY].detach(), -3.0
        decoder[3] = value * m_clean / 3.0
    else:  # a_3 = relu(v̂·FF(x)) = m·‖v‖ where m > 0
        encoder[3] = value / value.norm()
        decoder[3] = value / value.norm()
    dictionary = Dictionary(kind=kind, layer=PLANTED_LAYER, encoder=encoder, encoder_bias=bias, decoder=decoder,
                            decoder_bias=torch.zeros(d), activation="relu",
                            input_bias=torch.zeros(d) if kind == "sae" else None)
    latents = Latents(view, {PLANTED_LAYER: dictionary})
    t = trace_fact(loaded, Fact(PROMPT, SUBJECT), LocateOptions(samples=8, window=1, candidates=n), latents=latents)
    assert t.cell == (PLANTED_LAYER, len(PROMPT) - 1) and len(t.latents) == n
    top = t.latents.iloc[0]
    assert int(top.latent) == 3 and top.address == str(latents.ref(PLANTED_LAYER, 3))
    assert top.indirect_effect > 0.8 * t.total_effect
    # Brute force: the same corrupted rows with latent 3 set to its clean activation by `intervene` (attention is
    # off, so setting it at every position is restoring it at the subject's, the last).
    from ffkv.memories.interventions import Intervention, intervene
    from ffkv.tools.locate import _embed_width, _noise

    options = LocateOptions(samples=8, window=1)
    noise = _noise(view, t.subject, options, embedding_std(view), _embed_width(loaded))
    rows = ids.expand(1 + options.samples, -1)
    latents.attach()
    try:
        with torch.no_grad(), corrupt_and_restore(view, tuple(rows.shape), t.subject,
                                                  torch.cat([torch.zeros_like(noise[:1]), noise])), \
                intervene(view, [Intervention(PLANTED_LAYER, 3, "set", float(top.activation_clean), kind)]):
            p = loaded.model(input_ids=rows).logits[1:, -1].float().softmax(-1)[:, ANSWER].double().mean()
    finally:
        view.latents = None
    assert top.prob == pytest.approx(float(p), rel=1e-5, abs=1e-7)
    assert (t.latents.indirect_effect.iloc[1:].abs() < 1e-6).all()  # they write nothing
    with pytest.raises(AssertionError):  # a dictionary elsewhere traces no latent
        elsewhere = Latents(view, {0: Dictionary(**{**dictionary.__dict__, "layer": 0})})
        assert len(trace_fact(loaded, Fact(PROMPT, SUBJECT), LocateOptions(samples=2, window=1),
                              latents=elsewhere).latents)
