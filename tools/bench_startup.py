"""Start-up time of SmolLM2 (embedded GGUF, default bucket set) from process start to ready:
cold, with JAX's persistent compilation cache warm, and with --precompiled-artifacts (graphs only,
and graphs + the stored converted weights); split into imports, weight loading and graph loading.

    .venv/bin/python tools/bench_startup.py [--num-kv-pages 64] [--runs 1] [--jobs 1 2]

Each measurement is a fresh subprocess; the parent takes the time just before spawning it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
t_start = float(sys.argv[1]); mode = sys.argv[2]; art = sys.argv[3]; pages = int(sys.argv[4])
t0 = time.time()
import jax
from maxjax.engine.config import EngineConfig
from maxjax.engine.core import EngineCore
from maxjax.models.loader import load_model
t_import = time.time()
stored = None
if mode == "artifacts":
    from maxjax.aot import weights as aot_weights
    stored = aot_weights.params_source([art])
elif mode == "artifacts-no-weights":
    mode = "artifacts"
model = load_model(None, None, None, progress=False, params_source=stored)
t_weights = time.time()
cfg = EngineConfig(num_kv_pages=pages, quantization_encoding=model.dtype)
loaded = ()
if mode == "artifacts":
    from maxjax.aot import load as aot_load
    loaded = aot_load.load_for_engine([art], model, cfg)
core = EngineCore(model, cfg, *loaded)
core.warmup()
t_ready = time.time()
print(json.dumps({"python_start": t0 - t_start, "imports": t_import - t0,
                  "weights": t_weights - t_import, "graphs": t_ready - t_weights,
                  "total": t_ready - t_start, "graphs_n": len(core.layout.buckets),
                  "compiles": core.stats()["xla_compiles"]}))
"""


MODES = ("cold", "cache", "artifacts-no-weights", "artifacts")


def child(mode: str, art: str, pages: int, env: dict) -> dict:
    t = time.time()
    r = subprocess.run([sys.executable, "-c", CHILD, repr(t), mode, art, str(pages)], env=env,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-kv-pages", type=int, default=64,
                    help="KV pool (pinned so that runs compare; does not change compile time)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--jobs", type=int, nargs="+", default=[1], help="warm-cache --jobs values to time")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-startup-")
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    base["TOKENIZERS_PARALLELISM"] = "false"
    cold_env = {**base, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    cache_env = {**base, "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, "jax-cache"),
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    results: dict = {"cpu_count": os.cpu_count(), "loadavg": os.getloadavg()}
    art = os.path.join(tmp, "artifacts")
    for jobs in args.jobs:
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "maxjax.cli", "warm-cache", "--num-kv-pages",
                            str(args.num_kv_pages), "--artifacts-dir", art, "--jobs", str(jobs)],
                           env=cold_env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        results[f"warm_cache_jobs{jobs}_s"] = round(time.time() - t0, 1)
    if "cache" in args.modes:
        child("cache", art, args.num_kv_pages, cache_env)      # fills the persistent cache
    for mode in args.modes:
        env = cache_env if mode == "cache" else cold_env
        runs = [child(mode, art, args.num_kv_pages, env) for _ in range(args.runs)]
        results[mode] = {k: round(min(r[k] for r in runs), 2) for k in runs[0]}
    results["loadavg_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
