"""The report opens from disk in headless Chromium with no request leaving the machine, and every
figure renders (checked on screenshots). Skips when Chromium or Playwright is absent."""

from __future__ import annotations

import io

import numpy as np

from support.browser import browser
from ffkv.report import write_report


def test_report_renders_offline_with_every_figure(analyzed, tmp_path):
    from PIL import Image

    from ffkv.store.run import RunDir

    run, _ = analyzed
    path = write_report(run)
    requests: list[str] = []
    with browser() as chromium:
        context = chromium.new_context(offline=True)
        page = context.new_page()

        def guard(route):
            requests.append(route.request.url)
            if route.request.url.startswith(("file:", "data:")):
                route.continue_()
            else:
                route.abort()

        page.route("**/*", guard)
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        figures = page.locator("img.figure")
        assert figures.count() == len(RunDir(run).figure_names())
        for i in range(figures.count()):
            img = figures.nth(i)
            assert img.evaluate("i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0")
            shot = np.asarray(Image.open(io.BytesIO(img.screenshot())).convert("L"), dtype=float)
            assert shot.shape[0] > 50 and shot.shape[1] > 50
            assert shot.std() > 10, f"figure {i} looks blank"
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        context.close()
    leaving = [u for u in requests if not u.startswith(("file:", "data:"))]
    assert not leaving, leaving


def test_index_only_report_opens(index_only):
    path = write_report(index_only)
    with browser() as chromium:
        page = chromium.new_page()
        page.goto(path.as_uri())
        assert page.locator("#no-analyses").is_visible()
        assert page.locator("img").count() == 0
