"""Two `maxjax serve` processes on 127.0.0.1 joined by jax.distributed (gloo), TP=2 across them
(one CPU device each): process 0's server answers a completion equal to the single-process
greedy output, and killing process 1 makes process 0 exit non-zero with a clear message
within 30 s. The processes use JAX's persistent compilation cache beside the test caches, so a
second run does not compile again. Two `maxjax warm-cache` processes write one artifact
directory for the group (graphs and orbax-stored weights), which the group serves compiling
nothing and converting no checkpoint."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import numpy as np
import pytest

from maxjax.engine.types import SamplingParams
from maxjax.graphs import sharding
from maxjax.llm import LLM
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

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


def group_process(command: str, path, rank: int, coordinator: int, log, *extra,
                  jax_cache: bool = True):
    """Process `rank` of a two-process `maxjax COMMAND` group (one CPU device each). JAX's
    persistent cache off for warm-cache: an executable it served does not serialize again."""
    flags = [f"--{k}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "maxjax.cli", command, "--model-path", path, "--devices", "cpu",
           "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2",
           "--process-id", str(rank), *flags, *extra]
    cache = os.environ.get("MAXJAX_TEST_JAX_CACHE") or os.environ["MAXJAX_CACHE_DIR"]
    env = dict(os.environ, XLA_FLAGS="", JAX_COMPILATION_CACHE_DIR=cache.rstrip("/") + ".multihost",
               JAX_ENABLE_COMPILATION_CACHE="true" if jax_cache else "false",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
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


def complete(url: str) -> str:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def run_group(command: str, path, logs, *extra, jax_cache=True):
    """Both processes of a `maxjax COMMAND` group, on a fresh coordinator port."""
    coordinator = free_port_pair()
    return [group_process(command, path, i, coordinator, logs[i], *extra, jax_cache=jax_cache)
            for i in (0, 1)]


def serve_flags(http: int) -> list[str]:
    return ["--port", str(http), "--no-webui"]


OPTS = {k.replace("-", "_"): v for k, v in ENGINE.items()}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny4mh"), num_kv_heads=4)


@pytest.fixture(scope="module")
def reference(tiny_path) -> str:
    """The single-process greedy completion."""
    return LLM(tiny_path, quantization_encoding="float32", **OPTS).generate(
        [PROMPT], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0].text


def test_two_processes_serve_one_tensor_parallel_engine(tiny_path, reference, tmp_path):
    http = free_port_pair()
    logs = [open(tmp_path / f"p{i}.log", "w+") for i in (0, 1)]
    procs = run_group("serve", tiny_path, logs, *serve_flags(http))
    try:
        url = f"http://127.0.0.1:{http}"
        wait_ready(url, procs)
        assert complete(url) == reference
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


def test_two_process_warm_cache_serves_from_one_artifact_directory(tiny_path, reference,
                                                                   tmp_path):
    """Both processes run warm-cache for the 2-process mesh into one directory (process 0 the
    manifest and exports, each its executables, orbax each its shards); the group serves from
    it compiling nothing, restoring its weights instead of converting the checkpoint, with the
    single-process greedy output; the directory restores into the declared shardings; a
    one-process run is refused naming the mesh."""
    from maxjax.aot import manifest as mf
    from maxjax.aot import weights
    from maxjax.engine.build import on_devices
    from maxjax.engine.config import EngineConfig
    from maxjax.errors import UserError
    from maxjax.models.loader import load_model
    opts, ref = OPTS, reference
    art = str(tmp_path / "group-artifacts")
    logs = [open(tmp_path / f"w{i}.log", "w+") for i in (0, 1)]
    procs = run_group("warm-cache", tiny_path, logs, "--artifacts-dir", art, jax_cache=False)
    try:
        for p, log in zip(procs, logs):
            log.seek(0)
            assert p.wait(240) == 0, log.read()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    m = mf.read_manifest(art, "")
    assert m.data["engine"]["mesh"]["num_processes"] == 2
    assert all(set(g["files"]) == {"export", "executable", "executable.p1"}
               for g in m.data["graphs"])
    entry = m.data["weights"]
    assert entry["degree"] == 2 and entry["dtype"] == "float32"

    http = free_port_pair()
    logs = [open(tmp_path / f"s{i}.log", "w+") for i in (0, 1)]
    procs = run_group("serve", tiny_path, logs, *serve_flags(http), "--precompiled-artifacts",
                      art, "--require-compiled-artifacts")
    try:
        url = f"http://127.0.0.1:{http}"
        wait_ready(url, procs)
        assert complete(url) == ref
        from prometheus_client.parser import text_string_to_metric_families
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            metrics = {s.name: s.value for fam in text_string_to_metric_families(
                r.read().decode()) for s in fam.samples}
        assert metrics["maxjax_xla_compiles_total"] == 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    for log in logs:
        log.seek(0)
        text = log.read()
        log.close()
        assert "restored the stored weights" in text, text[-3000:]
        assert re.search(r"Loaded \d+ graphs .*\((\d+) executables, 0 compiled from exports\)",
                         text), text[-3000:]

    # what both processes stored, restored here onto 2 of this process's devices
    cfg = EngineConfig(devices="cpu:2", **opts)
    placed = on_devices(load_model(tiny_path, "float32", progress=False), cfg)
    mesh = sharding.params_mesh(placed.params)
    laid, params = weights.restore(m, entry, placed.config, mesh)
    assert laid == placed.config
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(placed.params)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # one process cannot serve the group's artifacts: its devices are not the group's
    with pytest.raises(UserError, match=r"^--devices cpu:2 differs from the cpu the artifacts"):
        LLM(tiny_path, devices="cpu:2", precompiled_artifacts=[art], **opts)
    with pytest.raises(UserError, match=r"engine mesh: .*'num_processes': 2.*this run None"):
        LLM(tiny_path, precompiled_artifacts=[art], **opts)     # --devices cpu, adopted
