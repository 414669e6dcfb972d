"""The engine's own failures, injected through maxjax/engine/faults.py (MAXJAX_FAULTS), on a real
engine (the tiny random Llama) behind the real server:
  - a device step that raises fails only its own request; the others get exactly the tokens
    they get alone, no KV page stays held, and later requests are served;
  - the engine thread dying turns /health to 503 "failed", refuses new requests with 503, and
    `maxjax serve` exits non-zero instead of hanging;
  - SIGTERM while streams run lets them finish within the grace period (exit 0);
  - SIGKILL, then a restart from the artifacts the first run exported, serves the same tokens
    with no compilation;
  - a disk that fills while artifacts are written leaves no artifact directory (and a previous
    one intact and loadable)."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
from pool_check import check_pool
from server_harness import ServerThread, http
from tiny_llama import tiny_core, write_tiny_llama

from maxjax.aot import export as aot_export
from maxjax.aot import load as aot_load
from maxjax.engine import faults
from maxjax.engine.async_engine import AsyncEngine
from maxjax.errors import UserError

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

BAD_SEED = 666
FLAGS = ["--max-batch-size", "4", "--max-batch-input-tokens", "16", "--max-length", "64",
         "--num-kv-pages", "24", "--kv-cache-page-size", "8"]
PROMPTS = {"a": [5, 7, 9, 11], "b": [13, 17, 19], "c": [23, 29, 31, 37, 41]}


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def complete(url: str, prompt, seed=None, max_tokens=12) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    if seed is not None:
        body["seed"] = seed
    return http("POST", url + "/v1/completions", body, timeout=120)


def tokens(resp) -> list[str]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    core = tiny_core(tmp_path_factory.mktemp("tiny-core"))
    os.environ[faults.ENV] = f"device_step:{BAD_SEED}"
    try:
        engine = AsyncEngine(core, core.model.tokenizer, "tiny", None)
        engine.start()
    finally:
        del os.environ[faults.ENV]
    wait_until(lambda: core.primed, "priming")
    server = ServerThread(engine)
    yield server, core
    server.close()
    engine.shutdown()


def test_a_device_step_fault_fails_only_its_request(faulty):
    server, core = faulty
    alone = {k: tokens(complete(server.url, p)) for k, p in PROMPTS.items()}
    results = {}

    def send(key, prompt, seed=None):
        results[key] = complete(server.url, prompt, seed)
    threads = [threading.Thread(target=send, args=(k, p)) for k, p in PROMPTS.items()]
    threads.append(threading.Thread(target=send, args=("bad", [3, 4, 5], BAD_SEED)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    bad = results.pop("bad")
    assert bad.status_code == 500 and "injected device step fault" in bad.json()["error"]["message"]
    assert {k: tokens(r) for k, r in results.items()} == alone
    wait_until(lambda: not core.scheduler.requests, "the engine to drop every request")
    check_pool(core.block_manager)
    assert core.block_manager.num_used_pages == 0
    assert tokens(complete(server.url, PROMPTS["a"])) == alone["a"]     # served after
    assert core.step_compiles == 0


def test_a_dead_engine_thread_turns_health_to_503_and_refuses_requests(tmp_path):
    core = tiny_core(tmp_path)
    engine = AsyncEngine(core, core.model.tokenizer, "tiny", None)
    faults.install(core, "engine_thread:3")
    died = threading.Event()
    engine.on_death = died.set
    engine.start()
    server = ServerThread(engine)
    try:
        r = complete(server.url, PROMPTS["a"], max_tokens=20)
        assert r.status_code == 500 and "engine thread died" in r.json()["error"]["message"]
        assert died.wait(10) and isinstance(engine.dead, faults.EngineThreadDeath)
        health = http("GET", server.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        r = complete(server.url, PROMPTS["b"])
        assert r.status_code == 503 and "engine thread died" in r.json()["error"]["message"]
    finally:
        server.close()
        engine.shutdown()


class Serve:
    """`maxjax serve` on the tiny model in a subprocess (killed at the test's end, by `serve`)."""
    started: list = []

    def __init__(self, model_dir, *flags, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maxjax.cli", "serve", "--port", "0", "--model-path",
             model_dir, *FLAGS, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, **(env or {})})
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        Serve.started.append(self.proc)
        line = self.proc.stdout.readline()
        assert line.startswith("Server ready on http://"), "".join(self.err)[-3000:]
        self.url = line.split()[-1]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(autouse=True)
def no_server_left():
    yield
    while Serve.started:
        proc = Serve.started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_exits_non_zero_when_the_engine_thread_dies(tiny_dir):
    s = Serve(tiny_dir, env={faults.ENV: "engine_thread:2"})
    r = complete(s.url, PROMPTS["a"], max_tokens=20)
    assert r.status_code == 500
    assert s.wait(60) == 1
    assert "the engine thread died" in "".join(s.err)


def test_sigterm_drains_streams_within_the_grace_period(tiny_dir):
    s = Serve(tiny_dir, "--shutdown-grace-period", "60")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    done, started = [], threading.Semaphore(0)

    def stream(prompt):
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=40,
                                           stream=True, temperature=0,
                                           extra_body={"ignore_eos": True})
        text, finish = [], None
        for i, c in enumerate(chunks):
            if i == 0:
                started.release()
            text.append(c.choices[0].text)
            finish = c.choices[0].finish_reason or finish
        done.append(finish)
    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS.values()]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert done == ["length"] * 3
    assert s.wait(60) == 0 and time.monotonic() - t0 < 60


SMALL = ["--max-batch-size", "1", "--max-batch-input-tokens", "4"]     # 3 graphs to export


def test_sigkill_then_restart_from_artifacts(tiny_dir, tmp_path):
    art = str(tmp_path / "artifacts")
    s = Serve(tiny_dir, "--export-artifacts", art, *SMALL)
    first = tokens(complete(s.url, PROMPTS["c"]))
    s.proc.send_signal(signal.SIGKILL)
    assert s.wait(30) == -signal.SIGKILL
    s = Serve(tiny_dir, "--precompiled-artifacts", art, "--require-compiled-artifacts",
              "--no-compile-cache", *SMALL)
    try:
        assert tokens(complete(s.url, PROMPTS["c"])) == first
        metrics = http("GET", s.url + "/metrics").text
        assert "maxjax_xla_compiles_total 0.0" in metrics
    finally:
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait(60) == 0


def test_a_full_disk_leaves_no_half_written_artifacts(tmp_path, monkeypatch):
    core = tiny_core(tmp_path / "model", max_batch_size=1, max_batch_input_tokens=4)
    good, target = str(tmp_path / "good"), str(tmp_path / "target")
    aot_export.export_engine(good, core)
    write = aot_export._write
    written = []

    def filling(directory, name, blob):
        if written:
            with open(os.path.join(directory, name), "wb") as f:
                f.write(blob[:len(blob) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(name)
        return write(directory, name, blob)
    monkeypatch.setattr(aot_export, "_write", filling)
    for directory in (target, good):       # a new directory, and over an existing one
        with pytest.raises(OSError, match="No space left"):
            aot_export.export_engine(directory, core)
        written.clear()
    monkeypatch.undo()
    assert not os.path.exists(target)
    assert sorted(os.listdir(tmp_path)) == ["good", "model"]      # no temp directory left
    with pytest.raises(UserError):
        aot_load.load_planned([target], core.model, core.cfg)
    _, exes, _ = aot_load.load_planned([good], core.model, core.cfg)
    assert set(exes) == set(core.layout.buckets)
    assert json.load(open(os.path.join(good, "manifest.json")))
