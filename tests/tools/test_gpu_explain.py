"""`ffkv explain` and `ffkv score` with `--device cuda`: the same prompts and scores as on the CPU.

Two GPU paths: the run's model on the GPU (the true coefficients the prompts mark and the scores correlate with),
and a local explainer and simulator on the GPU (`LocalBackend`: greedy answers and all-at-once simulations).
Both need CUDA and are skipped without it (CI has no GPU); a session lent a GPU runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ffkv.corpus import shared_data_dir
from ffkv.models.loading import LoadedModel
from ffkv.tools.explain import explain
from ffkv.tools.llm_backends import LocalBackend, ServerBackend
from ffkv.tools.score import score, simulation_messages
from support.chat_server import ChatServer
from support.explain_runs import PLANTED, planted_run
from support.helpers import on_device
from support.runs import copy_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")

GPT2 = (shared_data_dir() or Path("/nonexistent")) / "tokenizers" / "gpt2"
MEMORIES = [(0, PLANTED), (0, 1), (0, 2)]


def _explain_and_score(run: Path, loaded: LoadedModel):
    with ChatServer() as server:
        backend = ServerBackend(server.url, "rule", concurrency=2, timeout=10.0, retries=1, backoff=0.01)
        rows = explain(run, backend, memories=MEMORIES, controls=2, loaded=loaded, progress=False,
                       say=lambda line: None)
        table, _ = score(run, backend, loaded=loaded, progress=False, say=lambda line: None)
    return rows, table


def test_the_runs_model_on_the_gpu_gives_the_cpus_prompts_and_scores(tmp_path):
    run, loaded = planted_run(tmp_path / "planted")
    on_cpu = _explain_and_score(copy_run(run, tmp_path / "cpu"), loaded)
    on_gpu = _explain_and_score(copy_run(run, tmp_path / "gpu"), on_device(loaded, "cuda"))
    cols = ["kind", "layer", "key", "direction"]
    rows = [r.sort_values(cols).reset_index(drop=True) for r, _ in (on_cpu, on_gpu)]
    assert len(rows[0]) == 2 * (len(MEMORIES) + 2)
    # The prompts mark each token's coefficient to two significant digits: the same text, hence the same hash.
    assert list(rows[0]["prompt_sha256"]) == list(rows[1]["prompt_sha256"])
    assert list(rows[0]["explanation"]) == list(rows[1]["explanation"])
    tables = [t.sort_values(cols + ["baseline"]).reset_index(drop=True) for _, t in (on_cpu, on_gpu)]
    assert list(tables[0]["n_tokens"]) == list(tables[1]["n_tokens"])
    assert tables[1]["score"].to_numpy() == pytest.approx(tables[0]["score"].to_numpy(), abs=1e-4)
    assert tables[0]["score"].max() > 0.99  # the planted memory's right explanation, on both


@pytest.mark.skipif(not GPT2.exists(), reason=f"the GPT-2 tokenizer is not at {GPT2}")
def test_a_local_backend_on_the_gpu_answers_as_on_the_cpu(tmp_path):
    """A tiny random Llama with GPT-2's tokenizer and a plain chat template, saved as a transformers directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(GPT2))
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "chat")
    tok.save_pretrained(tmp_path / "chat")
    cpu, gpu = (LocalBackend(str(tmp_path / "chat"), device=d, concurrency=2) for d in ("cpu", "cuda"))
    assert gpu.device.type == "cuda" and cpu.identity == gpu.identity  # the weights' hash, wherever they run
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answers = [b.chat(chat, 6) for b in (cpu, gpu)]
    assert answers[0].prompt_tokens == answers[1].prompt_tokens and answers[1].completion_tokens > 0
    assert answers[0].text == answers[1].text
    pieces = [" In", " 1996", " the", " band", ",", " a"]
    sims = [b.simulate(simulation_messages("Fires on years.", pieces), len(pieces)) for b in (cpu, gpu)]
    assert sims[1].expected and sims[1].values.shape == (6,)
    assert sims[1].values == pytest.approx(sims[0].values, abs=1e-3)
    assert sims[0].prompt_tokens == sims[1].prompt_tokens
