"""Server behaviour over time: 64 concurrent streams, client disconnects abort the engine
request (the mock's KV pages return to zero), /metrics, and SIGTERM drain of a real
`run_server` process."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from mock_engine import MockEngine, expected_text
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerThread, http

from maxjax.server.state import STATE

MSGS = [{"role": "user", "content": "hi"}]


def wait_until(cond, what: str, timeout: float = 20.0):
    """Poll for an event that happens asynchronously (not a timing assertion: a generous cap)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_64_concurrent_streams():
    s = ServerThread(MockEngine(delay=0.005))
    try:
        async def one(client, i):
            text, usage, finishes = "", None, 0
            stream = await client.chat.completions.create(
                model="mock-model", messages=[{"role": "user", "content": f"req {i}"}],
                max_tokens=10 + i % 7, seed=i, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finishes += chunk.choices[0].finish_reason is not None
                if chunk.usage:
                    usage = chunk.usage
            return text, usage, finishes

        async def main():
            client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
            try:
                return await asyncio.gather(*(one(client, i) for i in range(64)))
            finally:
                await client.close()
        results = asyncio.run(main())
        for i, (text, usage, finishes) in enumerate(results):
            assert text == expected_text(10 + i % 7, seed=i)[0]
            assert finishes == 1
            assert usage.completion_tokens == 10 + i % 7
            assert usage.prompt_tokens == len(f"req {i}") + 19
        assert s.engine.pages_used == 0 and not s.engine.running
        assert not s.engine.aborted
    finally:
        s.close()


def _raw_request(port: int, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(data)).encode() +
                 b"\r\n\r\n" + data)
    return sock


def test_client_disconnect_aborts_the_request():
    engine = MockEngine(delay=0.02)
    s = ServerThread(engine)
    try:
        sock = _raw_request(s.port, {"messages": MSGS, "max_tokens": 400, "stream": True})
        got = b""
        while got.count(b"data: ") < 4:
            data = sock.recv(4096)
            assert data and b"200 OK" in got + data, got + data
            got += data
        assert engine.pages_used > 0
        sock.close()
        wait_until(lambda: len(engine.aborted) == 1, "the engine abort")
        wait_until(lambda: engine.pages_used == 0, "pages back to baseline")
        assert not engine.finished
        # A non-streaming request whose client goes away is aborted too.
        sock = _raw_request(s.port, {"messages": MSGS, "max_tokens": 400})
        wait_until(lambda: engine.pages_used > 0, "the second request to start")
        sock.close()
        wait_until(lambda: len(engine.aborted) == 2, "the second abort")
        wait_until(lambda: engine.pages_used == 0, "pages back to baseline")
        # ... and the server still serves.
        r = http("POST", s.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "Th"
    finally:
        s.close()


def test_disconnect_before_the_first_token_aborts():
    engine = MockEngine(delay=1.0)
    s = ServerThread(engine)
    try:
        sock = _raw_request(s.port, {"messages": MSGS, "max_tokens": 5, "n": 2})
        wait_until(lambda: len(engine.requests) == 2, "both choices to be submitted")
        sock.close()
        wait_until(lambda: len(engine.aborted) == 2, "both choices to be aborted")
        assert not engine.running and not engine.finished and engine.pages_used == 0
        assert s.app[STATE].admission.waiting == 0
    finally:
        s.close()


def _metrics(url: str) -> dict:
    text = http("GET", url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics():
    s = ServerThread(MockEngine())
    try:
        before = _metrics(s.url)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="mock-model", messages=MSGS, max_tokens=5)
        list(client.completions.create(model="mock-model", prompt="abc", max_tokens=3,
                                       stream=True))
        http("POST", s.url + "/v1/chat/completions", {"model": "nope", "messages": MSGS})
        # A stream is counted when its handler returns, which can follow the client's last
        # chunk (the handler's cleanup runs after [DONE]); it counts as 200 all the same.
        streamed = [("maxjax_requests_total", (("endpoint", "/v1/completions"), ("status", st)))
                    for st in ("200", "499")]
        wait_until(lambda: any(k in _metrics(s.url) for k in streamed),
                   "the streamed request's count")
        after = _metrics(s.url)
        ok = ("maxjax_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
        assert before.get(ok, 0) == 0 and after[ok] == 1
        assert after.get(streamed[0], 0) == 1 and streamed[1] not in after
        assert after[("maxjax_requests_total", (("endpoint", "/v1/chat/completions"),
                                                ("status", "404")))] == 1
        assert after[("maxjax_prompt_tokens_total", ())] == 21 + 3
        assert after[("maxjax_generation_tokens_total", ())] == 5 + 3
        assert after[("maxjax_time_to_first_token_seconds_count", ())] == 2
        assert after[("maxjax_request_latency_seconds_count", ())] == 2
        assert after[("maxjax_inter_token_latency_seconds_count", ())] == 4 + 2
        assert after[("maxjax_kv_cache_pages_total", ())] == 1000
        assert after[("maxjax_kv_cache_pages_used", ())] == 0
        assert after[("maxjax_xla_compiles_total", ())] == 3
        assert after[("maxjax_prefix_cache_queries_total", ())] == 20
        assert after[("maxjax_prefix_cache_hits_total", ())] == 10
        assert after[("maxjax_engine_steps_total", ())] == 7
        assert after[("maxjax_step_phase_seconds_total", (("phase", "device_step"),))] == 1.5
        for name in ("maxjax_num_requests_waiting", "maxjax_num_requests_running",
                     "maxjax_preemptions_total"):
            assert (name, ()) in after
    finally:
        s.close()


async def _stream_then_hang_up(port: int, path: str, body: dict, last: bytes) -> bytes:
    """POST a streaming request on a raw connection, read until the stream's last event, and
    drop the connection at once (as a client does that closes on [DONE])."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    try:
        while last not in got:
            chunk = await reader.read(65536)
            assert chunk, got
            got += chunk
    finally:
        writer.transport.abort()
    return got


def test_clients_that_hang_up_after_the_last_event_count_200():
    """A stream whose last event was written is a 200 however soon the client hangs up after
    it (the handler's cleanup after [DONE] is cancelled then); 499 is for a client that left
    before the response was complete."""
    engine = MockEngine(delay=0.005)
    s = ServerThread(engine)
    routes = [("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "stream": True},
               b"data: [DONE]"),
              ("/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True},
               b"data: [DONE]"),
              ("/v1/messages", {"model": "mock-model", "messages": MSGS, "max_tokens": 3,
                                "stream": True}, b"event: message_stop"),
              ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": True},
               b"event: response.incomplete")]     # (max_output_tokens reached)
    per_route = 60

    def counts(path):
        m = _metrics(s.url)
        return {st: m.get(("maxjax_requests_total", (("endpoint", path), ("status", st))), 0)
                for st in ("200", "499")}
    try:
        async def main():
            return await asyncio.gather(*(_stream_then_hang_up(s.port, path, body, last)
                                          for path, body, last in routes
                                          for _ in range(per_route)))
        for got in asyncio.run(main()):
            assert got.startswith(b"HTTP/1.1 200 OK"), got
        for path, _, _ in routes:
            wait_until(lambda: sum(counts(path).values()) == per_route, f"{path}'s counts")
            assert counts(path) == {"200": per_route, "499": 0}, path
        wait_until(lambda: engine.pages_used == 0, "pages back to baseline")
        assert not engine.aborted
        # A client that leaves mid-stream is still a 499.
        chat = "/v1/chat/completions"
        sock = _raw_request(s.port, {"messages": MSGS, "max_tokens": 400, "stream": True})
        got = b""
        while got.count(b"data: ") < 3:
            data = sock.recv(4096)
            assert data, got
            got += data
        sock.close()
        wait_until(lambda: sum(counts(chat).values()) == per_route + 1,
                   "the disconnected stream's count")
        assert counts(chat) == {"200": per_route, "499": 1}
        assert len(engine.aborted) == 1
    finally:
        s.close()


def _serve_mock(*argv) -> tuple[subprocess.Popen, str]:
    script = os.path.join(os.path.dirname(__file__), "serve_mock.py")
    proc = subprocess.Popen([sys.executable, script, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("Server ready on http://127.0.0.1:"), line
    return proc, line.split()[-1]


def _stream_in_flight(url: str, tokens: int) -> tuple[threading.Thread, dict]:
    result = {}

    def request():
        result["r"] = http("POST", url + "/v1/completions",
                           {"prompt": "x", "max_tokens": tokens, "stream": True})
    t = threading.Thread(target=request)
    t.start()
    time.sleep(0.3)     # let the request start streaming
    return t, result


def _answered_abort(result: dict) -> None:
    """The stream of `_stream_in_flight` ended as an aborted one must: an error event, [DONE]."""
    r = result["r"]
    events = [ln[6:] for ln in r.text.split("\n\n") if ln]
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text[-500:]
    assert "aborted" in json.loads(events[-2])["error"]["message"], events[-2]


def _stopped_after_aborting(proc, t0: float, line: str, what: str) -> None:
    """The server exits 0 within 15 s of `t0`, its one request aborted, `line` in its log."""
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 15, what
    assert proc.returncode == 0 and "drained: 0 finished, 1 aborted" in out, (out, err)
    assert line in err, err
    assert "Traceback" not in err


def test_sigterm_drains_in_flight_requests():
    proc, url = _serve_mock("0.02")
    try:
        assert http("GET", url + "/health").status_code == 200
        t, result = _stream_in_flight(url, 150)      # 150 tokens take ~3 s
        proc.send_signal(signal.SIGTERM)

        def refused():
            try:
                socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 1).close()
                return False
            except OSError:
                return True
        wait_until(refused, "the listening socket to close")
        assert t.is_alive()      # new connections refused while the old request still runs
        t.join(30)
        r = result["r"]
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.split("\n\n") if ln]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert text == expected_text(150)[0]
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "drained: 1 finished, 0 aborted" in out
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_what_outlasts_the_grace_period_is_aborted_and_answered():
    """--shutdown-grace-period 1 with a request of ~30 s: after 1 s it is aborted, its stream
    ends with an error event and [DONE], and the server stops (aiohttp alone waited the period
    a second time, then cut the connection without an answer)."""
    proc, url = _serve_mock("0.1", "1")
    try:
        t, result = _stream_in_flight(url, 300)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        _answered_abort(result)
        _stopped_after_aborting(proc, t0, "the 1 s grace period is over: aborted what still ran "
                                "(1 engine requests)", "the request ran to its end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_ends_the_drain_now(sig):
    """Ctrl-C twice (or SIGTERM twice): the second aborts what still runs, each request
    answered, and the server exits 0 (it had died of the signal, or of SIGABRT in jax's
    threads, cutting the streams mid-chunk)."""
    proc, url = _serve_mock("0.1", "60")
    try:
        t, result = _stream_in_flight(url, 300)
        proc.send_signal(sig)
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(sig)
        t.join(30)
        _answered_abort(result)
        _stopped_after_aborting(proc, t0, f"{sig.name} during the drain: aborted what still ran "
                                "(1 engine requests)", "the drain ran on")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_embedding_request_outlasting_the_grace_period_is_answered():
    """Embeddings are aborted at the drain's deadline as generations are: a 503, and the server
    stops (they had kept it running to their end, then cut the connection)."""
    proc, url = _serve_mock("0.1", "1")
    try:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", http(
            "POST", url + "/v1/embeddings", {"input": ["word " * 60] * 4}, timeout=60)))
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        r = result["r"]
        assert r.status_code == 503 and "aborted" in r.json()["error"]["message"], r.text
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 15 and proc.returncode == 0, (out, err)
        assert "grace period is over: aborted what still ran (4 engine requests)" in err, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_connection_lost_mid_request_counts_499_without_a_traceback(monkeypatch, caplog):
    """A client that sends its body and closes at once: the body's read finds the connection
    lost. Counted as 499, nothing logged as an error (aiohttp had logged 'Error handling
    request' with a traceback)."""
    import logging

    from maxjax.server import app as server_app

    async def lost(request):
        raise ConnectionResetError("Connection lost")
    monkeypatch.setattr(server_app, "read_json", lost)
    s = ServerThread(MockEngine())
    try:
        with caplog.at_level(logging.INFO):
            r = http("POST", s.url + "/tokenize", {"prompt": "x"})
        assert r.status_code == 499
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
        metrics = http("GET", s.url + "/metrics").text
        assert 'maxjax_requests_total{endpoint="/tokenize",status="499"} 1.0' in metrics
    finally:
        s.close()
