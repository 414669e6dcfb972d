"""The CPU int8 kernel of --use-experimental-kernels (graphs/cpu_kernels.py: the graph's two-digit
W8A8 arithmetic over weights packed [out/64, in/4, 64, 4], an XLA FFI custom call, for each
instruction set: AVX-512 VNNI, AVX2) against the graph's own int8 dot (graphs/quant.py,
YNNPACK) and float32, interleaved:

  1. SmolLM2's projections at 1, 2, 8 and 32 rows (us per call, median; error vs NumPy);
  2. the whole SmolLM2 int8 decode step (real weights), the params as the engine packs them for
     the kernel, at 1 and 32 rows: step ms and the greedy tokens' agreement;
  3. with --mixed, decode rows plus a prefill chunk: the kernel on the live rows against every
     row of the padded bucket.

--isa: the kernel ISAs to time, side by side (default: every one this CPU runs).

    .venv/bin/python tools/bench_int8_kernel.py [--rows 1,2,8,32] [--step-rows 1,32]
        [--mixed 31+128,7+128] [--iters 100] [--isa avx512,avx2]
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


def kernel_linear(x, packed, scale, isa):
    return cpu_kernels.packed_linear(x, quant.QuantizedWeight(packed, scale), isa=isa)


def traced_as(isa: str, make):
    """make() with `isa` as the process's kernel ISA (the step graphs read it while tracing)."""
    before = os.environ.get(cpu_kernels.ISA_ENV)
    os.environ[cpu_kernels.ISA_ENV] = isa
    try:
        return make()
    finally:
        if before is None:
            del os.environ[cpu_kernels.ISA_ENV]
        else:
            os.environ[cpu_kernels.ISA_ENV] = before


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


def projections(rows: list[int], iters: int, isas: list[str]) -> None:
    rng = np.random.default_rng(0)
    print("| projection [in x out] | rows | float32 us | graph int8 W8A8 us | "
          + "".join(f"{a} kernel us | " for a in isas)
          + "".join(f"{a} vs graph int8 | " for a in isas) + "kernel max rel. error |")
    print("|---|---:|---:|---:|" + "---:|" * (2 * len(isas) + 1))
    for i, o in [(576, 960), (576, 3456), (1536, 576), (576, 49152)]:
        qn = rng.integers(-127, 128, (i, o)).astype(np.int8)
        sc = jnp.asarray(rng.random(o).astype(np.float32) / 100)
        w, wf, packed = quant.QuantizedWeight(jnp.asarray(qn), sc), jnp.asarray(
            qn.astype(np.float32) * np.asarray(sc)), pack(qn)
        f32, q8 = jax.jit(jnp.matmul), jax.jit(quant.linear)
        kern = jax.jit(kernel_linear, static_argnums=3)
        for r in rows:
            xn = rng.standard_normal((r, i)).astype(np.float32)
            x = jnp.asarray(xn)
            us = timed({"f32": lambda: f32(x, wf), "int8": lambda: q8(x, w),
                        **{a: (lambda a=a: kern(x, packed, sc, a)) for a in isas}}, iters)
            want = (xn.astype(np.float64) @ qn.astype(np.float64)) * np.asarray(sc)
            err = max(np.abs(np.asarray(kern(x, packed, sc, a)) - want).max() for a in isas)
            print(f"| {i} x {o} | {r} | {us['f32']:.0f} | {us['int8']:.0f} | "
                  + "".join(f"{us[a]:.0f} | " for a in isas)
                  + "".join(f"{us['int8'] / us[a]:.2f}x | " for a in isas)
                  + f"{err / np.abs(want).max():.1e} |", flush=True)


def whole_step(step_rows: list[int], iters: int, isas: list[str]) -> None:
    model = load_model(None, "int8", progress=False)
    kparams = cpu_kernels.pack_params(model.params)
    print("\n| SmolLM2 int8 decode step, 256 context | graph int8 ms | "
          + "".join(f"{a} kernel ms | " for a in isas) + "".join(f"{a} speed-up | " for a in isas)
          + "greedy tokens equal |")
    print("|---|---:|" + "---:|" * (2 * len(isas) + 1))
    for r in step_rows:
        cases = {"graph": decode_case(model, model.params, r, 256, 32, "float32"),
                 **{a: traced_as(a, lambda: decode_case(model, kparams, r, 256, 32, "float32"))
                    for a in isas}}
        params = {"graph": model.params, **{a: kparams for a in isas}}
        tokens = {}

        def call(name):
            c, kv, st, sa = cases[name]
            out, kv = c(params[name], kv, st, sa)
            cases[name] = (c, kv, st, sa)
            tokens[name] = np.asarray(out[0].token_ids)
            return out[0].token_ids
        ms = {k: v / 1e3 for k, v in timed({k: (lambda k=k: call(k)) for k in cases},
                                            iters).items()}
        same = min(float(np.mean(tokens["graph"] == tokens[a])) for a in isas)
        print(f"| {r} rows | {ms['graph']:.1f} | " + "".join(f"{ms[a]:.1f} | " for a in isas)
              + "".join(f"{ms['graph'] / ms[a]:.2f}x | " for a in isas)
              + f"{100 * same:.0f}% |", flush=True)


def mixed_steps(mixes: list[tuple[int, int]], iters: int) -> None:
    """Steps of `d` decode rows plus one `p`-token prefill chunk, padded to the bucket: the
    kernel (the process's ISA) on the live token rows only (as served) against the kernel on
    every row."""
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
    ap.add_argument("--isa", default=",".join(
        a for a in cpu_kernels.ISAS if cpu_kernels.unavailable(a) is None),
        help=f"the kernel ISAs to time, of {', '.join(cpu_kernels.ISAS)} (default: those this "
             "CPU runs)")
    args = ap.parse_args()
    isas = [a for a in args.isa.split(",") if a]
    why = [f"{a}: {cpu_kernels.unavailable(a)}" for a in isas if cpu_kernels.unavailable(a)]
    if why or not isas:
        raise SystemExit(f"the CPU int8 kernel cannot run here: {'; '.join(why) or 'no ISA'}")
    projections([int(r) for r in args.rows.split(",")], args.iters, isas)
    whole_step([int(r) for r in args.step_rows.split(",")], max(5, args.iters // 10), isas)
    if args.mixed:
        mixed_steps([tuple(int(v) for v in m.split("+")) for m in args.mixed.split(",")],
                    max(3, args.iters // 20))


if __name__ == "__main__":
    main()
