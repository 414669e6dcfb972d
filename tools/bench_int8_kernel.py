"""The CPU int8 kernel of --use-experimental-kernels (graphs/cpu_kernels.py: the graph's two-digit
W8A8 arithmetic on AVX-512 VNNI over weights packed [out/64, in/4, 64, 4], an XLA FFI custom
call) against the graph's own int8 dot (graphs/quant.py, YNNPACK) and float32, interleaved:

  1. SmolLM2's projections at 1, 2, 8 and 32 rows (us per call, median; error vs NumPy);
  2. the whole SmolLM2 int8 decode step (real weights), the params as the engine packs them for
     the kernel, at 1 and 32 rows: step ms and the greedy tokens' agreement;
  3. with --mixed, decode rows plus a prefill chunk: the kernel on the live rows against every
     row of the padded bucket.

    .venv/bin/python tools/bench_int8_kernel.py [--rows 1,2,8,32] [--step-rows 1,32]
        [--mixed 31+128,7+128] [--iters 100]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import decode_case  # noqa: E402

from maxjax.graphs import cpu_kernels, quant  # noqa: E402
from maxjax.models.loader import load_model  # noqa: E402


def kernel_linear(x, packed, scale):
    return cpu_kernels.packed_linear(x, quant.QuantizedWeight(packed, scale))


def pack(q):
    return cpu_kernels.pack_weight(quant.QuantizedWeight(jnp.asarray(q), jnp.ones(q.shape[1]))).q


def timed(fns: dict, iters: int) -> dict:
    """{name: median us} of the zero-argument callables, called round-robin."""
    times = {k: [] for k in fns}
    for f in fns.values():
        jax.block_until_ready(f())
    for _ in range(iters):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) * 1e6 for k, v in times.items()}


def projections(rows: list[int], iters: int) -> None:
    rng = np.random.default_rng(0)
    print("| projection [in x out] | rows | float32 us | graph int8 W8A8 us | kernel us | "
          "kernel vs graph int8 | kernel max rel. error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, o in [(576, 960), (576, 3456), (1536, 576), (576, 49152)]:
        qn = rng.integers(-127, 128, (i, o)).astype(np.int8)
        sc = jnp.asarray(rng.random(o).astype(np.float32) / 100)
        w, wf, packed = quant.QuantizedWeight(jnp.asarray(qn), sc), jnp.asarray(
            qn.astype(np.float32) * np.asarray(sc)), pack(qn)
        f32, q8, kern = jax.jit(jnp.matmul), jax.jit(quant.linear), jax.jit(kernel_linear)
        for r in rows:
            xn = rng.standard_normal((r, i)).astype(np.float32)
            x = jnp.asarray(xn)
            us = timed({"f32": lambda: f32(x, wf), "int8": lambda: q8(x, w),
                        "kernel": lambda: kern(x, packed, sc)}, iters)
            want = (xn.astype(np.float64) @ qn.astype(np.float64)) * np.asarray(sc)
            err = np.abs(np.asarray(kern(x, packed, sc)) - want).max() / np.abs(want).max()
            print(f"| {i} x {o} | {r} | {us['f32']:.0f} | {us['int8']:.0f} | {us['kernel']:.0f} | "
                  f"{us['int8'] / us['kernel']:.2f}x | {err:.1e} |", flush=True)


def whole_step(step_rows: list[int], iters: int) -> None:
    model = load_model(None, "int8", progress=False)
    kparams = cpu_kernels.pack_params(model.params)
    print("\n| SmolLM2 int8 decode step, 256 context | graph int8 ms | kernel ms | speed-up | "
          "greedy tokens equal |")
    print("|---|---:|---:|---:|---:|")
    for r in step_rows:
        cases = {"graph": decode_case(model, model.params, r, 256, 32, "float32"),
                 "kernel": decode_case(model, kparams, r, 256, 32, "float32")}
        params = {"graph": model.params, "kernel": kparams}
        tokens = {}

        def call(name):
            c, kv, st, sa = cases[name]
            out, kv = c(params[name], kv, st, sa)
            cases[name] = (c, kv, st, sa)
            tokens[name] = np.asarray(out[0].token_ids)
            return out[0].token_ids
        ms = {k: v / 1e3 for k, v in timed({k: (lambda k=k: call(k)) for k in cases},
                                            iters).items()}
        same = float(np.mean(tokens["graph"] == tokens["kernel"]))
        print(f"| {r} rows | {ms['graph']:.1f} | {ms['kernel']:.1f} | "
              f"{ms['graph'] / ms['kernel']:.2f}x | {100 * same:.0f}% |", flush=True)


def mixed_steps(mixes: list[tuple[int, int]], iters: int) -> None:
    """Steps of `d` decode rows plus one `p`-token prefill chunk, padded to the bucket: the
    kernel on the live token rows only (as served) against the kernel on every row."""
    from maxjax.graphs import step as step_mod
    model = load_model(None, "int8", progress=False)
    kparams = cpu_kernels.pack_params(model.params)
    live_tokens = step_mod.StepInputs.live_tokens
    print("\n| SmolLM2 int8 + kernel, mixed step | bucket tokens | every row ms | live rows ms | "
          "speed-up |")
    print("|---|---:|---:|---:|---:|")
    for d, p in mixes:
        step_mod.StepInputs.live_tokens = lambda self: self.token_ids.shape[0]
        cases = {"all": decode_case(model, kparams, d, 256, 32, "float32", p)}
        step_mod.StepInputs.live_tokens = live_tokens
        cases["live"] = decode_case(model, kparams, d, 256, 32, "float32", p)

        def call(name):
            c, kv, st, sa = cases[name]
            out, kv = c(kparams, kv, st, sa)
            cases[name] = (c, kv, st, sa)
            return out[0].token_ids
        ms = {k: v / 1e3 for k, v in timed({k: (lambda k=k: call(k)) for k in cases},
                                            iters).items()}
        bucket = cases["live"][2].token_ids.shape[0]
        print(f"| {d} decode rows + {p} prompt tokens | {bucket} | {ms['all']:.1f} | "
              f"{ms['live']:.1f} | {ms['all'] / ms['live']:.2f}x |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,8,32")
    ap.add_argument("--step-rows", default="1,32")
    ap.add_argument("--mixed", default="", metavar="D+P,...",
                    help="also mixed steps of D decode rows + a P-token prefill chunk, e.g. 31+128")
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    why = cpu_kernels.unavailable()
    if why:
        raise SystemExit(f"the CPU int8 kernel cannot run here: {why}")
    projections([int(r) for r in args.rows.split(",")], args.iters)
    whole_step([int(r) for r in args.step_rows.split(",")], max(5, args.iters // 10))
    if args.mixed:
        mixed_steps([tuple(int(v) for v in m.split("+")) for m in args.mixed.split(",")],
                    max(3, args.iters // 20))


if __name__ == "__main__":
    main()
