"""The web UI on a real `maxjax serve` (the embedded SmolLM2-135M-Instruct) in headless Chromium: a
streamed greedy reply equal to the API's, JSON-schema mode offered and obeyed, stop ending the
engine request (running 0, no KV page held), and the dashboard moving under load and then
showing the numbers of /metrics with no compilation while serving. Saves the screenshots of
docs/webui.md."""
import json
import signal
import subprocess
import sys
import threading

import jsonschema
import openai
import pytest
from browser import Tab, browser, metrics, wait_until  # noqa: F401  (browser: a fixture)
from server_harness import http

# The engine of tests/test_engine_smollm2.py: its graphs are in the shared compilation cache.
FLAGS = ["--max-length", "512", "--max-batch-size", "8", "--max-batch-input-tokens", "32",
         "--kv-cache-page-size", "16", "--num-kv-pages", "48"]
QUESTION = "What is the capital of France?"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def url():
    proc = subprocess.Popen([sys.executable, "-m", "maxjax.cli", "serve", "--port", "0", *FLAGS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        line = proc.stdout.readline()
        assert line.startswith("Server ready on http://127.0.0.1:"), "".join(err)[-3000:]
        yield line.split()[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.fixture
def tab(browser):  # noqa: F811
    t = Tab(browser)
    yield t
    t.close()


def open_page(tab, url, view=""):
    tab.page.goto(url + "/" + view)
    tab.page.wait_for_selector("#model:text('SmolLM2')")


def test_streamed_greedy_reply_equals_the_api(url, tab):
    open_page(tab, url)
    tab.send(QUESTION, temperature=0, max_tokens=24)
    text, meta = tab.last_reply()
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    want = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, top_p=1,
        max_tokens=24).choices[0].message.content
    assert text == want and "Paris" in text
    assert "TTFT" in meta and "tok/s" in meta
    assert not tab.page.eval_on_selector("#mode option[value=json_schema]", "o => o.hidden")
    tab.screenshot("playground.png")
    assert tab.errors == []


def test_json_schema_mode(url, tab):
    open_page(tab, url)
    short = {"type": "string", "maxLength": 24}
    schema = {"type": "object", "properties": {"city": short, "country": short},
              "required": ["city", "country"], "additionalProperties": False}
    tab.page.select_option("#mode", "json_schema")
    tab.page.fill("#schema", json.dumps(schema))
    tab.send("Describe Paris as JSON.", temperature=0, max_tokens=120)
    text, meta = tab.last_reply()
    jsonschema.validate(json.loads(text), schema)
    assert "stop" in meta and tab.errors == []


def test_stop_ends_the_engine_request(url, tab):
    open_page(tab, url)
    tab.send("Write a very long story about a dragon who lives in a castle.", temperature=0,
             max_tokens=400)     # 400 tokens greedy: still running when stopped
    tab.page.wait_for_function("document.querySelector('.msg.assistant .body').textContent"
                               ".length > 10")
    assert http("GET", url + "/stats").json()["metrics"]["maxjax_num_requests_running"] == 1
    tab.page.click("#stop")
    text, meta = tab.last_reply()
    assert "stopped" in meta

    def idle():
        m = http("GET", url + "/stats").json()["metrics"]
        return m["maxjax_num_requests_running"] == 0 and m["maxjax_kv_cache_pages_used"] == 0
    wait_until(idle, "the aborted request to free its pages")
    assert tab.errors == []


def test_dashboard_under_load(url, tab):
    page = tab.page
    open_page(tab, url, "#dashboard")
    page.wait_for_selector("#buckets li")
    assert page.locator("#buckets li").all_inner_texts() == [
        "step_t1_r1", "step_t2_r2", "step_t4_r4", "step_t8_r8", "step_t16_r8", "step_t32_r8"]

    def load():
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        threads = [threading.Thread(target=client.completions.create, kwargs=dict(
            model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=96, temperature=0,
            extra_body={"ignore_eos": True})) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    before = tab.numbers()
    loader = threading.Thread(target=load)
    loader.start()
    seen, shot = [], False
    while loader.is_alive():
        seen.append((tab.numbers(), page.inner_text("#tps"), page.inner_text("#rows-per-step")))
        if not shot and seen[-1][0]["maxjax_num_requests_running"] >= 2 and seen[-1][1] != "0.0":
            shot = tab.screenshot("dashboard.png")          # docs/webui.md's, mid-load
        page.wait_for_timeout(250)
    assert max(n["maxjax_num_requests_running"] for n, _, _ in seen) >= 2
    assert max(float(t) for _, t, _ in seen) > 0
    assert max(float(r) for _, _, r in seen if r != "–") > 1       # batched rows
    wait_until(lambda: tab.numbers()["maxjax_generation_tokens_total"]
               == before["maxjax_generation_tokens_total"] + 4 * 96, "the dashboard to catch up")
    page.wait_for_timeout(1200)
    want, shown = metrics(url), tab.numbers()
    assert shown == {k: want[k] for k in shown}
    assert shown["maxjax_xla_compiles_since_ready_total"] == 0
    assert page.locator("#phases tbody tr").count() == 5
    assert tab.errors == []
