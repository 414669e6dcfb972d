"""The one-row step's linears through the CPU kernels (graphs/cpu_kernels.py), SmolLM2-135M's
matrices in the embedded GGUF's encodings (tools/bench_cpu_extension.py SHAPES), two ways in one
process: "streamed", a step's worth (30 layers of q|k|v, o, gate|up and down, each layer its own
weights, then the int8 LM head: ~108 MB read once a step, as a decode step reads them), and
"per shape", each shape's 30 calls in a row, timed again and again (0.2-40 MB of weights that the
caches keep warm between iterations). The gap between the two is what reaching memory costs the
step beyond the calls themselves; GB/s counts the packed weights, scales and lows read.

    .venv/bin/python tools/bench_linear_stream.py [--iters 100]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import cpu_kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_extension import LAYERS, SHAPES, weight  # noqa: E402

ORDER = ("qkv", "o", "gate_up", "down")


def _chain(x, ws):
    """Each call's input depends on the last one's output, so the calls run one after another."""
    for w in ws:
        y = cpu_kernels.packed_linear(x, w)
        x = x + 1e-9 * jnp.sum(y)
    return x


def _step(x, layers, head):
    for layer in layers:
        for name, w in zip(ORDER, layer):
            inputs = SHAPES[name][0]
            y = cpu_kernels.packed_linear(jnp.tile(x, (1, -(-inputs // x.shape[1])))[:, :inputs], w)
            x = x + 1e-9 * jnp.sum(y)
    return cpu_kernels.packed_linear(x, head)


def _median_ms(f, args, iters: int) -> float:
    for _ in range(3):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def _nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    if cpu_kernels.unavailable():
        raise SystemExit(f"needs the CPU kernels: {cpu_kernels.unavailable()}")
    rng = np.random.default_rng(0)
    layers = [[weight(rng, *SHAPES[n][:3]) for n in ORDER] for _ in range(LAYERS)]
    head = weight(rng, *SHAPES["lm_head"][:3])
    x = jnp.ones((1, SHAPES["qkv"][0]), jnp.float32)
    nbytes = _nbytes((layers, head))
    ms = _median_ms(jax.jit(_step), (x, layers, head), args.iters)
    print(f"{cpu_kernels.isa()}: one row, SmolLM2's linears")
    print(f"streamed: a step's linears {ms:.2f} ms for {nbytes / 1e6:.0f} MB, "
          f"{nbytes / ms / 1e6:.1f} GB/s")
    total = 0.0
    for name in (*ORDER, "lm_head"):
        i, o, bits, calls = SHAPES[name]
        n = LAYERS if calls > 1 else 4
        ws = [layers[k][ORDER.index(name)] for k in range(n)] if calls > 1 else [head] * n
        per = _median_ms(jax.jit(_chain), (jnp.ones((1, i), jnp.float32), ws), args.iters) / n
        total += per * calls
        print(f"per shape: {name} {i}x{o} ({bits}-bit) {per * 1e3:.1f} us a call, "
              f"{_nbytes(ws[0]) / per / 1e6:.1f} GB/s")
    print(f"per shape: a step's linears {total:.2f} ms ({nbytes / total / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
