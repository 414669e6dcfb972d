"""The documented multi-device CPU configurations start on this machine with the default memory
flags (maxjax/engine/memory.py's host plan): the embedded SmolLM2 behind `maxjax serve` on
`--devices cpu:4` (tensor parallel; its 3 kv heads keep the pool whole on every device) and on
`--devices cpu:3 --data-parallel-degree 3` (three one-device replicas). Each answers a request,
logs the host plan, and peaks (VmHWM) within what the plan took of the host. Only
`--max-batch-input-tokens 32` is set, to compile fewer buckets: the pool, its cap and
--device-memory-utilization stay the defaults."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

# docs/testing.md: the fast tier is -m 'not slow'; serial: each start plans the pool out of the host's
# MemAvailable and fills 5.6 GiB a replica, so nothing else may run beside it
pytestmark = [pytest.mark.slow, pytest.mark.serial]

GiB = 1 << 30
START_TIMEOUT = 900          # three replicas compile one after the other on two cores


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kib = next(line for line in f if line.startswith("VmHWM")).split()[1]
    return int(kib) * 1024


def serve(tmp_path, *flags):
    """(peak RSS bytes, start-up log, completion text) of a `maxjax serve` with `flags`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONWARNINGS="ignore", MAXJAX_CACHE_DIR=str(tmp_path / "cache"))
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "maxjax.cli", "serve", "--port", "0",
                                 "--max-batch-input-tokens", "32", *flags],
                                stdout=o, stderr=e, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (m := re.search(r"Server ready on (\S+)", out.read_text())):
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(1)
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(m.group(1) + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            text = json.load(r)["choices"][0]["text"]
        peak = peak_rss(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return peak, err.read_text(), text


def planned_total(log: str) -> float:
    """The bytes the host plan took: MemAvailable + weights, x utilization (the plan line)."""
    m = re.search(r"KV pool [\d.]+ GiB on cpu.*host MemAvailable.* utilization = ([\d.]+) GiB",
                  log)
    assert m, log
    return float(m.group(1)) * GiB


@pytest.mark.parametrize("flags", [("--devices", "cpu:4"),
                                   ("--devices", "cpu:3", "--data-parallel-degree", "3")],
                         ids=["tp4", "dp3"])
def test_starts_with_default_memory_flags_and_fits_its_plan(tmp_path, flags):
    peak, log, text = serve(tmp_path, *flags)
    assert text.strip(), log[-3000:]
    assert "Traceback" not in log
    from maxjax.graphs import cpu_kernels     # a replica is one device: the kernels run there
    if "--data-parallel-degree" in flags and cpu_kernels.unavailable() is None:
        assert "CPU kernels on" in log and "CPU kernels off" not in log, log[-3000:]
    plan = planned_total(log)
    print(f"\n{' '.join(flags)}: peak RSS {peak / GiB:.1f} GiB, plan {plan / GiB:.1f} GiB")
    assert peak <= plan, (peak / GiB, plan / GiB, log[-3000:])
