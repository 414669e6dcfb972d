"""Time from a request for an unloaded model to its first token, on a server of several models
(`maxjax serve --models-file`, --max-loaded-models 1: each request for the other model unloads
one and loads the other), loading from the compile cache and from warm-cache artifacts, against a
cold start of the same model (`maxjax serve --no-compile-cache`: process start to first token).

    python tools/bench_model_swap.py [--model PATH] [--rounds 3] [--port 8123]

Everything runs in a fresh $MAXJAX_CACHE_DIR (a temporary directory), with small engine flags."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

FLAGS = ["--max-length", "512", "--max-batch-size", "4", "--max-batch-input-tokens", "64",
         "--kv-cache-page-size", "16", "--num-kv-pages", "80", "--log-level", "warning"]


def first_token(url: str, model: str | None, timeout: float = 900) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": model} if model else {}
    body = {**body, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                t = time.perf_counter() - t0
                r.read()
                return t
    raise RuntimeError("no token")


def wait_ready(url: str, proc, timeout: float = 1800) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the server did not get ready")


def serve(args: list[str], env: dict, port: int):
    return subprocess.Popen([sys.executable, "-m", "maxjax.cli", "serve", "--port", str(port),
                             *args], env=env)


def stop(proc) -> None:
    proc.terminate()
    proc.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=8123)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-model-swap-")
    env = dict(os.environ, MAXJAX_CACHE_DIR=os.path.join(work, "cache"))
    url = f"http://127.0.0.1:{a.port}"
    model = ["--model", a.model] if a.model else []

    # a cold start: process start to first token, nothing compiled before
    t0 = time.perf_counter()
    proc = serve([*model, *FLAGS, "--no-compile-cache"], env, a.port)
    try:
        wait_ready(url, proc)
        first_token(url, None)
        cold = time.perf_counter() - t0
    finally:
        stop(proc)

    artifacts = os.path.join(work, "artifacts")
    subprocess.run([sys.executable, "-m", "maxjax.cli", "warm-cache", *model, *FLAGS,
                    "--artifacts-dir", artifacts], env=env, check=True)
    entry = {"model": a.model} if a.model else {}
    models = [dict(entry, name="from-cache"),
              dict(entry, name="from-artifacts", precompiled_artifacts=[artifacts])]
    path = os.path.join(work, "models.json")
    with open(path, "w") as f:
        json.dump(models, f)
    proc = serve([*FLAGS, "--models-file", path, "--max-loaded-models", "1"], env, a.port)
    times: dict = {"from-cache": [], "from-artifacts": []}
    try:
        wait_ready(url, proc)       # from-cache loaded (compiled into the cache) at start
        first_token(url, "from-cache")
        for _ in range(a.rounds):
            for name in ("from-artifacts", "from-cache"):
                times[name].append(first_token(url, name))
        warm = first_token(url, "from-cache")       # loaded: the request's own time
    finally:
        stop(proc)
    print(f"model: {a.model or 'embedded SmolLM2-135M'}; flags: {' '.join(FLAGS[:-2])}")
    print(f"cold start (process start to first token, --no-compile-cache): {cold:.2f} s")
    for name, ts in times.items():
        print(f"unloaded -> first token, {name}: median {statistics.median(ts):.2f} s "
              f"(runs: {', '.join(f'{t:.2f}' for t in ts)}; each also unloads the other model)")
    print(f"loaded -> first token: {warm:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
