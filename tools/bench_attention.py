"""The SmolLM2 step (random f32 weights, greedy) on attention-heavy mixes, optionally against the
paged attention of another git revision, interleaved in one process: this machine's speed drifts
by up to ~25% over minutes, so separate runs cannot resolve a 10% change. A revision's attention
is graphs/attention.py `query_block_attention`, or, before that file existed, graphs/layers.py
`paged_attention` (which read the query blocks from the step itself).

    .venv/bin/python tools/bench_attention.py [--against REV] [--iters 10] [--kv-dtype bfloat16]
    .venv/bin/python tools/bench_attention.py --int8-steps 1,8,32 --kv-dtype float32,bfloat16

The CPU kernel of --use-experimental-kernels (graphs/cpu_attention.py) runs beside them where it
builds.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import types

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_step import ARCH, SMOLLM2  # noqa: E402

from maxjax.graphs import sampling  # noqa: E402
from maxjax.graphs.program import sampled_step  # noqa: E402
from maxjax.engine.types import SamplingParams  # noqa: E402
from maxjax.graphs import attention, cpu_attention, cpu_kernels, decoder  # noqa: E402
from maxjax.graphs.step import RowSlice, build_step_inputs  # noqa: E402

PAGE, POOL_PAGES, MAX_PAGES = 32, 400, 128


def decodes(n: int, ctx: int, first_page: int = 1) -> list[RowSlice]:
    per = -(-(ctx + 1) // PAGE)
    return [RowSlice([5], ctx, list(range(first_page + per * i, first_page + per * (i + 1))))
            for i in range(n)]


CASES = {   # name: (rows, bucket T, bucket R)
    "decode 32 rows, 256 context": (decodes(32, 256), 32, 32),
    "decode 31 x 100 + 1 x 2000 context": (decodes(31, 100) + decodes(1, 2000, 200), 32, 32),
    "prefill 128 in (128, 32)": ([RowSlice([5] * 128, 0, list(range(1, 5)))], 128, 32),
    "30 decodes + 2 x 113 prefill": (decodes(30, 200) + [
        RowSlice([5] * 113, 0, list(range(300, 304))), RowSlice([5] * 113, 0, list(range(310, 314)))],
        256, 32),
}


def _module_at(rev: str, path: str):
    src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if src.returncode:
        return None
    file = os.path.join(tempfile.mkdtemp(), "attention_at_rev.py")
    with open(file, "w") as f:
        f.write(src.stdout)
    spec = importlib.util.spec_from_file_location("attention_at_rev", file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def attention_at(rev: str):
    mod = _module_at(rev, "graphs/attention.py")
    if mod is not None:
        return mod.query_block_attention
    old = _module_at(rev, "graphs/layers.py").paged_attention

    def flat(q, k_pool, v_pool, layer, step, window, scale, softcap=None):
        fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        fields.update({f.name: getattr(step.attn, f.name) for f in dataclasses.fields(step.attn)})
        return old(q, k_pool, v_pool, layer, types.SimpleNamespace(**fields), window, scale, softcap)
    return flat


def int8_steps(rows_list, kv_formats, iters: int) -> None:
    """SmolLM2's int8 decode step (real weights packed for the int8 kernel, as with
    --use-experimental-kernels), 256 context, query blocks against the attention kernel."""
    from maxjax.models.loader import load_model
    model = load_model(None, "int8", progress=False)
    params = cpu_kernels.pack_params(model.params)
    backends = {"query_blocks": attention.QUERY_BLOCKS,
                "cpu kernel": cpu_attention.CPU_PAGED_KERNEL}
    print("| SmolLM2 int8 + int8 kernel decode step, 256 context | KV | query_blocks ms | "
          "cpu kernel ms | speed-up | greedy tokens equal |")
    print("|---|---|---:|---:|---:|---:|")
    for fmt in kv_formats:
        for r in rows_list:
            cases = {}
            for name, backend in backends.items():
                rows = decodes(r, 256)
                kv = decoder.init_kv(model.config, 1 + len(rows[0].pages) * r, PAGE, jnp.dtype(fmt))
                st = build_step_inputs(rows, r, r, MAX_PAGES, PAGE, backend=backend)
                sa = sampling.build_sampling_arrays(
                    [(SamplingParams(temperature=0.0), [1], [], 0)] * r, r, 64,
                    vocab_size=model.config.vocab_size)
                fn = jax.jit(lambda p, kv, st, sa: sampled_step(model.arch, model.config, 20, p,
                                                                kv, st, sa), donate_argnums=(1,))
                cases[name] = [fn.lower(params, kv, st, sa).compile(), kv, st, sa, None]
            times = {k: [] for k in cases}
            for _ in range(iters + 1):             # the first round is not counted
                for name, c in cases.items():
                    t = time.perf_counter()
                    out, c[1] = c[0](params, c[1], c[2], c[3])
                    c[4] = np.asarray(out[0].token_ids)
                    times[name].append(time.perf_counter() - t)
            qb, kern = (float(np.median(times[k][1:]) * 1e3) for k in backends)
            same = np.array_equal(cases["query_blocks"][4], cases["cpu kernel"][4])
            print(f"| {r} rows | {fmt} | {qb:.1f} | {kern:.1f} | {qb / kern:.2f}x | {same} |",
                  flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", help="git revision whose graphs/layers.py paged_attention to compare")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kv-dtype", default="float32", help="the pool's dtype (float32, bfloat16)")
    ap.add_argument("--int8-steps", metavar="ROWS",
                    help="instead: SmolLM2's int8 decode step at these rows (e.g. 1,8,32), "
                         "query blocks against the CPU kernel, for each --kv-dtype (comma list)")
    args = ap.parse_args()
    if args.int8_steps:
        if cpu_kernels.unavailable() is not None:
            raise SystemExit(f"no CPU kernel: {cpu_kernels.unavailable()}")
        return int8_steps([int(r) for r in args.int8_steps.split(",")],
                          args.kv_dtype.split(","), args.iters)
    # name: (backend, attend of the query-block backend while tracing it)
    impls = {"query_blocks": (attention.QUERY_BLOCKS, attention.query_block_attention)}
    if args.against:
        impls[args.against] = (attention.QUERY_BLOCKS, attention_at(args.against))
    if cpu_kernels.unavailable() is None:
        impls["cpu kernel"] = (cpu_attention.CPU_PAGED_KERNEL, None)
    else:
        print(f"no CPU kernel: {cpu_kernels.unavailable()}")
    cfg = SMOLLM2
    key = jax.random.PRNGKey(0)
    params = jax.tree.map(lambda s: jax.random.normal(key, s.shape, s.dtype) * 0.02,
                          decoder.abstract_params(cfg, jnp.float32))
    kv = decoder.init_kv(cfg, POOL_PAGES, PAGE, jnp.dtype(args.kv_dtype))
    inputs, exes = {}, {}
    for name, (backend, fn) in impls.items():
        if fn is not None:      # read when the step is traced
            attention.BACKENDS[backend.name] = dataclasses.replace(backend, attend=fn)
        step = jax.jit(lambda p, kv, st, sa: sampled_step(ARCH, cfg, 20, p, kv, st, sa),
                       donate_argnums=(1,))
        for case, (rows, T, R) in CASES.items():
            inputs[name, case] = (build_step_inputs(rows, T, R, MAX_PAGES, PAGE, backend=backend),
                                  sampling.build_sampling_arrays(
                                      [(SamplingParams(temperature=0.0), [1], [], 0)] * len(rows),
                                      R, 64, vocab_size=cfg.vocab_size))
            exes[name, case] = step.lower(params, kv, *inputs[name, case]).compile()
    attention.BACKENDS[attention.QUERY_BLOCKS.name] = attention.QUERY_BLOCKS
    times = {k: [] for k in exes}
    for _ in range(args.iters + 1):            # the first round is not counted
        for case in CASES:
            for name in impls:
                t = time.perf_counter()
                out, kv = exes[name, case](params, kv, *inputs[name, case])
                jax.block_until_ready(out)
                times[name, case].append(time.perf_counter() - t)
    names = list(impls)
    print("| case | " + " | ".join(f"{n} ms" for n in names) +
          "".join(f" | {n} speed-up" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for case in CASES:
        ms = [float(np.median(times[n, case][1:]) * 1e3) for n in names]
        print(f"| {case} | " + " | ".join(f"{m:.1f}" for m in ms) +
              "".join(f" | {ms[0] / m:.2f}x" for m in ms[1:]) + " |")


if __name__ == "__main__":
    main()
