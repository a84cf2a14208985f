"""The trace read through the run's fitted translators (the tuned lens), on a run whose translators `ffkv analyze`
fitted: each layer's residual columns are the top tokens of N(A_l·h + b_l)·Eᵀ, computed here by hand from the saved
file; a run without translators does not offer the lens and refuses it with a clear error."""

from __future__ import annotations

import re

import pytest
import torch
from starlette.testclient import TestClient

from ffkv.experiments import analyze
from ffkv.explorer import create_app
from ffkv.memories.translators import RUN_FILE, Translators
from ffkv.presentation.style import token_html
from support.experiment_runs import make_run

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    run, loaded = make_run(tmp_path_factory.mktemp("lens"), "gpt2", n=60, top_k=5)
    analyze(run, only="translators", loaded=loaded, n_eval=10, progress=False)
    return run, loaded


def _columns(page: str, part: str) -> list[str]:
    """The top token of one column (before, ff, after) of the trace table, per layer, as the page shows it."""
    table = page.split('id="predictions"')[1].split("</table>")[0]
    cells = re.findall(rf'<td class="pred pred-{part}[^"]*">(.*?)<span class="small muted">', table, flags=re.S)
    return [re.sub(r"<[^>]+>", "", c).strip() for c in cells]


def test_the_tuned_lens_reads_each_residual_through_its_layers_translator(fitted):
    run, loaded = fitted
    view = loaded.view
    saved = Translators.load(run / RUN_FILE)
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT)])
    with view.capture(("resid_mid", "resid_post")) as cap:
        view.forward(ids, torch.ones_like(ids))

    def expected(quantity: str) -> list[int]:
        out = []
        for layer in range(view.n_layers):
            h = cap[quantity][layer][0, -1].double()
            translated = (h @ saved.weight[layer].double().T + saved.bias[layer].double()).float()
            out.append(int((view.final_norm(translated) @ view.unembedding.T).argmax()))
        return out

    with TestClient(create_app(run, loaded=loaded), base_url="http://127.0.0.1:8000") as client:
        tuned = client.get("/trace", params={"prompt": PROMPT, "lens": "translator"})
        logit = client.get("/trace", params={"prompt": PROMPT})
    assert tuned.status_code == 200 and logit.status_code == 200, tuned.text[-300:]
    def shown(token_ids: list[int]) -> list[str]:  # as the page writes a token
        return [re.sub(r"<[^>]+>", "", str(token_html(t))) for t in loaded.tokenizer.token_strings(token_ids)]

    assert _columns(tuned.text, "before") == shown(expected("resid_mid"))
    assert _columns(tuned.text, "after") == shown(expected("resid_post"))
    assert _columns(tuned.text, "before") != _columns(logit.text, "before")  # the lens is not the logit lens here
    assert _columns(tuned.text, "ff") == _columns(logit.text, "ff")  # the FF output is read as before (identity)
    assert "the tuned lens" in tuned.text and "the logit lens" in logit.text
    assert re.search(r'<option value="translator" selected>', tuned.text)
    assert saved.weight.abs().sum() > 0 and not torch.equal(saved.weight[0], torch.eye(view.d_model))


def test_a_run_without_translators_neither_offers_nor_accepts_the_tuned_lens(analyzed):
    run, loaded = analyzed
    with TestClient(create_app(run, loaded=loaded), base_url="http://127.0.0.1:8000",
                    raise_server_exceptions=False) as client:
        page = client.get("/trace", params={"prompt": PROMPT})
        refused = client.get("/trace", params={"prompt": PROMPT, "lens": "translator"})
        unknown = client.get("/trace", params={"prompt": PROMPT, "lens": "magic"})
    assert page.status_code == 200 and 'id="lens"' not in page.text
    assert refused.status_code == 404 and "--only translators" in refused.text
    assert unknown.status_code == 422 and "lens must be one of final-norm, translator" in unknown.text
