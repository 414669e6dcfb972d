"""`maxjax benchmark` (maxjax/bench/command.py, bench_client.py, bench_report.py) against this repo's
server backed by the mock engine (tests/mock_engine.py, one token per byte), and against a bare
stand-in for servers without /tokenize or usage chunks. Checks counts, the ordering of
percentiles, the JSON file, error counting and exit status (1 when any request failed), and that
bad flags are one-line UserErrors (exit 2)."""
import asyncio
import json
import os
import socket
import threading

import pytest
from aiohttp import web
from mock_engine import MockEngine
from server_harness import ServerThread

from maxjax.bench import client as bench_client, report as bench_report
from maxjax.cli import main

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine(delay=0.001))
    yield s
    s.close()


@pytest.fixture
def engine(server):
    server.engine.requests.clear()
    server.engine.fail_on = None
    return server.engine


def bench(server_url, tmp_path, *flags):
    out = tmp_path / "result.json"
    rc = main(["benchmark", "--base-url", server_url, "--no-progress", "--result-json", str(out),
               *flags])
    return rc, json.loads(out.read_text())


def check_level(level, n, output_len, input_len=None):
    assert level["num_requests"] == level["completed"] == n
    assert level["errors"] == 0 and level["error_samples"] == []
    assert level["output_tokens"] == n * output_len
    if input_len is not None:
        assert level["input_tokens"] == n * input_len
    assert level["usage_reported"] and level["short_outputs"] == 0
    assert level["duration_s"] > 0
    for key in ("requests_per_s", "output_tok_per_s", "total_tok_per_s"):
        assert level[key] > 0
    assert level["total_tok_per_s"] > level["output_tok_per_s"]
    assert level["requests_per_s"] == pytest.approx(n / level["duration_s"])
    for key in LATENCIES:
        d = level[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
        assert d["mean"] > 0
    # A request's first token comes before its last.
    assert level["ttft_ms"]["mean"] < level["e2e_ms"]["mean"]


def test_completions_counts_and_json(server, engine, tmp_path, capsys):
    rc, res = bench(server.url, tmp_path, "--concurrency", "1,4", "--num-prompts", "6",
                    "--input-len", "24", "--output-len", "10", "--seed", "3")
    assert rc == 0
    assert res["model"] == "mock-model" and res["tokenizer"] == "vllm"
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
    for lv in res["levels"]:
        check_level(lv, 6, 10, input_len=24)
    # The server's tokenizer made every prompt exactly --input-len tokens, all different.
    prompts = [p for _, p, _, _ in engine.requests]
    assert len(prompts) == 12 and all(len(p) == 24 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 12
    params = [sp for _, _, sp, _ in engine.requests]
    assert all(sp.max_new_tokens == 10 and sp.ignore_eos and sp.min_tokens == 10 for sp in params)
    out = capsys.readouterr().out
    assert "c=1" in out and "c=4" in out and "TTFT" in out and "out tok/s" in out


def test_chat_and_request_rate(server, engine, tmp_path):
    rc, res = bench(server.url + "/v1", tmp_path, "--endpoint", "chat", "--request-rate", "200",
                    "--num-prompts", "5", "--input-len", "16", "--output-len", "7", "--warmup")
    assert rc == 0
    assert len(engine.requests) == 4 + 5      # the warm-up round is sent but not counted
    (lv,) = res["levels"]
    assert lv["request_rate"] == 200
    # The chat template adds tokens around the 16-token message.
    check_level(lv, 5, 7)
    assert lv["input_tokens"] > 5 * 16


def test_dataset_and_partial_errors(server, engine, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello there", "output_len": 3}\n\n'
                    '{"prompt": "please boom now"}\n')
    engine.fail_on = "boom"
    rc, res = bench(server.url, tmp_path, "--dataset", str(data), "--num-prompts", "4",
                    "--output-len", "5", "--concurrency", "2")
    assert rc == 1
    (lv,) = res["levels"]
    assert lv["completed"] == 2 and lv["errors"] == 2
    assert lv["output_tokens"] == 2 * 3
    assert len(lv["error_samples"]) == 1 and lv["error_samples"][0].startswith("2x ")
    err = capsys.readouterr().err
    assert "2 of 4 requests failed" in err


def test_wrong_model_counts_every_request_as_an_error(server, engine, tmp_path, capsys):
    rc, res = bench(server.url, tmp_path, "--model", "nope", "--concurrency", "3",
                    "--num-prompts", "4", "--input-len", "8", "--output-len", "4")
    assert rc == 1
    (lv,) = res["levels"]
    assert lv["errors"] == 4 and lv["completed"] == 0 and lv["output_tokens"] == 0
    assert lv["output_tok_per_s"] == 0 and lv["ttft_ms"]["p50"] is None
    assert "HTTP 404" in lv["error_samples"][0] and "nope" in lv["error_samples"][0]
    err = capsys.readouterr().err
    assert "4 of 4 requests failed" in err and "does not exist" in err


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "1,x"], "--concurrency"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--output-len", "0"], "--output-len"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--dataset", "/nonexistent/x.jsonl"], "--dataset"),
    (["--dataset", "x.jsonl", "--input-len", "8"], "--input-len"),
    (["--base-url", "localhost:8000"], "--base-url"),
    (["--result-json", "/nonexistent/r.json"], "--result-json"),
])
def test_bad_flags_are_user_errors(flags, message, capsys):
    assert main(["benchmark", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("maxjax: error:") and message in err and "\n" not in err


def test_bad_dataset_lines(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    for text, message in (('{"text": "x"}\n', "line 1"), ('{"prompt": "a"}\nnot json\n', "line 2"),
                          ('{"prompt": "a", "prompt_tokens": "3"}\n', "prompt_tokens"),
                          ('{"messages": [{"role": "user", "content": "a"}]}\n', "--endpoint chat"),
                          ("", "no prompts")):
        data.write_text(text)
        assert main(["benchmark", "--no-progress", "--dataset", str(data)]) == 2
        assert message in capsys.readouterr().err


def test_unreachable_server_is_a_user_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # closed again before the benchmark connects
    assert main(["benchmark", "--no-progress", "--base-url", f"http://127.0.0.1:{port}"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


# -- a server without /tokenize and without usage chunks (e.g. older llama-cpp-python) -----------

class BareServer:
    """/v1/models and a /v1/completions stream of one-word chunks, nothing else."""

    def __init__(self, short: bool = False, tokenizer: bool = False):
        self.prompts, self.short = [], short
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        if tokenizer:   # llama-cpp-python's shape: bytes as tokens, after a BOS of 999
            app.router.add_post("/extras/tokenize", self.tokenize)
            app.router.add_post("/extras/detokenize", self.detokenize)
        self.runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def models(self, request):
        return web.json_response({"data": [{"id": "bare"}]})

    async def tokenize(self, request):
        return web.json_response({"tokens": [999] + list((await request.json())["input"].encode())})

    async def detokenize(self, request):
        tokens = (await request.json())["tokens"]
        return web.json_response({"text": bytes(t for t in tokens if t < 256).decode()})

    async def completions(self, request):
        body = await request.json()
        self.prompts.append(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"] - self.short):
            await asyncio.sleep(0.001)
            chunk = {"choices": [{"index": 0, "text": f" w{i}"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_server_without_tokenizer_or_usage(tmp_path, capsys):
    s = BareServer()
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a b c", "prompt_tokens": 3}\n')
    try:
        rc, res = bench(s.url, tmp_path, "--concurrency", "2", "--num-prompts", "3",
                        "--input-len", "12", "--output-len", "6")
        rc2, res2 = bench(s.url, tmp_path, "--num-prompts", "2", "--output-len", "2",
                          "--dataset", str(data))
    finally:
        s.close()
    # Without usage, a dataset's prompt_tokens are what is counted.
    assert rc2 == 0 and res2["levels"][0]["input_tokens"] == 2 * 3
    assert rc == 0 and res["model"] == "bare" and res["tokenizer"] is None
    (lv,) = res["levels"]
    assert lv["completed"] == 3 and not lv["usage_reported"]
    assert lv["output_tokens"] == 3 * 6          # counted from the chunks
    assert all(len(p.split()) == 12 for p in s.prompts[:3])
    assert lv["short_outputs"] == 0
    assert "no /tokenize endpoint" in capsys.readouterr().err


def test_short_answers_are_counted_and_reported(tmp_path, capsys):
    s = BareServer(short=True)
    try:
        rc, res = bench(s.url, tmp_path, "--num-prompts", "2", "--input-len", "4",
                        "--output-len", "5")
    finally:
        s.close()
    (lv,) = res["levels"]
    assert rc == 0 and lv["short_outputs"] == 2 and lv["output_tokens"] == 2 * 4
    assert "2 requests stopped before max_tokens" in capsys.readouterr().err


def test_summary_of_hand_made_results():
    r = [bench_client.RequestResult(ok=True, prompt_tokens=4, output_tokens=3, usage_reported=True,
                                    ttft=0.1, latency=0.5, itl=[0.2, 0.2]),
         bench_client.RequestResult(ok=True, prompt_tokens=4, output_tokens=1, usage_reported=True,
                                    ttft=0.3, latency=0.3),
         bench_client.RequestResult(error="HTTP 500: x")]
    s = bench_report.summarize(r, 2.0, concurrency=2)
    assert (s["completed"], s["errors"], s["error_samples"]) == (2, 1, ["1x HTTP 500: x"])
    assert s["output_tok_per_s"] == 2.0 and s["total_tok_per_s"] == 6.0 and s["requests_per_s"] == 1
    assert s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(200)     # only the 3-token request has a TPOT
    assert s["itl_ms"]["p99"] == pytest.approx(200)


def test_plot(server, engine, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    rc, _ = bench(server.url, tmp_path, "--concurrency", "1,2", "--num-prompts", "2",
                  "--input-len", "8", "--output-len", "4", "--plot", str(png))
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 1000


def test_llama_cpp_python_tokenizer_shape(tmp_path):
    s = BareServer(tokenizer=True)
    try:
        rc, res = bench(s.url, tmp_path, "--num-prompts", "3", "--input-len", "20",
                        "--output-len", "2")
    finally:
        s.close()
    assert rc == 0 and res["tokenizer"] == "llama-cpp-python"
    # The BOS the server adds to every encoding is not counted in the prompt.
    assert [len(p.encode()) for p in s.prompts] == [20, 20, 20]


def test_api_key(tmp_path, capsys):
    from maxjax.server.config import ServeConfig
    s = ServerThread(MockEngine(), ServeConfig(api_key="sesame"))
    try:
        assert main(["benchmark", "--no-progress", "--base-url", s.url]) == 2
        assert "--api-key" in capsys.readouterr().err
        rc, res = bench(s.url, tmp_path, "--api-key", "sesame", "--num-prompts", "2",
                        "--input-len", "4", "--output-len", "3")
        assert rc == 0 and res["tokenizer"] == "vllm"
        check_level(res["levels"][0], 2, 3, input_len=4)
    finally:
        s.close()


def test_loading_server_is_a_user_error(capsys):
    engine = MockEngine()
    engine.is_ready = False
    s = ServerThread(engine)
    try:
        assert main(["benchmark", "--no-progress", "--base-url", s.url]) == 2
        assert "still loading" in capsys.readouterr().err
    finally:
        s.close()
