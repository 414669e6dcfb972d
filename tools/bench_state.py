"""What a request keeps, and what it costs a step: hybrid and MLA models against all-attention
and GQA ones, in one run (issue 58's benchmark; report only).

  .venv/bin/python tools/bench_state.py [--pool-gib 16] [--context 4096] [--rows 4]
                                        [--prompt 2048] [--iters 5]

(a) Bytes a token and the most concurrent `--context`-token requests a bf16 pool of
`--pool-gib` holds, from graphs/state.py's declarations through the memory plan's functions
(maxjax/engine/memory.py page_bytes, maxjax/engine/state_plan.py plan_state_pools; pages of 16
tokens, page 0 and state slot 0 scratch): Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig
defaults, its 80B values) against the same config with every layer full attention; DeepSeek-V3
(DeepseekV3Config's defaults) with its MLA latent against its expanded K/V and against GQA of 8
KV heads x 128.
(b) On random Qwen3.5-dense-shaped models (hidden 512, 8 layers; the hybrid 3:1 Gated DeltaNet
to gated attention, the other all attention), float32: the decode step of `--rows` rows at
`--context` tokens, and the prefill of one `--prompt`-token prompt, the hybrid's recurrence
token by token (recurrent.scan_rows) against the chunked form (recurrent.scan_chunks). Medians
of `--iters` steps after a warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.engine.memory import page_bytes
from maxjax.engine.state_plan import plan_state_pools
from maxjax.graphs import recurrent, sharding
from maxjax.graphs.decoder import init_kv
from maxjax.graphs.state import RECURRENT, comparison, paged_layers
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.models import registry

PAGE = 16
BF16 = 2


def model_config(hf: dict, arch: str):
    return registry.get_architecture(arch).config_from_hf({**hf, "architectures": [arch]})


def requests_held(mc, pool_bytes: int, context: int) -> tuple[int, int, int]:
    """(paged bytes a token, state bytes a request, requests of `context` tokens the pool
    holds), bf16 with pages of PAGE."""
    per_page = page_bytes(mc, PAGE, BF16)
    state = plan_state_pools(SimpleNamespace(state_pool_dtype="bfloat16", max_batch_size=0,
                                             enable_prefix_caching=False), mc,
                             "bfloat16").bytes_per_request
    per_request = -(-context // PAGE) * per_page + state
    return per_page // PAGE, state, (pool_bytes - per_page - state) // per_request


def memory_table(pool_gib: float, context: int) -> None:
    from transformers import DeepseekV3Config, Qwen3NextConfig
    pool = int(pool_gib * (1 << 30))
    nxt = Qwen3NextConfig().to_dict()
    hybrid = model_config(nxt, "Qwen3NextForCausalLM")
    full = model_config({**nxt, "layer_types": ["full_attention"] * nxt["num_hidden_layers"]},
                        "Qwen3NextForCausalLM")
    mla = model_config(DeepseekV3Config().to_dict(), "DeepseekV3ForCausalLM")
    expanded = comparison(mla, context)["kv_values_per_token_layer"] * len(paged_layers(mla)) \
        * BF16
    gqa = requests_held_gqa(mla, pool, context)
    print(f"(a) bf16 pool of {pool_gib:g} GiB, requests of {context} tokens, pages of {PAGE}")
    print(f"{'model':58s} {'B/token':>9s} {'state B/req':>12s} {'B/token@ctx':>12s} "
          f"{'requests':>9s}")
    rows = [("Qwen3-Next-80B-A3B hybrid (36 DeltaNet + 12 attention)", hybrid),
            ("  same, all 48 layers full attention", full),
            ("DeepSeek-V3 MLA latent (512 + 64 a layer, 61 layers)", mla)]
    for name, mc in rows:
        tok, state, n = requests_held(mc, pool, context)
        print(f"{name:58s} {tok:9,d} {state:12,d} {tok + state / context:12,.0f} {n:9,d}")
    n_exp = (pool - expanded * PAGE) // (-(-context // PAGE) * PAGE * expanded)
    print(f"{'  same, expanded K/V (128 heads x (192 + 128) a layer)':58s} {expanded:9,d} "
          f"{0:12,d} {expanded:12,d} {n_exp:9,d}")
    print(f"{'  same, GQA 8 KV heads x 128':58s} {gqa[0]:9,d} {0:12,d} {gqa[0]:12,d} "
          f"{gqa[2]:9,d}")


def requests_held_gqa(mla, pool: int, context: int):
    import dataclasses
    return requests_held(dataclasses.replace(mla, paged_state="kv", num_kv_heads=8,
                                             head_dim=128), pool, context)


def small_config(hybrid: bool):
    from transformers import Qwen3_5TextConfig
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    hf = Qwen3_5TextConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, max_position_embeddings=16384, eos_token_id=None,
        layer_types=kinds * 2 if hybrid else ["full_attention"] * 8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25}).to_dict()
    return registry.get_architecture("Qwen3_5ForCausalLM"), model_config(hf,
                                                                          "Qwen3_5ForCausalLM")


def random_params(arch, cfg, seed=0):
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 1000))
    abstract = sharding.abstract(arch.param_specs(cfg), jnp.float32)
    return jax.tree.map(lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype),
                        abstract)


def median_step(fn, params, kv, step, iters: int) -> float:
    logits, kv = fn(params, kv, step)                       # compile and warm up
    jax.block_until_ready(logits)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        logits, kv = fn(params, kv, step)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def decode_ms(arch, cfg, rows: int, context: int, iters: int) -> float:
    pages = -(-(context + 1) // PAGE)
    hybrid = any(cfg.state_layers)
    kv = init_kv(cfg, rows * pages + 1, PAGE, jnp.float32, state_slots=rows + 1 if hybrid else 0)
    if not hybrid:              # the family's forward takes its (here empty) state pools
        kv += tuple(jnp.zeros((0, 1) + shape, jnp.float32) for shape in RECURRENT.arrays(cfg))
    slices = [RowSlice([7], context, list(range(1 + r * pages, 1 + (r + 1) * pages)),
                       state_slot=r + 1 if hybrid else 0) for r in range(rows)]
    step = build_step_inputs(slices, rows, rows, pages, PAGE, state=hybrid)
    fn = jax.jit(partial(arch.forward, cfg), donate_argnums=(1,))
    return median_step(fn, random_params(arch, cfg), kv, step, iters)


def prefill_ms(arch, cfg, prompt: int, iters: int, chunks: bool) -> float:
    pages = -(-prompt // PAGE)
    kv = init_kv(cfg, pages + 1, PAGE, jnp.float32, state_slots=2)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, prompt).tolist()
    step = build_step_inputs([RowSlice(ids, 0, list(range(1, pages + 1)), state_slot=1)],
                             prompt, 1, pages, PAGE, state=True)
    chosen = recurrent.chunked
    recurrent.chunked = lambda step, size: chunks and chosen(step, size)
    try:
        fn = jax.jit(partial(arch.forward, cfg), donate_argnums=(1,))
        return median_step(fn, random_params(arch, cfg), kv, step, iters)
    finally:
        recurrent.chunked = chosen


def recurrence_ms(prompt: int, iters: int) -> dict:
    """The recurrence alone over one `prompt`-token row (the small models' 8 heads of 64 x 64
    state): Gated DeltaNet's and Mamba2's, token scan against chunks."""
    from maxjax.graphs.gated_deltanet import chunk_delta, delta_step
    from maxjax.graphs.granitemoehybrid import chunk_ssd, ssd_step
    H, D = 8, 64
    pages = -(-prompt // PAGE)
    step = build_step_inputs([RowSlice([1] * prompt, 0, list(range(1, pages + 1)),
                                       state_slot=1)], prompt, 1, pages, PAGE, state=True)
    step = jax.tree.map(jnp.asarray, step)
    rng = np.random.default_rng(0)
    arr = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
    q, k, v, x, b, c = (arr(prompt, H, D, scale=D ** -0.5) for _ in range(6))
    g = -jnp.abs(arr(prompt, H))
    beta = jax.nn.sigmoid(arr(prompt, H))
    pool = jnp.zeros((2, H, D, D), jnp.float32)
    runs = {"Gated DeltaNet token scan": lambda q, k, v, x, b, c, g, beta, pool, step:
            recurrent.scan_rows(delta_step, (q, k, v, jnp.exp(g), beta), pool, step),
            "Gated DeltaNet chunks of 64": lambda q, k, v, x, b, c, g, beta, pool, step:
            chunk_delta(q, k, v, g, beta, pool, step),
            "Mamba2 token scan": lambda q, k, v, x, b, c, g, beta, pool, step:
            recurrent.scan_rows(ssd_step, (x, b, c, jnp.exp(g), -g), pool, step),
            "Mamba2 chunks of 64": lambda q, k, v, x, b, c, g, beta, pool, step:
            chunk_ssd(x, b, c, g, -g, pool, step)}
    args = (q, k, v, x, b, c, g, beta, pool, step)
    out = {}
    for name, run in runs.items():
        fn = jax.jit(run)
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-gib", type=float, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    memory_table(a.pool_gib, a.context)
    print(f"\n(b) {jax.devices()[0].platform}, float32, hidden 512, 8 layers; median of "
          f"{a.iters} after a warm-up")
    arch, hyb = small_config(True)
    _, full = small_config(False)
    d_h = decode_ms(arch, hyb, a.rows, a.context, a.iters)
    d_f = decode_ms(arch, full, a.rows, a.context, a.iters)
    print(f"decode step, {a.rows} rows at {a.context} tokens: hybrid 6 DeltaNet + 2 attention "
          f"{d_h:.2f} ms, all 8 attention {d_f:.2f} ms ({d_f / d_h:.2f}x)")
    p_s = prefill_ms(arch, hyb, a.prompt, a.iters, chunks=False)
    p_c = prefill_ms(arch, hyb, a.prompt, a.iters, chunks=True)
    print(f"prefill of {a.prompt} tokens, hybrid: token scan {p_s:.1f} ms, chunked "
          f"{p_c:.1f} ms ({p_s / p_c:.2f}x)")
    rec = recurrence_ms(a.prompt, a.iters)
    print(f"the recurrence alone, {a.prompt} tokens, 8 heads of 64 x 64: " + ", ".join(
        f"{name} {ms:.1f} ms" for name, ms in rec.items()))


if __name__ == "__main__":
    main()
