"""Where a reader finds explanations and scores: the report's section, the memory page and its JSON, `Run`.

Built by the real pipeline: index (support.explain_runs), `explain` and `score` against the loopback server,
then `analyze --only explanation_scores` (its figure, and the explorer's lookup tables), `report` and the explorer.
"""

from __future__ import annotations

import pytest
from markupsafe import escape

from ffkv.api import Run
from ffkv.errors import FfkvError
from ffkv.experiments import analyze
from ffkv.report import write_report
from ffkv.tools.explain import explain
from ffkv.tools.llm_backends import ServerBackend
from ffkv.tools.score import score
from support.chat_server import ChatServer
from support.explain_runs import PLANTED, planted_run

MEMORIES = [(0, PLANTED), (0, 1), (1, 2), (1, 3)]


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    run, loaded = planted_run(tmp_path_factory.mktemp("surfaces"))
    with pytest.raises(FfkvError, match="run ffkv score first"):
        analyze(run, only=["explanation_scores"], loaded=loaded, progress=False)
    with ChatServer() as server:
        backend = ServerBackend(server.url, "rule")
        explain(run, backend, memories=MEMORIES, controls=2, loaded=loaded, progress=False, say=lambda line: None)
        score(run, backend, loaded=loaded, progress=False, say=lambda line: None)
    analyze(run, only=["explanation_scores"], loaded=loaded, progress=False)
    return run, loaded


def test_run_carries_each_memorys_explanation_and_score(scored):
    run, loaded = scored
    table = Run(run, loaded).explanations()
    assert len(table) == 2 * len(MEMORIES)  # both directions
    planted = table[(table["layer"] == 0) & (table["key"] == PLANTED) & (table["direction"] == 1)].iloc[0]
    assert planted["explanation"].startswith("Fires on the character") and planted["score"] > 0.99
    assert planted["shuffled_score"] < 0.5 and planted["simulator"].startswith("openai:")


def test_the_report_has_a_section_with_the_figure_and_both_baselines(scored):
    run, _ = scored
    html = write_report(run).read_text()
    assert "Explanations of memories, scored by simulation" in html
    assert "explanation_scores_by_layer" in html and (run / "figures" / "explanation_scores.png").is_file()
    for column in ("shuffled", "control", "score minus shuffled"):
        assert column in html


def test_the_memory_page_and_its_json_show_the_explanation_score_and_explainer(scored):
    from ffkv.explorer.data import ExplorerData
    from ffkv.explorer.pages import memory_json, memory_page

    run, loaded = scored
    data = ExplorerData(run, loaded)
    page = memory_page(data, 1, PLANTED)
    got = memory_json(data, 1, PLANTED)["explanations"]
    assert [x["direction"] for x in got] == [1, -1]
    assert str(escape(got[0]["explanation"])) in page and "openai:http://127.0.0.1:" in page and f"{got[0]['score']:.2f}" in page
    assert memory_json(data, 1, 0)["explanations"] == [] and 'id="explanations"' not in memory_page(data, 1, 0)
