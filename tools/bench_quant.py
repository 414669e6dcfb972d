"""Decode step time of SmolLM2-135M (the embedded GGUF's real weights) per weight encoding and KV
cache format, side by side in one run (cases interleaved round-robin), with the bytes of weights
a step reads and the roofline those bytes give at the copy and the read bandwidth measured in the
same run.

    .venv/bin/python tools/bench_quant.py [--encodings float32,int8,q4_1] [--kv float32,bfloat16]
        [--rows 1,8,32,64] [--context 256] [--iters 15] [--settle 1] [--one-digit]

`--one-digit` adds each quantized case with activations in one int8 digit, not two
(graphs/quant.py; a one-row step then is padded to two rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from maxjax.engine.types import SamplingParams
from maxjax.graphs import decoder, quant, sampling
from maxjax.graphs.program import sampled_step
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.engine.memory import weight_bytes   # SmolLM2 ties its embedding: read whole as the LM head
from maxjax.models.loader import load_model


def read_bandwidth() -> float:
    """Bytes/s of a sum over 512 MB: reads only, as a decode step's weights are (XLA splits it
    over the threads). On this 2-core VM it is about half the copy figure, which counts a
    pass's reads and writes both (BENCHMARKS.md, 2026-12-04: the batch-1 roofline)."""
    x = jnp.ones((128 << 20,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return x.nbytes / min(ts)


def copy_bandwidth() -> float:
    """Bytes/s of an in-place pass over 512 MB (read + write; donated, so nothing is allocated)."""
    x = jnp.ones((128 << 20,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    x = f(x).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        x = f(x).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / min(ts)


def read_bytes(params) -> int:
    """Weight bytes a decode step reads: all, less the embedding table when a packed LM head
    stands beside it (the table is then only gathered)."""
    if "lm_head" in params and params["lm_head"] is not params["embed"]:
        return weight_bytes({k: v for k, v in params.items() if k != "embed"})
    return weight_bytes(params)


def decode_case(model, params, r: int, context: int, page: int, kv_fmt, prefill: int = 0,
                backend=None):
    """(compiled sampled_step, KV pool, step inputs, sampling arrays) of a decode step of `r`
    rows with `context` tokens cached each, greedy, on `params` (`model`'s, or a variant); with
    `prefill`, one more row prefilling that many prompt tokens (a mixed step, as serving has).
    `backend`: the attention backend (None: this platform's)."""
    cfg = model.config
    per_row = -(-(context + 1) // page)
    rows = [RowSlice([5], context, list(range(1 + per_row * i, 1 + per_row * (i + 1))))
            for i in range(r)]
    pages = 1 + per_row * r
    if prefill:
        n = -(-prefill // page)
        rows.append(RowSlice([7] * prefill, 0, list(range(pages, pages + n))))
        pages += n
    pow2 = lambda n: 1 << (n - 1).bit_length()         # noqa: E731
    tokens, num_rows = pow2(r + prefill), pow2(len(rows))
    kv = decoder.init_kv(cfg, pages, page, kv_fmt)
    st = build_step_inputs(rows, tokens, num_rows, 4096 // page, page, backend=backend)
    sa = sampling.build_sampling_arrays([(SamplingParams(temperature=0), [], [], 0)] * num_rows,
                                        num_rows, 4096, vocab_size=cfg.vocab_size)
    fn = jax.jit(lambda p, kv, s, a: sampled_step(model.arch, cfg, 20, p, kv, s, a),
                 donate_argnums=(1,))
    return fn.lower(params, kv, st, sa).compile(), kv, st, sa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--encodings", default="float32,int8,q4_1")
    ap.add_argument("--kv", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--settle", type=int, default=1, metavar="N",
                    help="untimed calls of a case before each timed one: the first call after "
                    "another case's is slower (its allocations, the threads' state), by up to "
                    "1.9x after XLA's 1-second q4_1 step (BENCHMARKS.md, 2026-12-04)")
    ap.add_argument("--one-digit", action="store_true",
                    help="also time activations in one int8 digit (graphs/quant.py)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="one more row prefilling N prompt tokens in each step (a mixed step)")
    ap.add_argument("--kernel", action="store_true",
                    help="also each quantized encoding through --use-experimental-kernels' CPU "
                         "kernels (the linears' and attention's)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="also trace each case and print its TOP graph functions by op time")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    page = args.page_size
    models = {e: load_model(None, e, progress=False) for e in args.encodings.split(",")}
    kernel_attention = None
    if args.kernel:             # --use-experimental-kernels: packed weights, attention kernel
        from maxjax.graphs import cpu_kernels
        from maxjax.graphs.cpu_attention import CPU_PAGED_KERNEL as kernel_attention
        if cpu_kernels.unavailable():
            raise SystemExit(f"--kernel: {cpu_kernels.unavailable()}")
        for enc in [e for e in models if e != "float32"]:
            m = models[enc]
            models[f"{enc}+kernel"] = dataclasses.replace(
                m, params=cpu_kernels.pack_params(m.params))
    cases = []          # (label, compiled, params, kv holder, step, samp, bytes, tokens)
    for enc, model in models.items():
        for kv_fmt in args.kv.split(","):
            for r in rows_list:
                for digits in ([2, 1] if enc != "float32" and args.one_digit else [2]):
                    quant.DIGITS = digits
                    c, kv, st, sa = decode_case(model, model.params, r, args.context, page,
                                                kv_fmt, args.prefill,
                                                kernel_attention if "+kernel" in enc else None)
                    label = f"{enc} kv={kv_fmt} R={r}" + (" (1 digit)" if digits == 1 else "")
                    cases.append([label, c, model.params, kv, st, sa,
                                  read_bytes(model.params), r, []])
    quant.DIGITS = 2
    for _ in range(args.iters + 1):
        for case in cases:
            c, params, _, st, sa = case[1:6]       # the pool, case[3], changes each call
            for timed in [False] * args.settle + [True]:
                t = time.perf_counter()
                out, case[3] = c(params, case[3], st, sa)
                jax.device_get(out[0].token_ids)
                if timed:
                    case[8].append(time.perf_counter() - t)
    bw, rbw = copy_bandwidth(), read_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (reads + writes), read bandwidth "
          f"{rbw / 1e9:.1f} GB/s; context {args.context} tokens per row")
    print("| case | weights MB | step ms (median) | out tok/s | roofline ms (copy) | % of it | "
          "roofline ms (read) | % of it |")
    print("|---|---|---|---|---|---|---|---|")
    for label, _, _, _, _, _, nbytes, r, times in cases:
        ms = float(np.median(times[1:])) * 1e3
        roof, read_roof = nbytes / bw * 1e3, nbytes / rbw * 1e3
        print(f"| {label} | {nbytes / 1e6:.0f} | {ms:.1f} | {r / ms * 1e3:.0f} | {roof:.1f} | "
              f"{100 * roof / ms:.0f}% | {read_roof:.1f} | {100 * read_roof / ms:.0f}% |",
              flush=True)
    if args.profile:
        print_profiles(cases, args.profile)


def print_profiles(cases, top: int):
    """Per case, ms per step in each graph function (summed over device threads, under the
    tracer: shares, not times)."""
    from hlo_profile import profile_phases      # tools/, on sys.path as the script's directory

    for case in cases:
        def run(case=case):
            out, case[3] = case[1](*case[2:6])
            jax.device_get(out[0].token_ids)
        phases = profile_phases(case[1], run)
        total = sum(phases.values())
        print(f"\n{case[0]}: {total:.1f} ms of ops per step under the tracer")
        for label, ms in list(phases.items())[:top]:
            print(f"  {label:<40} {ms:7.2f} ms  {100 * ms / total:4.0f}%")


if __name__ == "__main__":
    main()
