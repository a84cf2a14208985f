"""The explorer in a real headless Chromium, on the analysed run the real pipeline wrote: every page, the
projection switch, the token strip, a trace, an intervention, generation with a memory switched off, the
JSON export, an annotation that survives a restart. Skips when Chromium or Playwright is absent
(see .ci/setup-browser)."""

from __future__ import annotations

import json

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
        for path, selector in [("/", "#layers"), ("/layer/2?sort=agreement&order=desc", "#keys"),
                               ("/memory/2/7", "#triggers"), ("/memory/2/7", "#histogram svg"),
                               ("/search?token=%2310", "#promoting"), ("/search?q=born", "#hits mark.hit"),
                               ("/trace", "#trace-form")]:
            response = page.goto(url + path)
            assert response.status == 200, path
            assert page.locator(selector).first.is_visible(), path
        assert page.locator("#run-trace").is_visible()
        # Every figure on the overview loads from the run directory.
        page.goto(url + "/")
        for image in page.locator("figure img").all():  # the figures load lazily, as a reader scrolls to them
            image.scroll_into_view_if_needed()
        page.wait_for_load_state("networkidle")
        page.wait_for_function("Array.from(document.querySelectorAll('figure img')).every(i => i.complete)")
        widths = page.eval_on_selector_all("figure img", "imgs => imgs.map(i => i.complete && i.naturalWidth)")
        assert len(widths) == len(RunDir(run).figure_names()) >= 9 and all(widths)
        # A memory link from the layer page leads to its memory page.
        page.goto(url + "/layer/3")
        page.click("#keys a[href='/memory/3/5']")
        assert page.url.endswith("/memory/3/5") and page.locator("#triggers .t.trig").count() >= 1

        # Run a trace from the form.
        page.goto(url + "/trace")
        page.fill("textarea[name=prompt]", "the game ended in a")
        page.click("#run-trace")
        table = page.locator("#predictions")
        assert table.is_visible() and page.locator("#predictions tr[data-layer]").count() == 3
        before = page.inner_text("#predictions")
        assert "with interventions" not in page.content()

        # Scale the last layer's strongest contributor to the prediction by 100: the prediction table changes,
        # and only cells whose top token changed or whose probability moved by 1 point or more are highlighted.
        page.locator("#predictions tr[data-layer='3'] input[type=number]").first.fill("100")
        page.click("#apply")
        assert "with interventions" in page.inner_text("#final")
        after = page.inner_text("#predictions")
        assert after != before and page.locator("#predictions .changed").count() >= 1
        assert page.locator("#predictions tr[data-layer='3'] input[type=number]").first.input_value() == "100.0"
        for cell in page.locator("#predictions td.pred").all():
            old, new = cell.inner_text().split(" → ")
            (old_token, old_p), (new_token, new_p) = old.rsplit(" ", 1), new.rsplit(" ", 1)
            moved = old_token != new_token or abs(float(old_p[:-1]) - float(new_p[:-1])) >= 1.05
            still = old_token == new_token and abs(float(old_p[:-1]) - float(new_p[:-1])) < 0.95
            assert ("changed" in cell.get_attribute("class")) == moved or not (moved or still)

        assert not errors, errors
        # A bad request is a clear 4xx page, not a traceback.
        response = page.goto(url + "/memory/1/999")
        assert response.status == 404 and "key 999 does not exist" in page.inner_text("#error-message")
        response = page.goto(url + "/memory/0/1")  # layers count from 1
        assert response.status == 404 and "this run has layers 1 to 3" in page.inner_text("#error-message")


def test_annotation_survives_a_restart(chromium, fresh_run):
    run, loaded = fresh_run
    with live_server(create_app(run, loaded=loaded)) as url:
        page, _ = _page(chromium)
        page.goto(url + "/memory/1/12")
        page.check("#annotate input[value=semantic]")
        page.fill("#annotate input[name=description]", "sentences about <places>")
        page.fill("#annotate input[name=annotator]", "grace")
        page.click("#annotate button[type=submit]")
        assert page.url.split("#")[0].endswith("/memory/1/12")
        assert "sentences about <places>" in page.inner_text("#pattern")
    # A new server process reads the labels back from the run directory.
    with live_server(create_app(run, loaded=loaded)) as url:
        page, _ = _page(chromium)
        page.goto(url + "/memory/1/12")
        text = page.inner_text("#pattern")
        assert "grace" in text and "semantic" in text and "sentences about <places>" in text
        page.goto(url + "/layer/1?sort=human+label&order=asc")
        assert "semantic" in page.inner_text("#keys")


def test_projection_switch_token_strip_and_json_export(chromium, analyzed):
    run, loaded = analyzed
    with live_server(create_app(run, loaded=loaded)) as url:
        page, errors = _page(chromium)
        page.goto(url + "/memory/3/5")  # it opens through the model's final norm
        final_norm = page.inner_text("#value-top")
        assert page.inner_text("#projection-switch .on") == "final norm: softmax(N(v)·Eᵀ)"
        page.click("#projection-switch a:has-text('identity')")
        assert page.url.endswith("projection=identity&shown=p#projection-switch")
        assert page.inner_text("#value-top") != final_norm
        page.click("#projection-switch a:has-text('raw logits')")
        assert "logit" in page.inner_text("#value-top") and page.inner_text("#value-bottom")
        # The JSON export of what the page shows parses, at a stable URL.
        page.click("#json-link")
        exported = json.loads(page.inner_text("body"))
        assert (exported["layer"], exported["layer_number"], exported["key"]) == (2, 3, 5)
        assert (exported["value"]["projection"], exported["value"]["shown"]) == ("identity", "logit")
        assert len(exported["value"]["bottom"]) == 15
        assert exported["trigger_examples"] and all(len(e["tokens"]) == len(e["coefficients"])
                                                     for e in exported["trigger_examples"])
        # The token strip picks the position the trace reads.
        page.goto(url + "/trace")
        page.fill("textarea[name=prompt]", "the game ended in a")
        page.click("#run-trace")
        strip = page.locator("#token-strip button")
        n = strip.count()
        assert n == len(loaded.tokenizer.encode("the game ended in a"))
        assert strip.nth(n - 1).get_attribute("class") == "on"
        last = page.inner_text("#predictions")
        strip.nth(2).click()
        assert page.locator("#token-strip button").nth(2).get_attribute("class") == "on"
        assert "token 3 of" in page.inner_text("#prediction") and page.inner_text("#predictions") != last
        assert not errors, errors


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """An indexed run of a tiny GPT-2 whose memory 2:5 (layer index 1, key 5) decides every prediction."""
    import copy

    import torch

    from ffkv.corpus import CorpusSpec
    from ffkv.explorer.tracing import generate
    from ffkv.indexing.indexer import IndexOptions, build_index
    from support.helpers import loaded_tiny
    from support.runs import corpus_lines, plant_memory, sharpen

    folder = tmp_path_factory.mktemp("planted")
    (folder / "corpus.txt").write_text("\n".join(corpus_lines(24)) + "\n")
    loaded = sharpen(loaded_tiny("gpt2"))
    without = copy.deepcopy(loaded)
    token = plant_memory(loaded, 1, 5)
    plant_memory(without, 1, 5)
    with torch.no_grad():
        without.view.values(1)[5].zero_()
    build_index(loaded, CorpusSpec(source=str(folder / "corpus.txt"), unit="line"), folder / "run",
                IndexOptions(top_k=3), progress=False)
    prompt = "the cat sat"
    ids = loaded.tokenizer.encode(prompt)
    expected = {"on": [token] * 5, "off": generate(without, ids, 5)}
    assert expected["off"] != expected["on"]
    return folder / "run", loaded, prompt, ids, expected


def test_generation_with_a_memory_switched_off(chromium, planted):
    run, loaded, prompt, ids, expected = planted
    decode = loaded.tokenizer.decode
    with live_server(create_app(run, loaded=loaded)) as url:
        page, errors = _page(chromium)
        page.goto(url + "/trace")
        page.fill("textarea[name=prompt]", prompt)
        page.click("#run-trace")
        chip = page.locator("#predictions tr[data-layer='2'] .chip").first  # the strongest contributor
        assert chip.locator("a").inner_text() == "2:5"
        chip.locator("input[name=off]").check()
        page.fill("input[name=n_generate]", "5")
        page.click("#generate")
        assert page.inner_text("#generated-original") == decode(ids + expected["on"])
        assert page.inner_text("#generated-edited") == decode(ids + expected["off"])
        assert "part after 0 tokens" in page.inner_text("#generation")
        assert not errors, errors


def test_short_tables_show_every_row_and_a_long_one_scrolls_in_its_box(chromium, analyzed):
    """A new user saw 3 of the overview's 13 fidelity rows: every table sat in a box at most 85% of the window high,
    its other rows hidden below the box's edge. A short table now shows every row on the page; a page of a layer's
    memories scrolls inside its box, its header in view."""
    run, loaded = analyzed
    with live_server(create_app(run, loaded=loaded)) as url:
        page, errors = _page(chromium)
        page.set_viewport_size({"width": 1280, "height": 500})
        page.goto(url + "/")
        boxes = page.eval_on_selector_all(".scroll:not(.long)", "bs => bs.map(b => [b.scrollHeight, b.clientHeight])")
        assert boxes and all(full <= shown + 1 for full, shown in boxes), boxes   # nothing below a box's edge
        page.goto(url + "/layer/2")
        box = page.locator(".scroll.long").first
        full, shown = box.evaluate("b => [b.scrollHeight, b.clientHeight]")
        assert full > shown and shown <= 0.85 * 500 + 1   # 100 rows in a box of the window's height
        box.evaluate("b => b.scrollTop = b.scrollHeight / 2")
        header = page.locator("#keys th").first.bounding_box()
        top = box.bounding_box()
        assert abs(header["y"] - top["y"]) < 2   # the header stays at the box's top
        assert not errors, errors
