"""The census and suppressed memories on a run written by the real pipeline (index, then every experiment of
`ffkv analyze`): the report has their sections, the explorer's memory pages a census badge and its layer pages
a census filter, all answering 200 with what the run's own tables say."""

from __future__ import annotations

import html
import re

import pytest
from starlette.testclient import TestClient

from ffkv.explorer import create_app
from ffkv.report import write_report
from ffkv.store.run import RunDir


@pytest.fixture(scope="module")
def client(analyzed):
    run, loaded = analyzed
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded),
                    raise_server_exceptions=False) as c:
        yield c


def test_report_has_the_census_and_suppressed_sections(analyzed):
    run, _ = analyzed
    page = write_report(run).read_text()
    for section in ("census", "suppressed"):
        assert f'id="analysis-{section}"' in page, section
    census = page[page.index('id="analysis-census"'):]
    census = census[:census.index("</section>")]
    assert "metrics/census_layers.parquet" in census and "metrics/census_typical.parquet" in census
    assert "Voita et al. 2023" in census and "Measured here:" in census and "are dead" in census
    assert census.count("<img") == 3  # the classes, the value types, and the classes of the random key directions
    assert "metrics/census_control.parquet" in census
    suppressed = page[page.index('id="analysis-suppressed"'):]
    suppressed = suppressed[:suppressed.index("</section>")]
    assert "metrics/suppressed_examples.parquet" in suppressed and "metrics/suppressed.parquet" in suppressed
    assert "gold token first in" in suppressed and "delta p" in suppressed


def test_memory_pages_carry_the_census_badge(client, analyzed):
    run, _ = analyzed
    census = RunDir(run).read_metric("census").set_index(["layer", "key"])
    for layer, key in [(0, 0), (1, 3), (2, 7)]:
        r = client.get(f"/memory/{layer + 1}/{key}")
        assert r.status_code == 200, r.text[-300:]
        badge = re.search(r'id="census-badge"><strong>Census:</strong> <span class="chip label-(\w+)">', r.text)
        assert badge and badge.group(1) == census.at[(layer, key), "class"]
        assert f"value: {census.at[(layer, key), 'value_type']}" in r.text


def column_cells(page: str, title: str) -> list[str]:
    """The text of each row's cell under the column `title` of a layer page's key table."""
    headers = [re.sub(r"<[^>]+>|[▲▼]", "", h).strip() for h in re.findall(r"<th[^>]*>(.*?)</th>", page, flags=re.S)]
    at = headers.index(title)
    rows = re.findall(r'<tr>(.*?)</tr>', page.split('id="keys"')[1], flags=re.S)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S) for row in rows]
    return [html.unescape(re.sub(r"<[^>]+>", "", c[at])).strip() for c in cells if c]


def test_layer_pages_filter_by_census(client, analyzed):
    run, _ = analyzed
    census = RunDir(run).read_metric("census")
    r = client.get("/layer/1")
    assert r.status_code == 200 and 'id="census-filter"' in r.text
    # Each filter keeps the keys its own column names (the issue: ?census=prediction kept value types while the
    # only census column showed classes, 7 of 8 rows "other").
    columns = {"dead": "class", "detector": "class", "positional": "class", "other": "class",
               "prediction": "value_type", "suppression": "value_type", "neither": "value_type",
               "eraser": "eraser", "two_way": "two_way"}
    for name, column in columns.items():
        r = client.get(f"/layer/2?census={name}&sort=key")
        assert r.status_code == 200, (name, r.text[-300:])
        g = census[census["layer"] == 1]
        expected = g[column].astype(bool) if column in ("eraser", "two_way") else g[column] == name
        keys = [int(k) for k in re.findall(r'href="/memory/2/(\d+)"', r.text.split('id="keys"')[1])]
        assert sorted(set(keys)) == sorted(g.loc[expected.to_numpy(bool), "key"].astype(int).tolist()), name
        shown = column_cells(r.text, {"class": "census", "value_type": "value type", "eraser": "eraser",
                                      "two_way": "fires both ways"}[column])
        assert set(shown) <= {name if column in ("class", "value_type") else "yes"}, (name, shown)
    # A detector's row says what it detects (its rule, as the census writes it); other rows leave it empty.
    def detects(page: str) -> dict[int, str]:
        headers = re.findall(r"<th[^>]*>(.*?)</th>", page, flags=re.S)
        at = next(i for i, h in enumerate(headers) if re.sub(r"<[^>]+>", "", h).strip().startswith("detects"))
        rows = re.findall(r'<tr>(.*?)</tr>', page.split('id="keys"')[1], flags=re.S)
        cells = [re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S) for row in rows]
        return {int(re.search(r">(\d+)<", c[0]).group(1)): html.unescape(c[at]) for c in cells if c}

    g = census[census["layer"] == 1]
    shown = detects(client.get("/layer/2?census=detector&sort=detects&order=desc").text)
    detectors = g[g["class"] == "detector"]
    assert len(detectors) > 0 and shown == dict(zip(detectors["key"].astype(int), detectors["rule"]))
    others = g[(g["class"] == "other") & (g["rule"] != "")]
    assert len(others) > 0 and set(detects(client.get("/layer/2?census=other").text).values()) == {""}
    assert client.get("/layer/2?census=nonsense").status_code == 422
