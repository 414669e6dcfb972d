"""Compile time and step time of SmolLM2's 30 layers of projections (fused q|k|v, o, gate|up, down;
random f32 weights), unrolled over per-layer arrays (graphs/decoder.py) vs a `lax.scan` over
stacked ones, interleaved: what a loop over layers would save in compile time and cost per step.

    .venv/bin/python tools/bench_layer_loop.py [--rows 1 8 32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

L, D, QKV, F = 30, 576, 960, 1536


def layer(x, w):
    wqkv, wo, wgu, wd = w
    q = x @ wqkv
    x = x + q[:, :D] @ wo
    g, u = jnp.split(x @ wgu, 2, axis=-1)
    return x + (jax.nn.silu(g) * u) @ wd


def unrolled(x, ws):
    for i in range(L):
        x = layer(x, [w[i] for w in ws])
    return x


def scanned(x, ws):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]


def measure(fn, x, ws, iters: int) -> tuple[float, float]:
    jax.clear_caches()
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(x, ws).compile()
    compile_s = time.perf_counter() - t0
    compiled(x, ws).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        compiled(x, ws).block_until_ready()
        times.append(time.perf_counter() - t)
    return compile_s, statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    stacked = tuple(jnp.asarray(rng.standard_normal((L, *s), np.float32) * 0.02)
                    for s in ((D, QKV), (D, D), (D, 2 * F), (F, D)))
    per_layer = tuple([jnp.array(w[i]) for i in range(L)] for w in stacked)
    measure(layer, jnp.ones((1, D), jnp.float32), [w[0] for w in per_layer], 1)  # first-compile costs
    print("| rows | unrolled compile s | scan compile s | unrolled step ms | scan step ms |")
    print("|---|---|---|---|---|")
    for m in args.rows:
        x = jnp.ones((m, D), jnp.float32)
        got = {"unrolled": [], "scan": []}
        for _ in range(args.rounds):
            got["unrolled"].append(measure(unrolled, x, per_layer, args.iters))
            got["scan"].append(measure(scanned, x, stacked, args.iters))
        med = {k: [statistics.median(r[i] for r in v) for i in (0, 1)] for k, v in got.items()}
        print(f"| {m} | {med['unrolled'][0]:.2f} | {med['scan'][0]:.2f} | {med['unrolled'][1]:.1f} "
              f"| {med['scan'][1]:.1f} |")


if __name__ == "__main__":
    main()
