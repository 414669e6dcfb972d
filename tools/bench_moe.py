"""Step time of a small mixture-of-experts model against dense models of the same active and
of the same total MLP parameters, in one run (report only; graphs/moe.py).

  .venv/bin/python tools/bench_moe.py [--tokens 8 64 256] [--iters 20]

Models (float32, random weights, 4 layers, hidden 512, 8 heads): MoE with 8 experts of 512,
top 2 (the routed blocks, and the same routing through jax.lax.ragged_dot); dense with an MLP
of 1024 (= the MoE's active share) and of 4096 (= every expert). Each step: T token slots of
distinct sequences at position 64 (decode rows) through the paged forward.
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import decoder, moe
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.step import RowSlice, build_step_inputs

BASE = dict(architecture="bench", vocab_size=4096, hidden_size=512, num_layers=4, num_heads=8,
            num_kv_heads=8, head_dim=64)


def configs():
    routed = dict(moe_layers=(True,) * 4, num_experts=8, experts_per_token=2,
                  expert_intermediate_size=512, norm_topk_prob=True)
    return {"moe 8x512 top2": ModelConfig(**BASE, intermediate_size=1024, **routed),
            "dense 1024 (active)": ModelConfig(**BASE, intermediate_size=1024),
            "dense 4096 (total)": ModelConfig(**BASE, intermediate_size=4096)}


def random_params(cfg, seed=0):
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 1000))
    return jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype),
                        decoder.abstract_params(cfg, jnp.float32))


def time_step(cfg, params, T, iters, forward=decoder.forward):
    page = 16
    rows = [RowSlice([7], 64, [1 + 5 * r + i for i in range(5)]) for r in range(T)]
    step = build_step_inputs(rows, T, T, 5, page)
    kv = decoder.init_kv(cfg, 5 * T + 1, page, jnp.float32)
    fn = jax.jit(partial(forward, cfg), donate_argnums=(1,))
    logits, kv = fn(params, kv, step)
    logits.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(iters):
        logits, kv = fn(params, kv, step)
    logits.block_until_ready()
    return (time.perf_counter() - t0) / iters * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    cfgs = configs()
    params = {name: random_params(cfg) for name, cfg in cfgs.items()}
    moe_name = next(iter(cfgs))

    def ragged_forward(cfg, p, kv, step):
        orig = moe.grouped_blocks
        moe.grouped_blocks = moe.grouped_ragged
        try:
            return decoder.forward(cfg, p, kv, step)
        finally:
            moe.grouped_blocks = orig
    print(f"{'model':<28}" + "".join(f"{f'T={t} ms':>12}" for t in args.tokens))
    rows = [(name, cfgs[name], params[name], decoder.forward) for name in cfgs]
    rows.insert(1, ("moe via ragged_dot", cfgs[moe_name], params[moe_name], ragged_forward))
    for name, cfg, p, fwd in rows:
        times = [time_step(cfg, p, T, args.iters, fwd) for T in args.tokens]
        print(f"{name:<28}" + "".join(f"{t:>12.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
