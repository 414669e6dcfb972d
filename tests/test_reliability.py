"""The CI subset of tools/fuzz.py and tools/soak.py against one real `maxjax serve` (the
embedded SmolLM2, the engine of tests/test_engine_smollm2.py): ~300 fuzz cases (schema-driven
and raw HTTP) with valid traffic beside them, then a 30-second soak at 16 streams. Both must
pass: no 5xx, no hang, every error in the OpenAI envelope, every valid answer checked, nothing
leaked, no compilation while serving. The full runs and their figures: RELIABILITY.md."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

import reliability  # noqa: E402
from fuzz import Findings, run_fuzz  # noqa: E402
from reliability import SMOLLM2_FLAGS, ServeProcess, ValidTraffic  # noqa: E402
from soak import run_soak  # noqa: E402

from mock_engine import MockEngine  # noqa: E402
from server_harness import ServerThread  # noqa: E402

from maxjax.server.app import build_app  # noqa: E402
from maxjax.server.config import ServeConfig  # noqa: E402
from maxjax.server.openapi import openapi_document  # noqa: E402

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

TIMEOUTS = {"http_idle_timeout": 2.0, "http_body_timeout": 2.0}


@pytest.fixture(scope="module")
def server():
    flags = [*SMOLLM2_FLAGS, "--http-idle-timeout", "2", "--http-body-timeout", "2"]
    with ServeProcess(flags) as s:
        yield s
    assert s.returncode == 0, "".join(s.stderr)[-3000:]


def test_fuzz_300_cases(server):
    report = run_fuzz(server.url, cases=300, seed=1, streams=4,
                      limits={**TIMEOUTS, "max_connections": 1000})
    assert report["cases"] >= 300
    assert not report["failures"], report["failures"]
    assert report["valid"]["errors"] == 0, report["valid"]["error_examples"]
    assert report["valid"]["requests"] > 0
    assert not report["leaks"]["problems"], report["leaks"]


def test_soak_30_seconds_16_streams(server):
    # the leak checks compare the idle server with its state before: they do not grow with time
    # (tools/soak.py's own runs are the long ones: RELIABILITY.md)
    report = run_soak(server.url, streams=16, duration=30, seed=1, interval=2.0)
    assert report["errors"] == 0, report["error_examples"]
    assert report["requests"] > 16
    assert not report["leaks"]["problems"], report["leaks"]
    assert report["leaks"]["compiles_since_ready"] == 0
    assert report["leaks"]["kv_pages_used"] == 0


def test_the_fuzz_checks_flag_what_they_must():
    """The checks that make a run fail: a 5xx, a traceback, an error outside the envelope, a 200
    or a streamed event that breaks the route's schema, a stream without [DONE]."""
    f = Findings(openapi_document(build_app(MockEngine()), "t", "0"))
    ok = b'{"error": {"message": "x", "type": "invalid_request_error", "param": null, "code": null}}'
    f.answer("/v1/completions", 400, ok, "fine")
    assert not f.failures
    f.answer("/v1/completions", 500, ok.replace(b"invalid_request", b"server"), "a")
    f.answer("/v1/completions", 400, b"Traceback (most recent call last)", "b")
    f.answer("/v1/completions", 200, b'{"id": 1}', "c")
    f.answer("/v1/completions", 200, b'data: {"id": 1}\n\n', "d", stream=True)
    kinds = sorted(k[0] for k in f.failures)
    assert kinds == ["5xx", "bad answer", "bad stream", "bad stream", "envelope", "traceback"]


def test_valid_traffic_outlasts_a_lagging_client(monkeypatch):
    """The valid traffic beside the fuzz must not fail for its own client's lag: on a starved
    CPU each answer check holds its event loop a while, for longer than the server's idle
    timeout over a long stream, and a connection that sits idle that long is one the server
    closes, as it must. Each check here sleeps 100 ms (blocking the loop as CPU work does)
    against a 1.5 s idle timeout: a 32-event stream checked back to back holds the loop 3.2 s,
    while a new connection waits at most the other 3 clients' checks (0.3 s) before it is
    written. The rest of the 1.5 s is margin for the CPU the clients' own Python needs, which a
    loaded machine stretches (a 30 ms / 0.5 s version lost a connection with two busy loops
    beside the suite)."""
    check = reliability.Schemas.problem

    def slow_check(self, name, obj):
        time.sleep(0.1)
        return check(self, name, obj)
    monkeypatch.setattr(reliability.Schemas, "problem", slow_check)
    s = ServerThread(MockEngine(delay=0.002), ServeConfig(http_idle_timeout=1.5))
    try:
        with ValidTraffic(s.url, 4, seed=1, duration=5, long_words=20) as traffic:
            traffic.wait()
    finally:
        s.close()
    report = traffic.report()
    assert report["errors"] == 0, report["error_examples"]
    assert report["requests"] > 8
