"""The overview's "Latents beside neurons" on what the real pipeline writes: ffkv-tiny indexed with its shipped
transcoder (layer 4), every latent study and latents_beside analysed. The section's numbers, labels and verdicts
are the parquet table's rows; the fidelity is the dictionary table's; the forest figure is the one the analysis
saved, shown once. A run with a dictionary but no table names the command that computes it; a run without a
dictionary has no section; a damaged or hostile table is named as damaged, never shown in part, never a 500."""

from __future__ import annotations

import re
import shutil
from html import unescape
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from ffkv.corpus import CorpusSpec
from ffkv.experiments import analyze
from ffkv.experiments.latents_beside import MEASURES
from ffkv.explorer import create_app
from ffkv.explorer.beside import count, points, share
from ffkv.indexing.indexer import IndexOptions, build_index
from ffkv.models import load_model
from ffkv.models.default_corpus import default_corpus_path
from ffkv.models.tiny_lm import tiny_transcoders_path
from ffkv.presentation.style import number
from ffkv.store.run import RunDir

LATENT_STUDIES = ["patterns", "values", "composition", "census", "vocabulary_classes", "suppressed"]


def _index(folder: Path, loaded, dictionary: bool) -> Path:
    spec = CorpusSpec(source=str(default_corpus_path("train")), unit="line", max_examples=40, shuffle_seed=0)
    build_index(loaded, spec, folder, IndexOptions(top_k=4, control_keys=16), progress=False,
                dictionary=tiny_transcoders_path() if dictionary else None)
    return folder


def _analyze(run: Path, loaded, only: list[str]) -> None:
    analyze(run, only=only, loaded=loaded, progress=False, n_eval=20)


@pytest.fixture(scope="module")
def tiny():
    return load_model("ffkv-tiny")


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, tiny):
    return _index(tmp_path_factory.mktemp("beside") / "indexed", tiny, dictionary=True)


@pytest.fixture(scope="module")
def run(indexed, tiny):
    run = shutil.copytree(indexed, indexed.parent / "analyzed")
    _analyze(run, tiny, [*LATENT_STUDIES, "latents_beside"])
    return run


def _overview(run: Path, loaded) -> str:
    with TestClient(base_url="http://127.0.0.1:8000", app=create_app(run, loaded=loaded),
                    raise_server_exceptions=False) as c:
        response = c.get("/")
    assert response.status_code == 200 and "Traceback" not in response.text
    return response.text


def _cell(row: str, cls: str) -> tuple[str, ...]:
    """A cell's text and the text of each of its spans (the interval, the line under it)."""
    body = re.search(rf'<td class="[^"]*\b{cls}\b[^"]*">(.*?)</td>', row, re.S).group(1)
    return tuple(unescape(re.sub(r"<[^>]+>", "", part)) for part in re.split(r"<span[^>]*>", body))


def _rows(html: str, name: str) -> dict[str, str]:
    table = re.search(rf'<table class="beside-table" id="beside-table-{name}">(.*?)</table>', html, re.S).group(1)
    return dict(re.findall(r'<tr data-measure="([^"]+)">(.*?)</tr>', table, re.S))


def test_the_section_shows_the_tables_rows(run, tiny):
    html = _overview(run, tiny)
    table = pd.read_parquet(run / "metrics" / "latents_beside.parquet")
    assert len(table) >= 10 and set(table.study) == {f"{s}_latents" for s in LATENT_STUDIES}
    shown = _rows(html, "t4")
    assert list(shown) == table.measure.tolist()  # every row, in the table's order
    labels = {(m.table, m.column): m.label for m in MEASURES}
    for r in table.itertuples():
        row = shown[r.measure]
        name, label = _cell(row, "measure")
        assert (name, label) == (r.measure, labels[(r.study, r.measure)]) == (r.measure, r.label)
        for kind in ("latents", "neurons"):
            value, interval = _cell(row, f"{kind}-share")
            low, high = (getattr(r, f"{kind}_ci_{s}") for s in ("low", "high"))
            assert (value, interval) == (share(getattr(r, kind)), f"[{share(low)}, {share(high)}]")
            assert _cell(row, f"{kind}-n") == (count(getattr(r, f"n_{kind}")),)
            assert _cell(row, f"{kind}-null") == (share(getattr(r, f"{kind}_null")),)
        difference, interval, means = _cell(row, "difference")
        assert (difference, interval, means) == (points(r.difference), f"[{points(r.difference_ci_low)}, "
                                                 f"{points(r.difference_ci_high)}]", r.difference_means)
        assert _cell(row, "verdict") == (r.verdict,)  # the table's words
    # the numbers read in points are the table's: −0.2 is -0.002, not -0.2
    assert points(-0.002) == "−0.2" and points(0.0191) == "+1.9" and points(0.0) == "0.0"
    assert points(float("nan")) == share(float("nan")) == "—"

    fidelity = pd.read_parquet(run / "metrics" / "latents_beside_dictionary.parquet").iloc[0]
    box = re.search(r'<div class="fidelity-beside" id="beside-fidelity-t4">(.*?)</div>', html, re.S).group(1)
    found = dict(re.findall(r'<strong class="([a-z-]+)">([^<]+)</strong>', box))
    assert found == {"fvu": number(fidelity.fvu, 3), "loss-recovered": number(fidelity.loss_recovered, 3),
                     "dead": f"{fidelity.dead_latents:,} of {fidelity.n_latents:,} ({share(fidelity.dead_share)})"}
    # the forest figure the analysis saved, in the section, not again among the figures
    assert re.search(r'<figure id="beside-figure"><img src="/files/figures/latents_beside.png"', html)
    assert re.findall(r'<figcaption class="small muted">([^<]+)</figcaption>', html).count("latents_beside") == 1


def test_a_dictionary_run_without_the_table_names_the_command(indexed, tiny):
    """Before any analyze, and after one of latents_beside alone (no latent study: an empty table)."""
    run = shutil.copytree(indexed, indexed.parent / "not_analyzed")
    html = _overview(run, tiny)
    assert 'id="latents-beside"' in html and "beside-table" not in html
    every = (f"ffkv analyze {run} --only patterns,values,census,composition,suppressed,vocabulary_classes,"
             "confidence_neurons,latents_beside")
    assert unescape(re.search(r'id="beside-missing">(.*?)</p>', html, re.S).group(1)).count(every) == 1
    _analyze(run, tiny, ["latents_beside"])
    assert pd.read_parquet(run / "metrics" / "latents_beside.parquet").empty
    html = _overview(run, tiny)
    assert "beside-table" not in html and every in unescape(html)
    _analyze(run, tiny, ["values"])
    assert "--only patterns,census,composition,suppressed,vocabulary_classes,confidence_neurons,latents_beside" \
        in _overview(run, tiny)


def test_a_run_without_a_dictionary_has_no_section(indexed, tiny):
    run = _index(indexed.parent / "plain", tiny, dictionary=False)
    _analyze(run, tiny, ["values", "latents_beside"])
    main = _overview(run, tiny).split("<main>", 1)[1]
    assert "Latents beside neurons" not in main and "beside" not in main and '<h2 id="figures">Figures</h2>' in main


def _rewrite(run: Path, name: str, change) -> None:
    """Write metrics/NAME changed by `change` (a table -> a table), and record it as written (a hostile table that
    its record cannot catch)."""
    path = run / "metrics" / f"{name}.parquet"
    arrow = pq.read_table(path)
    pq.write_table(change(arrow.to_pandas()).pipe(pa.Table.from_pandas, preserve_index=False)
                   .replace_schema_metadata(arrow.schema.metadata), path)
    store = RunDir(run)
    manifest = store.manifest()
    store.record_table(manifest, f"metrics/{name}.parquet", "latents_beside")
    store.write_manifest(manifest)


HOSTILE = {
    "text for numbers": ("latents_beside", lambda t: t.assign(latents=t.latents.map(str)),
                         "latents holds text, not numbers"),
    "no verdict column": ("latents_beside", lambda t: t.drop(columns=["verdict"]), "lacks the column(s) verdict"),
    "numbers for verdicts": ("latents_beside", lambda t: t.assign(verdict=1.0), "verdict holds numbers, not text"),
    "a layer without dictionary": ("latents_beside", lambda t: t.assign(layer=t.layer.where(t.index > 0, 1)),
                                   "rows of layer 2, which has no dictionary"),
    "a repeated row": ("latents_beside", lambda t: pd.concat([t, t.tail(1)]), "repeats a row"),
    "fidelity as text": ("latents_beside_dictionary", lambda t: t.assign(fvu="0.1"), "fvu holds text, not numbers"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_damaged_table_is_named(run, tiny, tmp_path, case):
    name, change, why = HOSTILE[case]
    copy = shutil.copytree(run, tmp_path / "run")
    _rewrite(copy, name, change)
    html = unescape(_overview(copy, tiny))
    line = re.search(r'<p class="warning beside-damaged">Not shown: (.*?)</p>', html, re.S).group(1)
    assert line.startswith(f"{copy / 'metrics' / name}.parquet is damaged") and why in line
    assert f"ffkv analyze {copy} --only latents_beside" in line and "beside-table" not in html


def test_a_table_changed_behind_its_record_is_named(run, tiny, tmp_path):
    copy = shutil.copytree(run, tmp_path / "run")
    path = copy / "metrics" / "latents_beside.parquet"
    pq.write_table(pq.read_table(path).slice(0, 3), path)
    html = unescape(_overview(copy, tiny))
    assert f"Not shown: {path} is damaged" in html and "beside-table" not in html


def test_the_section_in_a_browser(run, tiny):
    """The figure loads, the table shows, the page logs no error."""
    from support.browser import browser, live_server

    with browser() as chromium, live_server(create_app(run, loaded=tiny)) as url:
        page = chromium.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(url + "/")
        page.locator("#beside-figure img").scroll_into_view_if_needed()  # it loads lazily, as a reader scrolls
        page.wait_for_load_state("networkidle")
        page.wait_for_function("(i => i.complete && i.naturalWidth > 0)(document.querySelector('#beside-figure img'))",
                               timeout=30_000)  # a lazy image may start loading only after the network went idle
        assert page.eval_on_selector("#beside-figure img", "i => i.complete && i.naturalWidth") > 0
        assert page.locator("#beside-table-t4 tr[data-measure]").count() == len(
            pd.read_parquet(run / "metrics" / "latents_beside.parquet"))
        assert page.locator("#beside-fidelity-t4").is_visible() and not errors, errors


def test_a_mean_is_shown_as_a_mean_and_a_share_as_a_percentage():
    """The explanation score is a mean correlation: shown with three decimals and its difference in its own units,
    never as a percentage or in points, as the shares are."""
    from ffkv.experiments.latents_beside import MEASURES
    from ffkv.explorer.beside import mean, points, share, signed

    kinds = {m.column: m.share for m in MEASURES}
    assert kinds["explanation_score"] is False and kinds["any_pattern"] is True
    assert (mean(0.4), signed(0.15), signed(-0.15), signed(0.0)) == ("0.400", "+0.150", "−0.150", "0.000")
    assert (share(0.4), points(0.15)) == ("40.0%", "+15.0")
