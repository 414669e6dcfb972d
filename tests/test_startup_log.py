"""`maxjax serve` of the embedded SmolLM2 as a user starts it, twice on one fresh compile cache:
the first start compiles and stores every graph, its log is one maxjax line per phase (no line
from another library) and ends in `Server ready on http://HOST:PORT`; the second start loads
every graph from the cache (no XLA compilation from process start) and answers the same greedy
completion. The compile heartbeat is checked on its own."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import http

from maxjax.engine import build
from maxjax.graphs import cpu_kernels

FLAGS = ["--max-batch-size", "2", "--max-batch-input-tokens", "8", "--num-kv-pages", "64",
         "--max-length", "256"]
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|WARNING) (maxjax[.\w]*): ")
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def serve_once(cache_dir, log_path) -> dict:
    """Start `maxjax serve`, take one greedy completion and the metrics, stop it (SIGTERM)."""
    env = {**os.environ, "MAXJAX_CACHE_DIR": str(cache_dir)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "maxjax.cli", "serve", *FLAGS, "--host",
                                 "127.0.0.1", "--port", "0"], env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        try:
            ready = proc.stdout.readline()
            assert ready.startswith("Server ready on http://127.0.0.1:"), open(log_path).read()
            url = ready.split()[-1]
            r = http("POST", url + "/v1/completions", COMPLETION)
            assert r.status_code == 200, r.text
            metrics = {s.name: s.value for fam in text_string_to_metric_families(
                http("GET", url + "/metrics").text) for s in fam.samples}
            info = http("GET", url + "/stats").json()["info"]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
    return {"ready": ready.strip(), "text": r.json()["choices"][0]["text"], "metrics": metrics,
            "log": open(log_path).read().splitlines(), "info": info}


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    cache_dir = root / "cache"
    first = serve_once(cache_dir, root / "first.log")
    second = serve_once(cache_dir, root / "second.log")
    return first, second, cache_dir


def test_first_start_log_is_maxjax_lines_one_per_phase(starts):
    first, _, cache_dir = starts
    log = first["log"]
    for line in log:
        assert LINE.match(line), f"not a maxjax log line: {line!r}\n" + "\n".join(log)
    text = "\n".join(log)
    # the default: maxjax's CPU kernels where they run, the GGUF in its own 4-bit blocks
    why = cpu_kernels.unavailable()
    kernels = first["info"]["kernels"]
    if why is None:
        ext = cpu_kernels.extension()
        assert f"CPU kernels on ({cpu_kernels.isa()}{', ' + ext if ext else ''})" in text, text
        # the 4-bit blocks, and the int8 rows of the tied LM head
        assert kernels == {"isa": cpu_kernels.isa(), "extension": cpu_kernels.extension(), "attention": True,
                           "linear": [cpu_kernels.INT8_LINEAR, cpu_kernels.INT4_LINEAR]}
    else:
        assert f"CPU kernels off: {why}; XLA's path runs" in text, text
        assert kernels is None
    encoding = "int8" if why else "q4_1"
    pool = "float32" if why else "bfloat16"     # the kernels' default for quantized weights
    assert re.search(rf"KV pool of \d+ {pool} pages of", text), text
    for phase in ("Loading weights: the embedded SmolLM2-135M-Instruct",
                  f"Loaded SmolLM2-135M-Instruct ({encoding}) in",
                  f"Compiling 7 graphs (not in the compile cache yet: storing them in {cache_dir}/",
                  "Compiled 7/7 graphs", "Engine ready in"):
        assert phase in text, text
    assert [int(n) for n in re.findall(r"Compiled (\d)/7 graphs", text)] == [1, 2, 3, 4, 5, 6, 7]
    assert re.fullmatch(r"Server ready on http://127\.0\.0\.1:\d+", first["ready"])
    # the compiled entry, and the converted weights (maxjax/aot/weight_cache.py)
    assert len([n for n in os.listdir(cache_dir) if not n.startswith(".")]) == 2
    assert "compile cache: stored the converted weights" in text, text


def test_second_start_loads_every_graph_from_the_cache(starts):
    first, second, cache_dir = starts
    text = "\n".join(second["log"])
    # the first start recorded its entry: this one deserialized it while the weights loaded
    assert re.search(rf"Loaded 7 graphs from {cache_dir}/\w+ in [\d.]+ s \(7 executables, 7 "
                     r"deserialized while the weights loaded, 0 compiled from exports\)", text), text
    assert "Compiling" not in text
    assert re.search(r"Loaded SmolLM2-135M-Instruct \(\w+\) in [\d.]+ s \(converted weights "
                     r"from the compile cache\)", text), text
    # where each second went, from process start
    split = re.search(r"Start-up ([\d.]+) s from process start: imports and setup ([\d.]+) s, "
                      r"CPU kernels and cache key ([\d.]+) s, weights ([\d.]+) s, "
                      r"placing ([\d.]+) s, graphs ([\d.]+) s, engine and KV pool ([\d.]+) s, "
                      r"warm-up ([\d.]+) s$", text, re.M)
    assert split, text
    assert re.search(r"Plan made in [\d.]+ ms ", text), text     # BENCHMARKS.md
    total, *parts = map(float, split.groups())
    assert abs(sum(parts) - total) <= 0.1 * len(parts)     # every second named (each rounded)
    assert second["metrics"]["maxjax_xla_compiles_total"] == 0
    assert first["metrics"]["maxjax_xla_compiles_total"] >= 7
    assert second["text"] == first["text"] and first["text"]


def test_heartbeat_while_a_compile_runs(monkeypatch, caplog):
    monkeypatch.setattr(build, "HEARTBEAT_SECONDS", 0.2)
    with caplog.at_level(logging.INFO, logger="maxjax.engine"):
        with build.Heartbeat(True) as beat:
            beat.graph_done(1, 3, "step_t1_r1")
            end = time.monotonic() + 30
            while "Still compiling (" not in caplog.text and time.monotonic() < end:
                time.sleep(0.05)
    assert "Compiled 1/3 graphs (step_t1_r1, 0 s elapsed)" in caplog.text
    assert re.search(r"Still compiling \(\d+ s elapsed\)", caplog.text), caplog.text
