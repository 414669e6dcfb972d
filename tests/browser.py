"""Headless Chromium for the web UI tests: Debian's `chromium` driven by Playwright (whose own
browser download needs a CDN that CI cannot reach). `browser` is module-scoped; `Tab` is one page
in a fresh context that records console errors and uncaught exceptions; `metrics` parses
/metrics as /stats names its values. Screenshots go to $MAXJAX_SCREENSHOTS (default
build/screenshots)."""
from __future__ import annotations

import os
import shutil
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import http

SCREENSHOTS = os.environ.get("MAXJAX_SCREENSHOTS") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "screenshots")


def chromium_path() -> str | None:
    for path in (os.environ.get("MAXJAX_CHROMIUM"), shutil.which("chromium"),
                 shutil.which("chromium-browser"), "/usr/bin/chromium"):
        if path and os.path.exists(path):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("no chromium: .ci/run installs Debian's chromium package")
        pytest.skip("no chromium found (apt-get install chromium, or set MAXJAX_CHROMIUM)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=[
            "--disable-background-networking", "--disable-component-update",
            "--disable-default-apps", "--disable-sync", "--no-first-run"])
        yield b
        b.close()


class Tab:
    """A page; `errors` collects console errors and page exceptions as they happen."""

    def __init__(self, browser, width: int = 1280, height: int = 860):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.page.set_default_timeout(20_000)
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def close(self):
        self.context.close()

    def screenshot(self, name: str) -> str:
        os.makedirs(SCREENSHOTS, exist_ok=True)
        path = os.path.join(SCREENSHOTS, name)
        self.page.screenshot(path=path, full_page=True)
        return path

    def send(self, text: str, **settings) -> None:
        """Set sampling fields (by element id), type the message and press Enter."""
        page = self.page
        if any(not page.is_visible(f"#{k}") for k in settings):
            page.click("#settings summary")
        for field, value in settings.items():
            if page.eval_on_selector(f"#{field}", "e => e.tagName") == "SELECT":
                page.select_option(f"#{field}", str(value))
            else:
                page.fill(f"#{field}", str(value))
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")

    def last_reply(self, timeout: float = 60) -> tuple[str, str]:
        """(text, meta line) of the last assistant message once it has finished."""
        self.page.wait_for_selector(".msg.assistant:last-child .meta", timeout=timeout * 1000)
        msg = self.page.locator(".msg.assistant").last
        return msg.locator(".body").inner_text(), msg.locator(".meta").inner_text()

    def numbers(self) -> dict[str, float]:
        """The dashboard's data-metric outputs as numbers (None where it shows –)."""
        raw = self.page.eval_on_selector_all(
            "#dashboard-view output[data-metric]", "es => es.map(e => [e.dataset.metric, "
            "e.textContent])")
        return {k: None if v == "–" else float(v.replace(",", "")) for k, v in raw}


def wait_until(cond, what: str, timeout: float = 30.0):
    """Poll for something that happens asynchronously (a generous cap, not a timing check)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def metrics(url) -> dict:
    """/metrics as the page's snapshot names them: name -> value (labelled: label values)."""
    out = {}
    for fam in text_string_to_metric_families(http("GET", url + "/metrics").text):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            if s.labels:
                out.setdefault(s.name, {})[",".join(s.labels.values())] = s.value
            else:
                out[s.name] = s.value
    return out
