"""The built-in web UI (GET /) and the ``stream_options.include_spec_info`` streaming extension.

Three layers: the extension's token/text alignment on a simulated stream (tokenizer only, fast); the real server
(uvicorn on loopback, the demo model with n-gram k=3) streaming with and without the extension; and the page
itself in Debian's headless Chromium driven by Playwright (skipped when /usr/bin/chromium is absent). The
browser test writes webui.png and webui-streaming.png (to docs/ with SPECSERVE_SCREENSHOT_DIR=docs).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from specserve.outputs import CompletionOutput
from specserve.server.protocol import Delta
from specserve.server.webui import SpecInfo

MODEL = "SmolLM2-135M-Instruct"
CHROMIUM = "/usr/bin/chromium"
REPEAT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
EXT_FIELDS = ("spec_tokens", "spec_accepted")


# -- alignment on a simulated stream (no model) ---------------------------------------------------------------
def _simulate(tok, ids: list[int], prompt_ids: list[int], hold: int, run_len: int, stop: str | None = None):
    """Feed ``ids`` as the engine does (runs of ``run_len`` tokens: drafts accepted + one target token, the
    incremental detokenizer, a stop string cutting the text) and stream it as api._chat_chunks does."""
    detok = tok.incremental(prompt_ids, True)
    comp = CompletionOutput(0, "", [])
    delta, info, chunks = Delta(hold), SpecInfo(tok, True), []
    for s in range(0, len(ids), run_len):
        run = ids[s:s + run_len]
        for k, t in enumerate(run):
            comp.token_ids.append(t)
            comp.spec_accepted.append(k < len(run) - 1)
            detok.add(t)
            comp.text = detok.text
            if stop and stop in comp.text:
                comp.text = comp.text[:comp.text.index(stop)]
                comp.finish_reason, comp.stop_reason = "stop", stop
                break
        if comp.finish_reason is None and s + run_len >= len(ids):
            detok.flush()
            comp.text, comp.finish_reason = detok.text, "length"
        step = delta.advance(comp)
        if step is not None and (step[0] or comp.finished):
            chunks.append((step[0], info.fields(0, prompt_ids, comp, step[0], delta.sent)))
        if comp.finished:
            break
    return comp, chunks


@pytest.mark.parametrize("hold,run_len,stop", [(0, 1, None), (0, 3, None), (4, 2, None), (5, 4, "Tokyo")])
def test_spec_pieces_match_streamed_text(demo_tokenizer, hold, run_len, stop):
    text = "Hello wörld 😀🎉 — naïve café, 東京 Tokyo. The cat sat on the mat 🐈‍⬛ again.\n  Done ✅"
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = demo_tokenizer.encode("Say something:", add_special_tokens=False)
    comp, chunks = _simulate(demo_tokenizer, ids, prompt_ids, hold, run_len, stop)
    assert comp.finished and chunks
    for content, f in chunks:
        assert len(f["spec_tokens"]) == len(f["spec_accepted"])
        assert "".join(f["spec_tokens"]) == content  # the pieces are exactly the text sent
    assert "".join(c for c, _ in chunks) == comp.text
    flags = [x for _, f in chunks for x in f["spec_accepted"]]
    if hold == 0:  # no split tokens: one entry per generated token, in order, with the engine's flags
        assert flags == comp.spec_accepted
        pieces = [p for _, f in chunks for p in f["spec_tokens"]]
        assert "" in pieces  # some byte-level tokens only complete a character with the next token
    else:
        assert len(flags) >= len(comp.token_ids)
    if stop:
        assert comp.text.endswith("東京 ") and stop not in "".join(c for c, _ in chunks)


# -- the real server ------------------------------------------------------------------------------------------
def _stream_events(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.Client(timeout=120) as http, http.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _wait_kv_free(engine, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.kv.num_free_blocks != engine.kv.pool.num_blocks or engine.has_unfinished():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_page_static_and_stats(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "static/webui.js" in page.text and "static/webui.css" in page.text
    for name, kind in (("webui.js", "javascript"), ("webui.css", "text/css")):
        r = httpx.get(f"{server.url}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
        assert "http://" not in r.text and "https://" not in r.text  # offline: nothing from a CDN
    assert "https://" not in page.text and "http://" not in page.text
    assert httpx.get(server.url + "/static/../api.py").status_code == 404
    assert httpx.get(server.url + "/static/secret.txt").status_code == 404
    stats = httpx.get(server.url + "/v1/specserve/stats").json()
    assert stats["model"] == MODEL and stats["object"] == "specserve.stats"
    assert set(stats["speculative"]) >= {"draft_tokens", "accepted_tokens", "acceptance_rate",
                                         "mean_acceptance_length", "num_drafts"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_chunks_are_standard(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    cmpl = {"model": MODEL, "prompt": REPEAT, "max_tokens": 12, "temperature": 0, "stream": True}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", cmpl)):
        events = _stream_events(server.url, path, body)
        assert len(events) > 2
        for e in events:
            for c in e["choices"]:
                assert not set(EXT_FIELDS) & set(c) and not set(EXT_FIELDS) & set(c.get("delta") or {}), e
        if "messages" in body:
            assert set(events[1]["choices"][0]["delta"]) <= {"content"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spec_info_chunks(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 40,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True, "include_spec_info": True},
            "ignore_eos": True}
    full = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False,
                                                                   "stream_options": None}, timeout=120).json()
    events = _stream_events(server.url, "/v1/chat/completions", body)
    assert "spec_tokens" not in events[0]["choices"][0]["delta"]  # the role chunk stays standard
    flags, text = [], ""
    for e in events[1:-1]:
        (c,) = e["choices"]
        d = c["delta"]
        assert len(d["spec_tokens"]) == len(d["spec_accepted"])
        assert "".join(d["spec_tokens"]) == d.get("content", "")
        flags += d["spec_accepted"]
        text += d.get("content", "")
    usage = events[-1]["usage"]
    assert text == full["choices"][0]["message"]["content"]
    assert len(flags) == usage["completion_tokens"] == 40
    assert 0 < sum(flags) <= usage["speculative"]["accepted_tokens"]  # n-gram drafts on a repetitive prompt
    off = _stream_events(server.url, "/v1/chat/completions", {**body, "speculative": False})
    off_flags = [x for e in off[1:-1] for x in e["choices"][0]["delta"]["spec_accepted"]]
    assert len(off_flags) == 40 and not any(off_flags)
    # Completions, with a stop string (the server holds text back): the pieces still match the text sent.
    cbody = {"model": MODEL, "prompt": "one two three four five, one two three four five, one two",
             "max_tokens": 30, "temperature": 0, "stream": True, "stop": [" four five, one two three"],
             "stream_options": {"include_spec_info": True}}
    ctext = ""
    for e in _stream_events(server.url, "/v1/completions", cbody):
        (c,) = e["choices"]
        assert "".join(c["spec_tokens"]) == c["text"] and len(c["spec_tokens"]) == len(c["spec_accepted"])
        ctext += c["text"]
    plain = httpx.post(server.url + "/v1/completions", json={**cbody, "stream": False, "stream_options": None},
                       timeout=120).json()["choices"][0]
    assert ctext == plain["text"] and plain["finish_reason"] == "stop"


# -- the page in a real browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium): the web UI browser test needs it")
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="specserve-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, viewport={"width": 1280, "height": 760},
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            yield ctx
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


def _screenshot(page, name: str) -> None:
    """A PNG of the viewport, reduced to a palette when Pillow is there (~45 KB instead of ~130). Written to
    $SPECSERVE_SCREENSHOT_DIR (default: a temp dir); `SPECSERVE_SCREENSHOT_DIR=docs` refreshes the README's."""
    target = Path(os.environ.get("SPECSERVE_SCREENSHOT_DIR") or tempfile.gettempdir())
    target.mkdir(parents=True, exist_ok=True)
    path = target / name
    page.screenshot(path=str(path))
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=96, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def _set(page, selector: str, value: str) -> None:
    page.fill(selector, value)
    page.dispatch_event(selector, "input")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_browser_chat_speculation_and_stop(server, server_engine, browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('SmolLM2')")
    _set(page, "#system", "You are a helpful assistant.")
    _set(page, "#max-tokens", "48")

    # 1. A streamed answer on a repetitive prompt: some tokens are accepted n-gram drafts.
    page.fill("#prompt", REPEAT)
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant[data-done]", timeout=240_000)
    first = page.locator(".msg.assistant").nth(0)
    assert first.get_attribute("data-done") == "finished", first.inner_text()
    assert first.locator(".tok-accepted").count() >= 1
    assert first.locator(".tok-target").count() >= 1
    assert "the cat sat on the mat" in first.locator(".body").inner_text().lower()
    assert page.inner_text("#ans-rate").endswith("%") and page.inner_text("#ans-tokens") != "0"
    page.wait_for_function("document.getElementById('all-accepted').textContent !== '–'")

    # 2. A long answer, stopped mid-way: the page aborts the fetch, the server aborts the request.
    _set(page, "#max-tokens", "800")  # prompt + max_tokens within the fixture's max_model_len (1024)
    page.fill("#prompt", "Now write a long story about a cat.")
    page.click("#send")
    second = page.locator(".msg.assistant").nth(1)
    page.wait_for_function("(m => m && (m.dataset.done || m.querySelectorAll('.tok').length >= 80))"
                           "(document.querySelectorAll('.msg.assistant')[1])", timeout=240_000)
    assert second.get_attribute("data-done") is None, second.inner_text()  # still streaming
    assert server_engine.has_unfinished() and page.get_attribute("body", "data-state") == "streaming"
    _screenshot(page, "webui-streaming.png")
    page.click("#stop")
    page.wait_for_function("document.querySelectorAll('.msg.assistant')[1].dataset.done === 'stopped'",
                           timeout=30_000)
    _wait_kv_free(server_engine, "the server did not free the request's KV blocks after Stop")
    assert second.locator(".meta .stopped").count() == 1
    assert page.get_attribute("body", "data-state") == "idle"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'finished_reason="abort"' in metrics
    page.wait_for_timeout(700)  # the since-start panel refreshes after the abort
    _screenshot(page, "webui.png")
    assert not errors, errors
    page.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_browser_api_key(server, start_server, browser):
    from specserve.server.api import create_app

    # A second app with --api-key over the same (shared) AsyncEngine.
    shared = server.server.config.app.state.specserve.engine
    keyed = start_server(create_app(shared, api_key="sekret"))
    try:
        assert httpx.get(keyed.url + "/").status_code == 200  # the page itself is open
        assert httpx.get(keyed.url + "/v1/specserve/stats").status_code == 401
        page = browser.new_page()
        page.goto(keyed.url + "/")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", "sekret")
        page.press("#key-input", "Enter")
        page.wait_for_function("document.getElementById('model').textContent.startsWith('SmolLM2')")
        assert page.evaluate("sessionStorage.getItem('specserve-api-key')") == "sekret"
        _set(page, "#max-tokens", "6")
        page.fill("#prompt", "Say hi")
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-done]", timeout=120_000)
        assert page.get_attribute(".msg.assistant", "data-done") == "finished"
        assert page.locator(".msg.assistant .tok").count() >= 1
        page.close()
    finally:
        keyed.stop()
