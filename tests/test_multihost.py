"""Two `maxjax serve` processes on 127.0.0.1 joined by jax.distributed (gloo), TP=2 across them
(one CPU device each): process 0's server answers a completion equal to the single-process
greedy output, and killing process 1 makes process 0 exit non-zero with a clear message
within 30 s. The processes use JAX's persistent compilation cache beside the test caches, so a
second run does not compile again."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from maxjax.engine.types import SamplingParams
from maxjax.llm import LLM
from tiny_llama import write_tiny_llama

ENGINE = {"max-batch-size": 1, "max-batch-input-tokens": 2, "max-length": 32,
          "num-kv-pages": 8, "kv-cache-page-size": 8}
PROMPT = "w5 w9 w33 w7 w100"


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the coordinator and the plan channel)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def serve_process(path, rank: int, coordinator: int, http: int, log):
    flags = [f"--{k}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "maxjax.cli", "serve", "--model-path", path, "--devices", "cpu",
           "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2",
           "--process-id", str(rank), "--port", str(http), "--no-webui", *flags]
    cache = os.environ.get("MAXJAX_TEST_JAX_CACHE") or os.environ["MAXJAX_CACHE_DIR"]
    env = dict(os.environ, XLA_FLAGS="", JAX_COMPILATION_CACHE_DIR=cache.rstrip("/") + ".multihost",
               JAX_ENABLE_COMPILATION_CACHE="true", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_ready(url: str, procs, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a process exited with {p.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the group did not become ready")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny4mh"), num_kv_heads=4)


def test_two_processes_serve_one_tensor_parallel_engine(tiny_path, tmp_path):
    opts = {k.replace("-", "_"): v for k, v in ENGINE.items()}
    ref = LLM(tiny_path, quantization_encoding="float32", **opts).generate(
        [PROMPT], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0].text
    coordinator, http = free_port_pair(), free_port_pair()
    logs = [open(tmp_path / f"p{i}.log", "w+") for i in (0, 1)]
    procs = [serve_process(tiny_path, i, coordinator, http, logs[i]) for i in (0, 1)]
    try:
        url = f"http://127.0.0.1:{http}"
        wait_ready(url, procs)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["choices"][0]["text"] == ref
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(30)
        assert rc != 0 and time.monotonic() - t0 < 30
        logs[0].seek(0)
        assert "maxjax: error: process 1 of 2 left the group" in logs[0].read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
