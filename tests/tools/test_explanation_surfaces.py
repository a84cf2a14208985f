"""Where a reader finds explanations and scores: the report's section, the memory page and its JSON, `Run`.

Built by the real pipeline: index (support.explain_runs), `explain` and `score` against the loopback server,
then `analyze --only explanation_scores` (its figure, and the explorer's lookup tables), `report` and the explorer.
"""

from __future__ import annotations

import re

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


def test_the_layer_page_sorts_and_filters_by_explanation_score(scored):
    from ffkv.explorer.data import ExplorerData
    from ffkv.explorer.pages import layer_page
    from ffkv.explorer.validation import BadRequest

    run, loaded = scored
    data = ExplorerData(run, loaded)
    table = Run(run, loaded).explanations()
    best = table[table["layer"] == 0].groupby("key")["score"].max()  # the page's score: a key's best direction
    assert best.idxmax() == PLANTED and best[PLANTED] > 0.99 and best.drop(PLANTED).max() < 0.9

    page = layer_page(data, 1, sort="explanation score", order="desc")
    rows = page.split('<table id="keys">')[1].split("<tr>")[2:]  # the header row, then one row per key
    assert f'/memory/1/{PLANTED}"' in rows[0] and f"{best[PLANTED]:.2f}"[:3] in rows[0]
    assert "Fires on the character" in rows[0] and 'id="score-filter"' in page
    header_row = page.split('<table id="keys">')[1].split("<tr>")[1]
    headers = re.findall(r"<th[^>]*>(?:<a [^>]*>)?([^<▲▼]+?)\s*(?:[▲▼])?(?:</a>)?</th>", header_row)
    # read first: right after the key (and the pattern and description, where the run has them), where a
    # 1280-pixel window shows them without scrolling (this run has no patterns)
    assert headers[:3] == ["key", "explanation", "explanation score"]
    assert f'/memory/1/1"' in rows[1]  # the other explained key next; unexplained keys after (NaN last)

    kept = layer_page(data, 1, sort="explanation score", order="desc", min_score="0.9")
    assert kept.count('href="/memory/1/') == 1 and f'/memory/1/{PLANTED}"' in kept
    assert "&amp;min_score=0.9" in kept  # the sort links keep the filter
    everything = layer_page(data, 1, min_score="-1")
    assert everything.count('href="/memory/1/') == len(best)  # every scored key, no unexplained one
    for bad in ("2", "x"):
        with pytest.raises(BadRequest, match="min_score must be a number from -1 to 1"):
            layer_page(data, 1, min_score=bad)
    data.explanations = data.explanations.iloc[0:0]  # as before `ffkv explain`: no column, no form, a clear 404
    plain = layer_page(data, 1)
    assert "explanation score" not in plain and 'id="score-filter"' not in plain
    with pytest.raises(BadRequest, match="no memory of this layer has a scored explanation") as refused:
        layer_page(data, 1, min_score="0")
    assert refused.value.status == 404


def test_search_finds_memories_by_their_explanations_words(scored):
    from ffkv.explorer.data import ExplorerData
    from ffkv.explorer.pages import search_page

    run, loaded = scored
    data = ExplorerData(run, loaded)
    table = Run(run, loaded).explanations()
    words = ("character", "fires")
    expected = table[table["explanation"].str.lower().map(lambda x: all(w in x for w in words))]
    assert len(expected) == len(table)  # every rule-server explanation holds both words
    hits = data.explanation_search("Fires  CHARACTER")
    assert len(hits) == len(expected) and hits[0]["layer"] == 0 and hits[0]["key"] == PLANTED
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    planted_char = table[(table["layer"] == 0) & (table["key"] == PLANTED) & (table["direction"] == 1)].iloc[0]
    quoted = planted_char["explanation"].split("'")[1].lower()
    query = ("character", quoted)  # each matches where a word starts ("a" is not found inside "character")

    def starts_a_word(term: str, text: str) -> bool:
        return any(text.startswith(term, i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))
                   for i in range(len(text)))

    oracle = {(int(r.layer), int(r.key), int(r.direction)) for r in table.itertuples()
              if all(starts_a_word(q, r.explanation.lower()) for q in query)}
    assert not starts_a_word("a", "character") and starts_a_word("$", "the character '$'")
    narrow = data.explanation_search(" ".join(query))
    assert (0, PLANTED, 1) in oracle and {(h["layer"], h["key"], h["direction"]) for h in narrow} == oracle
    assert data.explanation_search("submarine") == []
    page = search_page(data, q="character")
    assert 'id="explained"' in page and f'/memory/1/{PLANTED}"' in page
    assert 'id="no-explained"' in search_page(data, q="submarine")


def test_an_explanations_table_without_its_columns_is_named_as_damaged(scored, tmp_path):
    """A run is hostile until checked: an explanations table recorded by the run but lacking a column the pages
    read is named as damaged (metrics/explanations.parquet), not a KeyError from deep inside a page."""
    from ffkv.errors import DamagedRun
    from ffkv.explorer.data import ExplorerData
    from ffkv.store.run import RunDir
    from support.runs import copy_run

    run, loaded = scored
    copy = copy_run(run, tmp_path / "run")
    table = RunDir(copy).read_metric("explanations").drop(columns=["explanation"])
    RunDir(copy).write_metric("explanations", table, {"hand-written": True}, step="explain")
    with pytest.raises(DamagedRun, match="explanations.parquet"):
        ExplorerData(copy, loaded)
