"""Start-up time of `maxjax serve` (embedded SmolLM2, default bucket set, --num-kv-pages pinned),
from process start to `/v1/health` 200, each start a fresh process:
  cold       an empty compile cache (compiles every graph and stores it)
  second     the same cache again (loads every graph)
  artifacts  --precompiled-artifacts from `maxjax warm-cache --artifacts-dir`
  artifacts-weights  the same with the converted weights stored (warm-cache --store-weights,
             orbax): restored instead of converting the checkpoint
  no-cache   --no-compile-cache (compiles, stores nothing)
and, with --against REV, REV's own `maxjax serve` cold (installed from a worktree into a venv
of its own, as tools/ab_step.py does), in the same rounds. "compile" is the graph phase the
server logs (`graphs ready in` / `Engine ready in`: after the weights, to every graph ready),
"weights" the model load it logs (`Loaded NAME (ENCODING) in S s`).

    .venv/bin/python tools/bench_startup.py [--against REV] [--rounds 1] [--jobs 1 2]
        [--modes artifacts artifacts-weights] [--encoding int8] [--engine-flags '...']
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY = re.compile(r"(?:graphs ready|Engine ready) in ([\d.]+) s")
WEIGHTS = re.compile(r"Loaded \S+ \(\S+\) in ([\d.]+) s")
PHASES = re.compile(r"Start-up [\d.]+ s from process start: (.+)$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def serve(python: str, flags: list[str], env: dict, cwd: str) -> dict:
    """Seconds from spawn to /v1/health 200, and the compile phase from the server's log. `cwd`
    outside any checkout: `-m` puts it first on sys.path."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.time()
    proc = subprocess.Popen([python, "-m", "maxjax.cli", "serve", *flags, "--host", "127.0.0.1",
                             "--port", str(port)], env=env, cwd=cwd, stdout=log, stderr=log)
    try:
        while not healthy(f"http://127.0.0.1:{port}/v1/health"):
            if proc.poll() is not None:
                sys.exit(open(log.name).read()[-3000:])
            time.sleep(0.05)
        total = time.time() - t0
    finally:
        proc.terminate()
        proc.wait(60)
    text = open(log.name).read()
    os.unlink(log.name)
    m, w, p = READY.search(text), WEIGHTS.search(text), PHASES.search(text)
    return {"total": round(total, 2), "compile": float(m.group(1)) if m else float("nan"),
            "weights": float(w.group(1)) if w else float("nan"),
            "phases": p.group(1) if p else "?"}


def _see_all_site_dirs(python: str) -> None:
    """The other revision's venv reads this venv's packages; where these come from other
    site-packages through .pth lines (a venv over another), it reads those too."""
    import sysconfig
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    dirs = [p for p in sys.path if p.endswith("site-packages") and p != sysconfig.get_path("purelib")]
    with open(os.path.join(out, "maxjax-bench-deps.pth"), "w") as f:
        f.write("".join(d + "\n" for d in dirs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-kv-pages", type=int, default=64,
                    help="KV pool (pinned so that runs compare; does not change compile time); "
                         "0: the default, sized from this machine's memory")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--against", help="a git revision whose cold start to time in the same rounds")
    ap.add_argument("--jobs", type=int, nargs="+", default=[0],
                    help="MAXJAX_COMPILE_JOBS values for the cold start (0: the default)")
    ap.add_argument("--modes", nargs="+", default=["cold", "second", "artifacts", "no-cache"])
    ap.add_argument("--encoding", help="--quantization-encoding (default: the model's)")
    ap.add_argument("--engine-flags", default="",
                    help="more engine flags for every start, e.g. '--max-batch-size 4' (fewer "
                         "graphs: quicker warm-cache when the weights are what is timed)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-startup-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "MAXJAX_"))}
    env.update(TOKENIZERS_PARALLELISM="false", JAX_ENABLE_COMPILATION_CACHE="false")
    flags = ["--num-kv-pages", str(args.num_kv_pages)] if args.num_kv_pages else []
    flags += ["--quantization-encoding", args.encoding] if args.encoding else []
    flags += shlex.split(args.engine_flags)
    other = None
    if args.against:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        from ab_step import install
        other = install(args.against)
        _see_all_site_dirs(other[1])
    art, art_w = os.path.join(tmp, "artifacts"), os.path.join(tmp, "artifacts-weights")
    for mode, d, store in (("artifacts", art, "--no-store-weights"),
                           ("artifacts-weights", art_w, "--store-weights")):
        if mode in args.modes:
            subprocess.run([sys.executable, "-m", "maxjax.cli", "warm-cache", *flags, store,
                            "--artifacts-dir", d], env=env, check=True, capture_output=True)
    times: dict[str, list[dict]] = {}
    try:
        for r in range(args.rounds):
            if other:
                tree, python = other
                times.setdefault(f"{args.against} cold", []).append(
                    serve(python, flags, {**env, "MAXJAX_CACHE_DIR": os.path.join(tmp, "o")}, tmp))
            for jobs in args.jobs:
                cache = os.path.join(tmp, f"cache-{r}-{jobs}")
                e = {**env, "MAXJAX_CACHE_DIR": cache, **({"MAXJAX_COMPILE_JOBS": str(jobs)}
                                                          if jobs else {})}
                tag = f" (jobs {jobs})" if jobs else ""
                for mode in args.modes:
                    extra = {"artifacts": ["--precompiled-artifacts", art],
                             "artifacts-weights": ["--precompiled-artifacts", art_w],
                             "no-cache": ["--no-compile-cache"]}.get(mode, [])
                    if mode == "second" and "cold" not in args.modes:
                        serve(sys.executable, flags, e, tmp)
                    if mode in ("artifacts", "artifacts-weights", "no-cache", "second") and \
                            jobs != args.jobs[0]:
                        continue
                    times.setdefault(mode + tag, []).append(
                        serve(sys.executable, flags + extra, e, tmp))
                shutil.rmtree(cache, ignore_errors=True)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        if other:
            subprocess.run(["git", "worktree", "remove", "--force", other[0]], cwd=ROOT,
                           capture_output=True)
            shutil.rmtree(os.path.dirname(other[0]), ignore_errors=True)     # and its venv
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"cpus {os.cpu_count()}, load average after {os.getloadavg()[0]:.2f}")
    print("| start | to /v1/health 200 (s) | weights (s) | graph phase (s) | runs |")
    print("|---|---|---|---|---|")
    med = {}
    for name, runs in times.items():
        med[name] = {k: statistics.median(x[k] for x in runs) for k in ("total", "weights",
                                                                          "compile")}
        print(f"| {name} | {med[name]['total']:.1f} | {med[name]['weights']:.2f} | "
              f"{med[name]['compile']:.1f} | {json.dumps([x['total'] for x in runs])} |")
    if "cold" in med and "second" in med:
        print(f"second / cold (to health): {med['second']['total'] / med['cold']['total']:.3f}")
    print("\nwhere each second went (the server's start-up line, last run of each):")
    for name, runs in times.items():
        print(f"- {name}: {runs[-1]['phases']}")
    if other and "cold" in med:
        base = med[f"{args.against} cold"]
        print(f"cold graph phase / {args.against}'s: {med['cold']['compile'] / base['compile']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
