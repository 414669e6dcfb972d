"""The web playground and dashboard against tests/mock_engine.py: the page and stats routes over
HTTP (--no-webui, API key, /stats equal to /metrics, the SSE stream), then in headless Chromium:
no console errors, a streamed reply with its timings, stop aborting the engine request, keyboard
use, the dashboard's live numbers equal to /metrics, the API-key prompt, a phone-width viewport."""
import json
import threading
import urllib.request

import openai
import pytest
from browser import Tab, browser, metrics, wait_until  # noqa: F401  (browser: a fixture)
from mock_engine import MockEngine, expected_text
from server_harness import ServerThread, http

from maxjax.server.config import ServeConfig

DELAY = 0.01   # seconds per mock token


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine(delay=DELAY))
    yield s
    s.close()


@pytest.fixture(scope="module")
def keyed():
    s = ServerThread(MockEngine(delay=DELAY), ServeConfig(api_key="sekret"))
    yield s
    s.close()


@pytest.fixture
def tab(browser):  # noqa: F811
    t = Tab(browser)
    yield t
    t.close()


# ---- over HTTP ------------------------------------------------------------------------------
def test_page_and_static_files_are_served(server):
    for page in ("/", "/ui", "/ui/"):
        r = http("GET", server.url + page)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html"), page
        assert '<script src="/ui/app.js">' in r.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = http("GET", server.url + "/ui/" + name)
        assert r.status_code == 200 and kind in r.headers["Content-Type"], name
    assert http("GET", server.url + "/ui/../config.py").status_code == 404


def test_no_webui_is_a_404_and_keeps_stats():
    s = ServerThread(MockEngine(), ServeConfig(webui=False))
    try:
        r = http("GET", s.url + "/")
        assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /"
        assert http("GET", s.url + "/ui/app.js").status_code == 404
        assert http("GET", s.url + "/ui/").status_code == 404
        assert http("GET", s.url + "/stats").status_code == 200
    finally:
        s.close()


def test_webui_flag():
    from maxjax.cli.args import build
    from maxjax.cli.main import build_parser
    parse = lambda *a: build(ServeConfig, build_parser().parse_args(["serve", *a]))  # noqa: E731
    assert parse().webui is True
    assert parse("--no-webui").webui is False and parse("--webui").webui is True


def test_api_key_guards_stats_not_the_page(keyed):
    for path in ("/", "/ui", "/ui/", "/ui/app.js", "/ui/style.css"):
        assert http("GET", keyed.url + path).status_code == 200, path
    for path in ("/stats", "/stats/stream"):
        r = http("GET", keyed.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    r = http("GET", keyed.url + "/stats", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200 and r.json()["model"] == "mock-model"


def test_stats_are_the_metrics(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="mock-model", prompt="abc", max_tokens=5)
    stats = http("GET", server.url + "/stats").json()
    # the request counter moves with every HTTP call, so compare it apart
    got, want = dict(stats["metrics"]), metrics(server.url)
    got_req, want_req = got.pop("maxjax_requests_total"), want.pop("maxjax_requests_total")
    # the process's own gauges (CPU seconds, memory, open files) move between the two reads
    volatile = {k for k in want if k.startswith("process_")}
    assert volatile <= set(got)
    assert {k: v for k, v in got.items() if k not in volatile} == \
        {k: v for k, v in want.items() if k not in volatile}
    assert want_req["/stats,200"] == got_req.get("/stats,200", 0) + 1
    assert got["maxjax_generation_tokens_total"] >= 5
    assert stats["ready"] is True and stats["info"]["buckets"] == ["step_t1_r1", "step_t8_r4"]
    # the mock has no grammar backend: JSON-schema mode is not offered; its template has no
    # tool format of its own, so hermes tools stay available
    assert stats["capabilities"] == {"chat": True, "json_schema": False, "tools": True}


def test_stats_stream(server):
    r = urllib.request.urlopen(server.url + "/stats/stream?interval=0.1", timeout=10)
    assert r.headers["Content-Type"] == "text/event-stream"
    events = []
    while len(events) < 3:
        line = r.readline().decode()
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    r.close()
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    assert all("maxjax_num_requests_running" in e["metrics"] for e in events)
    for bad in ("0", "x", "100"):
        r = http("GET", server.url + "/stats/stream?interval=" + bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "interval", bad


# ---- in the browser -------------------------------------------------------------------------
def test_streamed_reply(server, tab):
    page = tab.page
    page.goto(server.url + "/")
    page.wait_for_selector("#model:text('mock-model')")
    assert page.eval_on_selector("#mode option[value=json_schema]", "o => o.hidden")
    assert not page.eval_on_selector("#mode option[value=tools]", "o => o.hidden")
    assert page.is_hidden("#schema") and page.is_hidden("#tools") and page.is_visible("#system")
    tab.send("hello", max_tokens=60, seed=3)
    # text arrives while the request is still running: it is streamed, not delivered at once
    page.wait_for_function("document.querySelector('.msg.assistant .body').textContent.length > 0"
                           " && !document.querySelector('#stop').disabled")
    text, meta = tab.last_reply()
    assert text == expected_text(60, seed=3)[0]
    assert "TTFT" in meta and "tok/s" in meta and "60 tokens" in meta and "length" in meta
    prompt_ids = server.engine.requests[-1][1]
    assert server.engine.tokenizer.decode(prompt_ids).endswith(
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    # a second turn carries the first; the conversation survives a reload
    tab.send("more", max_tokens=5)
    tab.last_reply()
    assert f"assistant\n{text}<|im_end|>\n<|im_start|>user\nmore" in \
        server.engine.tokenizer.decode(server.engine.requests[-1][1])
    page.reload()
    page.wait_for_selector(".msg.assistant:nth-of-type(4) .meta")
    assert page.locator(".msg").count() == 4
    tab.screenshot("playground-mock.png")
    assert tab.errors == []


def test_raw_completion_mode(server, tab):
    tab.page.goto(server.url + "/")
    tab.page.wait_for_selector("#model:text('mock-model')")
    tab.send("Once upon", mode="completion", max_tokens=30, stop_strings="fox")
    text, meta = tab.last_reply()
    assert text == expected_text(30, stop=["fox"])[0] == "The quick brown " and "stop" in meta
    assert server.engine.tokenizer.decode(server.engine.requests[-1][1]) == "Once upon"
    assert tab.errors == []


def test_stop_aborts_the_request(server, tab):
    engine = server.engine
    tab.page.goto(server.url + "/")
    tab.page.wait_for_selector("#model:text('mock-model')")
    tab.send("a long one", max_tokens=450)
    tab.page.wait_for_function("document.querySelector('.msg.assistant .body').textContent"
                               ".length > 5")
    rid = engine.requests[-1][0]
    assert rid in engine.running
    tab.page.click("#stop")
    text, meta = tab.last_reply()
    assert "stopped" in meta and 0 < len(text) < 450
    wait_until(lambda: rid in engine.aborted and not engine.running, "the engine abort")
    assert engine.pages_used == 0
    stats = http("GET", server.url + "/stats").json()["metrics"]
    assert stats["maxjax_num_requests_running"] == 0 and stats["maxjax_kv_cache_pages_used"] == 0
    assert tab.errors == []


def test_keyboard(server, tab):
    page, engine = tab.page, server.engine
    page.goto(server.url + "/")
    page.wait_for_selector("#model:text('mock-model')")
    focused = []
    for _ in range(12):             # the dashboard tab is reachable with Tab alone
        page.keyboard.press("Tab")
        focused.append(page.evaluate("document.activeElement.id"))
        if focused[-1] == "tab-dashboard":
            break
    assert focused[-1] == "tab-dashboard", focused
    page.keyboard.press("Enter")
    page.wait_for_selector("#dashboard-view:not([hidden])")
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Enter")
    page.wait_for_selector("#chat-view:not([hidden])")
    page.focus("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")        # a new line, not a send
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    n = len(engine.requests)
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('.msg.assistant:last-child .body')"
                           ".textContent.length > 0")
    assert "line one\nline two" in engine.tokenizer.decode(engine.requests[n][1])
    page.keyboard.press("Escape")             # stops a running request
    tab.last_reply()
    assert page.input_value("#prompt") == ""
    assert tab.errors == []


def test_dashboard_moves_and_matches_metrics(server, tab):
    page = tab.page
    page.goto(server.url + "/#dashboard")
    page.wait_for_selector("#buckets li")
    assert page.locator("#buckets li").all_inner_texts() == ["step_t1_r1", "step_t8_r4"]
    before = tab.numbers()

    def load():
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        threads = [threading.Thread(target=client.completions.create, kwargs=dict(
            model="mock-model", prompt=f"p{i}", max_tokens=250)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    loader = threading.Thread(target=load)
    loader.start()
    seen = []
    while loader.is_alive():
        seen.append(tab.numbers())
        page.wait_for_timeout(200)
    loader.join()
    assert max(s["maxjax_num_requests_running"] for s in seen) >= 1
    assert max(s["maxjax_kv_cache_pages_used"] for s in seen) > 0
    gen = [s["maxjax_generation_tokens_total"] for s in seen]
    assert gen == sorted(gen) and len(set(gen)) > 1       # it moved, upwards
    wait_until(lambda: tab.numbers()["maxjax_generation_tokens_total"]
               == before["maxjax_generation_tokens_total"] + 1000, "the dashboard to catch up")
    page.wait_for_timeout(1200)                            # one more event after the last token
    want, shown = metrics(server.url), tab.numbers()
    assert shown == {k: want[k] for k in shown}, (shown, want)
    assert page.inner_text("#prefix-rate") == "50.0 %"     # the mock's 5 hits per 10 queries
    assert float(page.inner_text("#tps")) >= 0
    assert page.locator("#phases tbody tr").count() == 2
    assert page.get_attribute("#chart-line", "points").count(",") >= 3
    tab.screenshot("dashboard-mock.png")
    assert tab.errors == []


def test_api_key_prompt(keyed, tab):
    page = tab.page
    page.goto(keyed.url + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.click("#key-dialog button[value=cancel]")
    assert "API key" in page.inner_text("#banner")
    tab.send("hi", max_tokens=5)                           # without the key nothing succeeds
    page.wait_for_selector(".msg.assistant .error")
    assert "invalid or missing API key" in page.inner_text(".msg.assistant .error")
    assert keyed.engine.requests == []
    page.wait_for_selector("#key-dialog[open]")            # the 401 asked again
    page.fill("#key-input", "sekret")
    page.keyboard.press("Enter")
    page.wait_for_selector("#model:text('mock-model')")
    assert page.is_hidden("#banner")
    tab.send("hi again", max_tokens=7)
    text, _ = tab.last_reply()
    assert text == expected_text(7)[0]
    # the only console errors are the browser's own notes on the 401 responses
    assert tab.errors and all("401" in e for e in tab.errors), tab.errors


def test_phone_width(server, browser):  # noqa: F811
    t = Tab(browser, width=390, height=844)
    try:
        page = t.page
        page.goto(server.url + "/")
        page.wait_for_selector("#model:text('mock-model')")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        box = page.locator("#send").bounding_box()
        assert box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 844
        assert not page.is_visible("#temperature")          # settings folded away
        t.send("hi", max_tokens=12)
        text, _ = t.last_reply()
        assert text == expected_text(12)[0]
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        t.screenshot("playground-phone.png")
        page.click("#tab-dashboard")
        page.wait_for_selector("#buckets li")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        assert t.errors == []
    finally:
        t.close()


def test_tools_mode_shows_the_call(browser):  # noqa: F811
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    s, t = ServerThread(MockEngine(script=call, max_length=2048)), Tab(browser)
    try:
        t.page.goto(s.url + "/")
        t.page.wait_for_selector("#model:text('mock-model')")
        t.send("weather in Paris?", mode="tools", max_tokens=200)
        text, meta = t.last_reply()
        assert text.strip() == 'tool call: get_weather({"city": "Paris"})' and "tool_calls" in meta
        sent = s.engine.tokenizer.decode(s.engine.requests[-1][1])
        assert "get_weather" in sent                      # the tools reached the template
        assert t.errors == []
    finally:
        t.close()
        s.close()


def test_stats_while_loading():
    engine = MockEngine()
    engine.is_ready = False
    s = ServerThread(engine)
    try:
        stats = http("GET", s.url + "/stats").json()
        assert (stats["ready"], stats["model"], stats["info"]) == (False, None, None)
        assert stats["capabilities"] == {"chat": False, "json_schema": False, "tools": False}
    finally:
        s.close()
