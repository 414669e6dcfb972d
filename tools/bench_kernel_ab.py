"""The CPU paged-attention kernel (graphs/kernels/paged_attention.cc) of this checkout against
another git revision's, on SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64, 30 layers a
step, pages of 32, float32 pool), decode steps of a few long rows to many short ones. A process
loads one build of the kernels, so each side runs in its own process, the two alternating for
--rounds rounds: this machine drifts by up to ~25% over minutes.

    .venv/bin/python tools/bench_kernel_ab.py --against HEAD~1 [--rounds 4] [--iters 30]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE, H, KV, HD, LAYERS, POOL_PAGES = 32, 9, 3, 64, 30, 600
CASES = {   # name: the context of each decoding row
    "1 row x 256": [256], "1 row x 1024": [1024], "1 row x 4096": [4096],
    "4 rows x 2000": [2000] * 4, "32 rows x 256": [256] * 32,
}


def measure(iters: int) -> dict[str, float]:
    """Median ms of a step's attention (every layer) per case, with the kernels of the checkout
    this process imports."""
    import maxjax  # noqa: F401  (XLA defaults before JAX starts)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from maxjax.graphs import attention
    from maxjax.graphs.cpu_attention import CPU_PAGED_KERNEL
    from maxjax.graphs.step import RowSlice, build_step_inputs
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((LAYERS, POOL_PAGES, KV, PAGE, HD)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((LAYERS, POOL_PAGES, KV, PAGE, HD)), jnp.float32)
    out = {}
    for name, contexts in CASES.items():
        rows, first = [], 1
        for ctx in contexts:
            n = ctx // PAGE + 1
            rows.append(RowSlice([5], ctx, list(range(first, first + n))))
            first += n
        max_pages = max(len(r.pages) for r in rows)
        step = jax.tree.map(jnp.asarray, build_step_inputs(rows, len(rows), len(rows), max_pages,
                                                           PAGE, backend=CPU_PAGED_KERNEL))
        q = jnp.asarray(rng.standard_normal((len(rows), H, HD)), jnp.float32)

        def all_layers(q, k, v, step):
            return sum(attention.attend(q, k, v, layer, step, 0, HD ** -0.5, None)
                       for layer in range(LAYERS))
        fn = jax.jit(all_layers)
        fn(q, k, v, step).block_until_ready()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn(q, k, v, step).block_until_ready()
            times.append(time.perf_counter() - t)
        out[name] = float(np.median(times)) * 1e3
    return out


def run_side(repo: str, iters: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure",
                           "--iters", str(iters)], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": repo})
    if done.returncode:
        sys.exit(f"{repo}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", help="git revision to compare with (default: none, this alone)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.iters)))
        return
    sides = {"this checkout": HERE}
    tmp = tempfile.TemporaryDirectory()
    if args.against:
        other = os.path.join(tmp.name, "other")
        os.makedirs(other)
        archive = subprocess.run(["git", "archive", args.against], cwd=HERE, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", other], input=archive, check=True)
        sides = {args.against: other, **sides}
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side, repo in sides.items():
            results[side].append(run_side(repo, args.iters))
            print(f"round {r + 1} {side}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in results[side][-1].items()), flush=True)
    import numpy as np
    names = list(sides)
    print("\n| case | " + " | ".join(f"{s} ms" for s in names) +
          (" | ratio |" if len(names) == 2 else " |"))
    print("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    for case in CASES:
        med = [float(np.median([m[case] for m in results[s]])) for s in names]
        ratio = f" | {med[0] / med[1]:.2f}x" if len(names) == 2 else ""
        print(f"| {case} | " + " | ".join(f"{m:.2f}" for m in med) + ratio + " |")


if __name__ == "__main__":
    main()
