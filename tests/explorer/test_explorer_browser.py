"""The explorer in a real headless Chromium: every page, a trace, an intervention, an annotation
that survives a restart. Skips when Chromium or Playwright is absent (see .ci/setup-browser)."""

from __future__ import annotations

import pytest

from support.browser import browser, live_server
from ffkv.explorer import create_app
from ffkv.store.run import RunDir


@pytest.fixture(scope="module")
def chromium():
    with browser() as b:
        yield b


def _page(chromium):
    page = chromium.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return page, errors


def test_pages_trace_and_intervention(chromium, analyzed):
    run, loaded = analyzed
    with live_server(create_app(run, loaded=loaded)) as url:
        page, errors = _page(chromium)
        for path, selector in [("/", "#layers"), ("/layer/1?sort=agreement&order=desc", "#keys"),
                               ("/memory/1/7", "#triggers"), ("/search?token=%2310", "#promoting"),
                               ("/search?q=born", "#hits"), ("/trace", "#trace-form")]:
            response = page.goto(url + path)
            assert response.status == 200, path
            assert page.locator(selector).is_visible(), path
        assert page.locator("#run-trace").is_visible()
        # Every figure on the overview loads from the run directory.
        page.goto(url + "/")
        page.wait_for_load_state("networkidle")
        widths = page.eval_on_selector_all("figure img", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
        assert len(widths) == len(RunDir(run).figure_names()) >= 9 and all(widths)
        # A memory link from the layer page leads to its memory page.
        page.goto(url + "/layer/2")
        page.click("#keys a[href='/memory/2/5']")
        assert page.url.endswith("/memory/2/5") and page.locator("#triggers mark").count() >= 1

        # Run a trace from the form.
        page.goto(url + "/trace")
        page.fill("textarea[name=prompt]", "the game ended in a")
        page.click("#run-trace")
        table = page.locator("#predictions")
        assert table.is_visible() and page.locator("#predictions tr[data-layer]").count() == 3
        before = page.inner_text("#predictions")
        assert "with interventions" not in page.content()

        # Switch the strongest memory of the last layer off: the prediction table changes.
        page.locator("#predictions tr[data-layer='2'] input[name=off]").first.check()
        page.click("#apply")
        assert "with interventions" in page.inner_text("#final")
        after = page.inner_text("#predictions")
        assert after != before and page.locator("#predictions .changed").count() >= 1
        assert page.locator("#predictions tr[data-layer='2'] input[name=off]").first.is_checked()

        assert not errors, errors
        # A bad request is a clear 4xx page, not a traceback.
        response = page.goto(url + "/memory/0/999")
        assert response.status == 404 and "key 999 does not exist" in page.inner_text("#error-message")


def test_annotation_survives_a_restart(chromium, fresh_run):
    run, loaded = fresh_run
    with live_server(create_app(run, loaded=loaded)) as url:
        page, _ = _page(chromium)
        page.goto(url + "/memory/0/12")
        page.check("#annotate input[value=semantic]")
        page.fill("#annotate input[name=description]", "sentences about <places>")
        page.fill("#annotate input[name=annotator]", "grace")
        page.click("#annotate button[type=submit]")
        assert page.url.split("#")[0].endswith("/memory/0/12")
        assert "sentences about <places>" in page.inner_text("#pattern")
    # A new server process reads the labels back from the run directory.
    with live_server(create_app(run, loaded=loaded)) as url:
        page, _ = _page(chromium)
        page.goto(url + "/memory/0/12")
        text = page.inner_text("#pattern")
        assert "grace" in text and "semantic" in text and "sentences about <places>" in text
        page.goto(url + "/layer/0?sort=human+label&order=asc")
        assert "semantic" in page.inner_text("#keys")
