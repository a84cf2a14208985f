"""A chat-completions server or a model file that someone else controls (the second hostile-input audit, Why 3-5):
a real server on loopback (support.chat_server) that drips its answer, announces a huge one, answers with wrong
types, blank explanations or HTTP 500; credentials in the backend's URL; a foreign Parquet chunk in the journal;
GGUF files whose chat template probes the sandbox. Each is one line and the documented exit status, nothing
runs, nothing hangs, and nothing of it is stored as an explanation.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest

from ffkv.errors import DamagedRun
from ffkv.store.run import RunDir
from ffkv.tools.explain import explain
from ffkv.tools.llm_backends import LLMError, ServerBackend, TemplateRefused, redact_url
from support.chat_server import DRIP_SECONDS, ChatServer
from support.cli_runs import error_line, run
from support.explain_runs import PLANTED, install

MEMORIES = [(0, PLANTED), (0, 1)]


def _explain(run_dir, loaded, url, **options):
    backend = ServerBackend(url, "rule", concurrency=options.pop("concurrency", 2), timeout=options.pop("timeout", 10.0),
                            retries=options.pop("retries", 0), backoff=0.01)
    return explain(run_dir, backend, memories=MEMORIES, loaded=loaded, progress=False, say=lambda line: None,
                   **options)


# ------------------------------------------------------------------------------------------------ one deadline
@pytest.mark.parametrize("mode", ["drip", "drip_chunked"])
def test_a_dripping_answer_ends_at_the_deadline(fresh, mode):
    """The audit: 100 bytes every 50 ms kept `explain --timeout 5 --retries 0` running until killed, since the
    timeout bounded each socket read. Now the whole request has one deadline, and the stream is closed then."""
    run_dir, loaded = fresh
    with ChatServer(mode=mode) as server:
        began = time.monotonic()
        with pytest.raises(LLMError, match="no answer within 1 s, the deadline for connecting, sending and reading "
                                           "the whole answer") as caught:
            _explain(run_dir, loaded, server.url, timeout=1.0, concurrency=1)
        took = time.monotonic() - began
    assert took < DRIP_SECONDS / 2, took  # ends near the deadline, not when the server stops dripping
    assert "\n" not in str(caught.value) and not RunDir(run_dir).has_metric("explanations")


def test_an_answer_longer_than_the_cap_is_refused_unread(fresh):
    run_dir, loaded = fresh
    with ChatServer(mode="huge") as server:
        with pytest.raises(LLMError, match="answered with 999,999,999 bytes, more than the 16 MiB"):
            _explain(run_dir, loaded, server.url, retries=2, concurrency=1)
        assert len(server.requests) == 1  # not asked again: the same server would answer the same


# ------------------------------------------------------------------------------------------------ credentials
@pytest.mark.parametrize("spec_url, secret", [("http://{host}/v1?api_key=SECRET-IN-QUERY&api-version=1", "SECRET-IN-QUERY"),
                                              ("http://alice:SECRET-PASSWORD@{host}/v1", "SECRET-PASSWORD")])
def test_credentials_in_the_url_never_reach_the_run_or_the_terminal(fresh, capsys, spec_url, secret):
    """The audit: `--explainer 'openai:http://host/v1?api_key=SECRET#m'` stored SECRET in explanations.parquet and
    printed it. The request still carries them (the server sees them); the run and the terminal never do."""
    install()
    run_dir, _ = fresh
    seen = []
    with ChatServer() as server:
        import http.server

        real = http.server.BaseHTTPRequestHandler.parse_request

        def spy(self):
            ok = real(self)
            seen.append((self.path, self.headers.get("Authorization")))
            return ok

        http.server.BaseHTTPRequestHandler.parse_request = spy
        try:
            host = server.url.split("/")[2]
            spec = f"openai:{spec_url.format(host=host)}#rule"
            code, out, err = run(capsys, "explain", run_dir, "--explainer", spec, "--memories", "1:5", "--no-progress")
        finally:
            http.server.BaseHTTPRequestHandler.parse_request = real
    assert code == 0, err
    assert secret not in out + err and "alice:" not in out + err
    assert any(secret in (path or "") or (auth or "").startswith("Basic ") for path, auth in seen)
    for path in Path(run_dir).rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    stored = RunDir(run_dir).read_metric("explanations")["explainer"].iloc[0]
    assert stored == f"openai:{redact_url(spec_url.format(host=host))}#rule" and secret not in stored


def test_redact_url():
    assert redact_url("https://u:p@h:8/v1?api_key=S&access_token=T&x=1") == "https://h:8/v1?api_key=***&access_token=***&x=1"
    assert redact_url("http://h/v1") == "http://h/v1"


# ------------------------------------------------------------------------------------------- what comes back
def test_usage_of_the_wrong_type_is_estimated_not_a_traceback(fresh):
    """The audit: `"usage": "x"` gave an AttributeError traceback."""
    run_dir, loaded = fresh
    with ChatServer(mode="bad_usage") as server:
        rows = _explain(run_dir, loaded, server.url)
    assert len(rows) == 2 * len(MEMORIES) and (rows["prompt_tokens"] > 0).all()


def test_a_blank_explanation_is_never_stored(fresh, capsys):
    """The audit: an empty or whitespace answer was stored as an explanation of length 0, exit 0. Now nothing is
    stored for it, a warning names the memories, and the next explain asks again for them."""
    install()
    run_dir, _ = fresh
    with ChatServer(mode="blank", fail_from=3) as server:  # the first two answers are real
        code, out, err = run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--memories",
                             "1:5,1:1", "--concurrency", "1", "--no-progress")
    assert code == 0
    warning = [line for line in err.splitlines() if line.startswith("ffkv: warning: explain:")]
    assert len(warning) == 1 and "answered 2 of 4 prompts with no explanation" in warning[0]
    kept = RunDir(run_dir).read_metric("explanations")
    assert len(kept) == 2 and (kept["explanation"].str.strip().str.len() > 0).all()
    with ChatServer() as server:
        assert run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--memories", "1:5,1:1",
                   "--no-progress")[0] == 0
        assert len(server.requests) == 2  # only the two refused
    assert len(RunDir(run_dir).read_metric("explanations")) == 4


def test_a_server_error_before_any_answer_writes_no_table(fresh, capsys):
    """The audit: HTTP 500 on the first request left explanations.parquet with one column and 0 rows, which
    `score` called damaged and `status --verify` called whole."""
    install()
    run_dir, _ = fresh
    with ChatServer(mode="error500") as server:
        code, _, err = run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--memories",
                           "1:5", "--retries", "0", "--no-progress")
    assert code == 2 and "Traceback" not in err and "HTTP 500" in err.strip().splitlines()[-1]
    assert not RunDir(run_dir).has_metric("explanations")
    assert "metrics/explanations.parquet" not in RunDir(run_dir).manifest().tables
    assert run(capsys, "status", run_dir, "--verify")[0] == 0


def test_a_foreign_journal_chunk_is_named_before_anything_is_asked(fresh, capsys):
    """The audit: a valid but foreign Parquet file as a journal chunk gave a traceback after every request was
    answered, and every rerun hit it again."""
    install()
    run_dir, _ = fresh
    folder = Path(run_dir) / "journal" / "explanations"
    folder.mkdir(parents=True)
    chunk = folder / "00000000000000000001-deadbeef.parquet"
    pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}).to_parquet(chunk)
    with ChatServer() as server:
        code, _, err = run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--memories",
                           "1:5", "--no-progress")
        assert not server.requests
    line = error_line(err)
    assert code == DamagedRun.exit_code and str(chunk) in line and f"rm {chunk}" in line
    chunk.unlink()  # the advice, followed
    with ChatServer() as server:
        assert run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--memories", "1:5",
                   "--no-progress")[0] == 0


# ------------------------------------------------------------------------------------- a model file's template
@pytest.mark.parametrize("template, says", [
    ("{{ messages.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"),
    ("{{ self.__init__.__globals__ }}", "SecurityError"),
    ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    ("{{ raise_exception('no chats here') }}", "no chats here"),
])
def test_a_chat_template_that_probes_the_sandbox_is_one_line(fresh, tmp_path, capsys, template, says):
    """The audit: such a GGUF chat template gave a 49-line traceback with exit 1 (the file-system status)."""
    pytest.importorskip("gguf")
    from support.gguf_files import tiny_llama, tokens, write_gguf

    install()
    run_dir, _ = fresh
    words = tokens()
    path = tmp_path / "hostile.gguf"
    write_gguf(tiny_llama(len(words)), words, path, chat_template=template)
    code, _, err = run(capsys, "explain", run_dir, "--explainer", f"local:{path}", "--memories", "1:5",
                       "--no-progress")
    lines = [line for line in err.splitlines() if "GGUF tensors" not in line]  # transformers' own progress bar
    line = error_line("\n".join(lines))
    assert code == TemplateRefused.exit_code == 2
    assert "the model file's chat template is refused" in line and says in line
    assert not RunDir(run_dir).has_metric("explanations")


# ------------------------------------------------------------------------------------------- latents' answers
def test_a_latents_blank_or_malformed_answer_is_checked_as_a_neurons(fresh_latents, capsys):
    """The same checks for a dictionary's latents (`explain --latents`): a blank explanation is never stored and the
    warning names the latents by their addresses; a malformed answer is one line, and what was finished is kept."""
    install()
    run_dir, _ = fresh_latents
    with ChatServer(mode="blank", fail_from=3) as server:  # the first two answers are real
        code, _, err = run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--latents",
                           "--sample", "4", "--concurrency", "1", "--no-progress")
    assert code == 0
    warning = [line for line in err.splitlines() if line.startswith("ffkv: warning: explain:")]
    assert len(warning) == 1 and "answered 2 of 4 prompts with no explanation" in warning[0]
    assert "latent t1:" in warning[0]
    kept = RunDir(run_dir).read_metric("explanations")
    assert len(kept) == 2 and set(kept["kind"]) == {"latent"} and (kept["explanation"].str.strip() != "").all()
    with ChatServer(mode="malformed", fail_from=2) as server:
        code, _, err = run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--latents",
                           "--sample", "4", "--controls", "2", "--concurrency", "1", "--retries", "0",
                           "--no-progress")
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("ffkv: error: ") and "malformed answer" in line and "Traceback" not in err
    kept = RunDir(run_dir).read_metric("explanations")
    assert len(kept) == 3 and (kept["explanation"].str.strip() != "").all()  # one more, finished before the failure
    with ChatServer() as server:
        assert run(capsys, "explain", run_dir, "--explainer", f"openai:{server.url}#rule", "--latents", "--sample",
                   "4", "--controls", "2", "--no-progress")[0] == 0
        assert len(server.requests) == 3  # only what was missing
    assert sorted(RunDir(run_dir).read_metric("explanations")["kind"]) == ["latent"] * 4 + ["latent_control"] * 2
