"""Compile time and step time of the fused step+sampling graph for SmolLM2-135M shapes (random
f32 weights), per bucket, with the XLA flags in effect (set XLA_FLAGS / MAXJAX_XLA_DEFAULTS=0 to
compare; maxjax/xla_flags.py holds the defaults).

    .venv/bin/python tools/bench_step.py [--rows 1,8,32] [--context 256] [--prefill 128]
"""
from __future__ import annotations

import argparse
import os
import time

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs.config import ModelConfig
from maxjax.graphs import sampling
from maxjax.graphs.program import sampled_step
from maxjax.engine.types import SamplingParams
from maxjax.graphs import decoder
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.models.registry import get_architecture

ARCH = get_architecture("LlamaForCausalLM")

SMOLLM2 = ModelConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, rope_theta=100000.0,
                      tie_word_embeddings=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=256, help="tokens already cached per decode row")
    ap.add_argument("--prefill", type=int, default=128, help="also time one prefill of this many tokens")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    cfg, page = SMOLLM2, args.page_size
    key = jax.random.PRNGKey(0)
    params = jax.tree.map(lambda s: jax.random.normal(key, s.shape, s.dtype) * 0.02,
                          decoder.abstract_params(cfg, jnp.float32))
    per_row = -(-(args.context + 1) // page)
    max_pages = 4096 // page
    rows_list = [int(r) for r in args.rows.split(",")]
    kv = decoder.init_kv(cfg, 1 + per_row * max(rows_list), page, jnp.float32)
    fn = jax.jit(lambda p, kv, st, sa: sampled_step(ARCH, cfg, 20, p, kv, st, sa),
                 donate_argnums=(1,))
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}  backend={jax.default_backend()}")
    print("| step | tokens | compile s | step ms (median) | tok/s |")
    print("|---|---|---|---|---|")
    cases = [(f"decode R={r}", [RowSlice([5], args.context, list(range(1 + per_row * i, 1 + per_row * (i + 1))))
                                for i in range(r)]) for r in rows_list]
    if args.prefill:
        pp = -(-args.prefill // page)
        cases.append((f"prefill {args.prefill}", [RowSlice([5] * args.prefill, 0, list(range(1, 1 + pp)))]))
    for name, rows in cases:
        T = 1 << (sum(len(r.token_ids) for r in rows) - 1).bit_length()
        R = 1 << (len(rows) - 1).bit_length()
        st = build_step_inputs(rows, T, R, max_pages, page)
        sa = sampling.build_sampling_arrays([(SamplingParams(temperature=0), [], [], 0)] * len(rows), R, 4096,
                                            vocab_size=cfg.vocab_size)
        t = time.perf_counter()
        c = fn.lower(params, kv, st, sa).compile()
        compile_s = time.perf_counter() - t
        out, kv = c(params, kv, st, sa)
        jax.block_until_ready(out)
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            out, kv = c(params, kv, st, sa)
            jax.device_get(out[0].token_ids)
            times.append(time.perf_counter() - t)
        ms = float(np.median(times)) * 1e3
        ntok = sum(len(r.token_ids) for r in rows)
        print(f"| {name} | {ntok} | {compile_s:.1f} | {ms:.1f} | {ntok / ms * 1e3:.0f} |", flush=True)
    bench_sampling(max(rows_list), cfg.vocab_size, args.iters)


def bench_sampling(R: int, vocab: int, iters: int):
    """Greedy sampling of R rows alone, with and without logprobs (top 20), interleaved."""
    logits = jax.random.normal(jax.random.PRNGKey(1), (R, vocab), jnp.float32)
    fn = jax.jit(lambda l, a: sampling.sample_logits(l, a, 20))
    arrays = {lp: sampling.build_sampling_arrays(
        [(SamplingParams(temperature=0, logprobs=lp), [1], [], 0)] * R, R, 64,
        vocab_size=SMOLLM2.vocab_size) for lp in (False, True)}
    times = {False: [], True: []}
    for _ in range(iters + 1):
        for lp, a in arrays.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(logits, a))
            times[lp].append(time.perf_counter() - t)
    no, yes = (float(np.median(times[lp][1:])) * 1e3 for lp in (False, True))
    print(f"\ngreedy sampling of {R} rows: {no:.2f} ms; with logprobs + top 20: {yes:.2f} ms")


if __name__ == "__main__":
    main()
