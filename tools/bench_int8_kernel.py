"""What a hand-written CPU int8 kernel would give the quantized path (issue 12's "what would close
it"): tools/kernels/int8_linear_ffi.cc, a weight-only int8 x float32 matmul over weights packed
[out/64, in, 64] (an XLA FFI custom call, built here with g++), against the graph's own int8
W8A8 dot (graphs/quant.py, YNNPACK) and float32, interleaved in one run:

  1. SmolLM2's projections at 1, 2, 8 and 32 rows (us per call, median; error vs NumPy);
  2. the whole SmolLM2 int8 decode step (real weights) with every int8 projection and the LM
     head sent to the kernel instead, at 1 and 32 rows: step ms and the greedy tokens' agreement.

The graphs do not use this kernel: it is a measured prototype (BENCHMARKS.md, Quantized weights).

    .venv/bin/python tools/bench_int8_kernel.py [--rows 1,2,8,32] [--step-rows 1,32] [--iters 100]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import decode_case  # noqa: E402

from maxjax.graphs import quant  # noqa: E402
from maxjax.models.loader import load_model  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "int8_linear_ffi.cc")
TARGET = "maxjax_int8_linear"
TILE = 64


def build_and_register() -> None:
    if "avx512bw" not in open("/proc/cpuinfo").read():
        raise SystemExit("the prototype kernel needs AVX-512F/BW")
    lib = os.path.join(tempfile.mkdtemp(), "int8_linear.so")
    subprocess.run(["g++", "-O3", "-mavx512f", "-mavx512bw", "-mfma", "-std=c++17", "-shared",
                    "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", SOURCE, "-o", lib, "-lpthread"],
                   check=True)
    handle = ctypes.cdll.LoadLibrary(lib)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(handle, TARGET)), platform="cpu")


def pack(q) -> jax.Array:
    """int8 [in, out] -> [out/64, in, 64]."""
    q = np.asarray(q)
    i, o = q.shape
    return jnp.asarray(np.ascontiguousarray(q.reshape(i, o // TILE, TILE).transpose(1, 0, 2)))


def kernel_linear(x, packed, scale):
    lead, d_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d_in).astype(jnp.float32)
    out = packed.shape[0] * packed.shape[2]
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], out), jnp.float32))(
        x2, packed, scale)
    return y.reshape(*lead, out)


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


def kernel_params(params: dict) -> dict:
    """The int8 params with every projection (and the LM head) packed for the kernel; the
    embedding table stays as it is for the row lookup."""
    def conv(w):
        if isinstance(w, quant.QuantizedWeight) and w.bits == 8:
            return quant.QuantizedWeight(pack(w.q), w.scale)
        return w
    layers = [{k: conv(v) for k, v in layer.items()} for layer in params["layers"]]
    head = params.get("lm_head", params["embed"])
    return {**params, "layers": layers,
            "lm_head": quant.QuantizedWeight(pack(np.asarray(head.q).T), head.scale)}


def whole_step(step_rows: list[int], iters: int) -> None:
    model = load_model(None, "int8", progress=False)
    graph_linear = quant.linear

    def linear(x, w, transposed=False, out_dtype=None):
        if w.q.ndim == 3:         # packed for the kernel (transposed: packed from [out, in])
            return kernel_linear(x, w.q, w.scale).astype(out_dtype or x.dtype)
        return graph_linear(x, w, transposed, out_dtype)
    kparams = kernel_params(model.params)
    print("\n| SmolLM2 int8 decode step, 256 context | graph int8 ms | kernel ms | speed-up | "
          "greedy tokens equal |")
    print("|---|---:|---:|---:|---:|")
    for r in step_rows:
        cases = {"graph": decode_case(model, model.params, r, 256, 32, "float32")}
        quant.linear = linear
        try:
            cases["kernel"] = decode_case(model, kparams, r, 256, 32, "float32")
        finally:
            quant.linear = graph_linear
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,8,32")
    ap.add_argument("--step-rows", default="1,32")
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    build_and_register()
    projections([int(r) for r in args.rows.split(",")], args.iters)
    whole_step([int(r) for r in args.step_rows.split(",")], max(5, args.iters // 10))


if __name__ == "__main__":
    main()
