"""Every page type of the explorer on a run written by the real pipeline (index, then every experiment of
`ffkv analyze`): 200 with the content each page promises, for the keys every experiment covered."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

import ffkv
from ffkv.explorer import create_app
from ffkv.store.run import RunDir


@pytest.fixture(scope="module")
def client(analyzed):
    run, loaded = analyzed
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded), raise_server_exceptions=False) as c:
        yield c


def covered_keys(run) -> list[tuple[int, int]]:
    """Keys that every experiment covered: the ablations' sample (patterns and values cover every key)."""
    ablated = RunDir(run).read_metric("ablations_prefixes")[["layer", "key"]].drop_duplicates()
    return [(int(layer), int(key)) for layer, key in ablated.itertuples(index=False)]


def test_memory_pages_show_triggers_and_the_automatic_label(client, analyzed):
    run, _ = analyzed
    labels = RunDir(run).read_metric("patterns_keys").set_index(["layer", "key"])
    keys = covered_keys(run)
    assert len(keys) >= 10
    for layer, key in keys:
        r = client.get(f"/memory/{layer + 1}/{key}")  # pages count layers from 1
        assert r.status_code == 200, (layer, key, r.text[-300:])
        assert r.text.count('class="t trig') >= 1 and 'id="triggers"' in r.text
        label = re.search(r'id="auto-label">(\w+)<', r.text)
        assert label and label.group(1) == labels.at[(layer, key), "label"], (layer, key)


@pytest.mark.parametrize("url, expect", [
    ("/", 'id="layers"'),
    ("/layer/1", 'id="keys"'),
    ("/layer/3?sort=pattern&order=desc", 'id="keys"'),
    ("/memory/3/5.json", '"trigger_examples"'),
    ("/search?token=%2310", 'id="promoting"'),
    ("/search?q=born", 'id="hits"'),
    ("/trace?prompt=she+was+born+in", 'id="predictions"'),
    ("/trace?prompt=she+was+born+in&off=3:3&scale=2:4=10", "with interventions"),
])
def test_every_page_type_answers(client, url, expect):
    r = client.get(url)
    assert r.status_code == 200, r.text[-500:]
    assert expect in r.text


def test_memory_links_of_every_page_lead_to_answering_pages(client):
    for url in ("/layer/2", "/search?q=city", "/trace?prompt=the+cat+sat"):
        links = sorted(set(re.findall(r'href="(/memory/\d+/\d+)"', client.get(url).text)))
        assert links, url
        for link in links[:15]:
            assert client.get(link).status_code == 200, (url, link)


def test_annotate_on_an_analyzed_run(fresh_run):
    run, loaded = fresh_run
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded)) as c:
        r = c.post("/memory/2/3/annotate", data={"label": "shallow", "annotator": "kim"}, follow_redirects=False)
        assert r.status_code == 303
        page = c.get("/memory/2/3").text
        assert "kim" in page and 'id="auto-label"' in page


def test_notebook_memory_of_an_analyzed_run(analyzed):
    run, loaded = analyzed
    html = ffkv.open_run(run, loaded).memory(0, 0)._repr_html_()
    assert 'id="auto-label"' in html and 'id="triggers"' in html
