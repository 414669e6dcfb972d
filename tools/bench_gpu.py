"""GPU checks that tools/gpu_check.sh runs, each printing a markdown table and writing JSON.

    .venv/bin/python tools/bench_gpu.py kernel     [--dry-run] [--json FILE]
    .venv/bin/python tools/bench_gpu.py throughput [--dry-run] [--json FILE] [--streams 32,128,256]
    .venv/bin/python tools/bench_gpu.py decode     [--dry-run] [--json FILE]

kernel: the Pallas paged-attention kernel (graphs/pallas_attention.py), compiled for this device,
against the query-block algorithm (graphs/attention.py, plain XLA: CI checks it and the kernel
against torch's SDPA) on random ragged batches of an 8B-shaped layer (32 heads / 8 KV heads,
head_dim 128, pages of 32), float32 and bfloat16, with and without a sliding window; max abs
error and time per call of each. On a CPU (--dry-run) the kernel runs in interpret mode on tiny
shapes.

throughput: an 8B-shaped Llama (Llama-3-8B's config) with random bfloat16 weights made on the
device: batch-1 decode tok/s and the fraction of HBM bandwidth it reaches (weights plus the K/V
read per token, at the device's nominal bandwidth), then output tok/s at N streams of 128 in /
128 out (greedy, ignore_eos). --dry-run: a small 2-layer model on the CPU, the bandwidth
measured by a copy (tools/bench_offline.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tools")]

# Nominal HBM bandwidth by device kind (bytes/s): vendor data sheets.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}


def nominal_bandwidth(device) -> tuple[float, str]:
    if device.platform == "cpu":
        from bench_offline import copy_bandwidth
        return copy_bandwidth(), "measured copy bandwidth"
    for name, bw in HBM_BANDWIDTH.items():
        if name in device.device_kind:
            return bw, f"{name} nominal HBM bandwidth"
    return float("nan"), "unknown device"


def timed(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


# ---- kernel --------------------------------------------------------------------------------------
def bench_kernel(dry_run: bool) -> list[dict]:
    from test_pallas_attention import ragged_batch
    from maxjax.graphs.attention import query_block_attention
    from maxjax.graphs.pallas_attention import PAGED_KERNEL, paged_attention
    from maxjax.graphs.step import build_step_inputs
    H, KV, hd, page, T, R, max_pages = (4, 2, 16, 16, 32, 4, 4) if dry_run else \
        (32, 8, 128, 32, 512, 64, 32)
    rows_out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for window in (0, 20 if dry_run else 100):
            rng = np.random.default_rng(window)
            rows, num_pages = ragged_batch(rng, page, T, R, max_pages)
            shape = (2, num_pages, KV, page, hd)
            k = jnp.asarray(rng.standard_normal(shape), dtype)
            v = jnp.asarray(rng.standard_normal(shape), dtype)
            q = jnp.asarray(rng.standard_normal((T, H, hd)), dtype)
            step = jax.tree.map(jnp.asarray, build_step_inputs(rows, T, R, max_pages, page,
                                                               backend=PAGED_KERNEL))
            n = sum(len(r.token_ids) for r in rows)
            kernel = jax.jit(lambda q, k, v, st: paged_attention(
                q, k, v, 1, st.page_table, st.attn, window, hd ** -0.5, interpret=dry_run))
            xla = jax.jit(lambda q, k, v, st: query_block_attention(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), 1, st,
                window, hd ** -0.5))
            got = kernel(q, k, v, step)
            with jax.default_matmul_precision("highest"):    # GPU's default for float32 is TF32
                want = xla(q, k, v, step)
            err = float(jnp.abs(got[:n].astype(jnp.float32) - want[:n]).max())
            tol = 2e-5 if dtype == jnp.float32 else 3e-2
            rows_out.append({"dtype": jnp.dtype(dtype).name, "window": window, "tokens": n,
                             "rows": len(rows), "max_abs_err": err, "tolerance": tol,
                             "ok": err <= tol, "kernel_ms": 1e3 * timed(kernel, q, k, v, step),
                             "xla_ms": 1e3 * timed(xla, q, k, v, step)})
    print(f"\nkernel vs query-block attention on {jax.devices()[0].device_kind} "
          f"({'interpret mode, ' if dry_run else ''}{H} heads / {KV} KV heads, head_dim {hd}, "
          f"pages of {page}, T={T}, R={R})\n")
    print("| dtype | window | tokens | max abs err | tolerance | ok | kernel ms | XLA ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['dtype']} | {r['window']} | {r['tokens']} | {r['max_abs_err']:.2e} | "
              f"{r['tolerance']:.0e} | {r['ok']} | {r['kernel_ms']:.3f} | {r['xla_ms']:.3f} |")
    return rows_out


# ---- throughput ----------------------------------------------------------------------------------
def llama_8b(dry_run: bool):
    """Llama-3-8B's config; --dry-run: a 2-layer model 1/8 as wide (a CPU's size)."""
    from maxjax.graphs.config import ModelConfig
    if dry_run:
        return ModelConfig("LlamaForCausalLM", vocab_size=16032, hidden_size=512,
                           intermediate_size=1792, num_layers=2, num_heads=8, num_kv_heads=2,
                           head_dim=64, eos_token_ids=(1,))
    return ModelConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                       eos_token_ids=(128001,))


def random_model(cfg, dtype):
    """A LoadedModel with random weights made on the device (no host copy of 16 GB)."""
    from maxjax.graphs.decoder import abstract_params
    from maxjax.models.loader import LoadedModel
    from maxjax.models.registry import get_architecture
    specs = abstract_params(cfg, dtype)
    leaves, tree = jax.tree.flatten(specs)
    makers = {}
    out = []
    for i, s in enumerate(leaves):
        if (s.shape, s.dtype) not in makers:
            makers[s.shape, s.dtype] = jax.jit(
                lambda key, s=s: (0.02 * jax.random.normal(key, s.shape, jnp.float32)).astype(s.dtype))
        out.append(makers[s.shape, s.dtype](jax.random.PRNGKey(i)))
    params = tree.unflatten(out)
    return LoadedModel(get_architecture(cfg.architecture), cfg, params, None, None,
                       "random", jnp.dtype(dtype).name, "llama-8b-shaped-random")


PHASES = ("schedule", "build_inputs", "device_step", "update", "detokenize")


def step_alone_ms(runner, context: int, iters: int = 20) -> dict:
    """The one-row decode step executable alone (a row `context` tokens deep, its K/V in the
    scratch page), median ms: synced after each call, and per call with `iters` queued."""
    from maxjax.engine.buckets import pick_bucket
    from maxjax.engine.types import SamplingParams
    from maxjax.graphs import sampling
    from maxjax.graphs.step import SCRATCH_PAGE, RowSlice, build_step_inputs
    r = runner
    bucket = pick_bucket(r.buckets, 1, 1, 1)
    pages = [SCRATCH_PAGE] * -(-(context + 1) // r.page_size)
    step = build_step_inputs([RowSlice([0], context, pages)], bucket.num_tokens, bucket.num_rows,
                             r.max_pages, r.page_size, bucket.num_samples, r.attention)
    samp = sampling.build_sampling_arrays([(SamplingParams(temperature=0.0), [0], [], 0)],
                                          bucket.num_samples, r.history_len, r.eos,
                                          r.cfg.vocab_size)
    step, samp = jax.device_put((step, samp))
    synced = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(r._step(bucket, step, samp))
        synced.append(1e3 * (time.perf_counter() - t))
    t = time.perf_counter()
    jax.block_until_ready([r._step(bucket, step, samp) for _ in range(iters)])
    return {"synced": float(np.median(synced)), "queued": iters,
            "pipelined": 1e3 * (time.perf_counter() - t) / iters}


def decode_breakdown(core, prompt, params, context: int) -> tuple[float, dict, dict]:
    """Batch-1 decode tok/s (bench_offline.decode_probe), the engine's ms per step by phase over
    it, and the step executable alone (step_alone_ms) at `context` tokens."""
    from bench_offline import decode_probe
    before = dict(core.profile)
    tps = decode_probe(core, prompt, params)
    steps = core.profile["steps"] - before["steps"]
    phases = {k: 1e3 * (core.profile[k] - before[k]) / steps for k in PHASES}
    return tps, phases, step_alone_ms(core.runner, context)


def gemv_floor_ms(params, dtype, iters: int = 20) -> float:
    """What plain XLA takes to read every weight matrix once in one graph (a one-row product
    with each 2-D leaf; the embedding table as the LM head), median ms: the step's floor."""
    mats = [a for a in jax.tree.leaves(params) if a.ndim == 2]

    @jax.jit
    def gemvs(mats):
        acc = jnp.zeros((), jnp.float32)
        for w in mats:
            x = jnp.ones((1, w.shape[0]), dtype)
            acc += jnp.sum(jnp.dot(x, w, preferred_element_type=jnp.float32))
        return acc
    jax.block_until_ready(gemvs(mats))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(gemvs(mats))
        times.append(1e3 * (time.perf_counter() - t))
    return float(np.median(times))


def bench_decode(dry_run: bool, input_len: int = 128, output_len: int = 128) -> dict:
    """Batch-1 decode of the 8B-shaped model, where its time goes: the engine's phases per
    step, the step executable alone, and the floor of reading the weights (gemv_floor_ms). One
    row, a 16-token budget: five graphs, quick to compile (for A/Bs of XLA_FLAGS)."""
    import maxjax
    from maxjax.engine.memory import weight_bytes
    cfg = llama_8b(dry_run)
    dev = jax.devices()[0]
    model = random_model(cfg, jnp.bfloat16)
    t0 = time.perf_counter()
    llm = maxjax.LLM(model, max_batch_size=1, max_batch_input_tokens=16,
                     max_length=input_len + output_len + 32, enable_structured_output=False)
    warm = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompt = list(map(int, rng.integers(100, cfg.vocab_size - 100, input_len)))
    params = maxjax.SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    core = llm.core
    llm.generate([prompt], maxjax.SamplingParams(max_new_tokens=8))
    tps, phases, alone = decode_breakdown(core, prompt, params, input_len + output_len // 2)
    floor = gemv_floor_ms(model.params, jnp.bfloat16)
    wbytes = weight_bytes(model.params)
    bw, bw_kind = nominal_bandwidth(dev)
    frac = lambda ms: wbytes / (ms / 1e3) / bw      # noqa: E731
    out = {"device": dev.device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "warmup_s": warm, "decode_tok_s": tps, "phases_ms": phases, "step_alone_ms": alone,
           "gemv_floor_ms": floor, "weight_bytes": wbytes, "bandwidth": bw}
    print(f"\nbatch-1 decode, {cfg.num_layers} layers, {wbytes / 1e9:.2f} GB bf16 on "
          f"{dev.device_kind}, XLA_FLAGS={out['xla_flags']!r}, warm-up {warm:.0f} s\n")
    print(f"| measure | ms | of {bw_kind} |")
    print("|---|---|---|")
    print(f"| engine step (decode {tps:.1f} tok/s) | {1e3 / tps:.2f} | "
          f"{100 * frac(1e3 / tps):.0f}% |")
    for k, v in phases.items():
        print(f"| engine phase: {k} | {v:.2f} | |")
    print(f"| step executable alone, synced | {alone['synced']:.2f} | "
          f"{100 * frac(alone['synced']):.0f}% |")
    print(f"| step executable alone, {alone['queued']} queued | {alone['pipelined']:.2f} | "
          f"{100 * frac(alone['pipelined']):.0f}% |")
    print(f"| one-row product with every weight matrix (XLA) | {floor:.2f} | "
          f"{100 * frac(floor):.0f}% |")
    return out


def bench_throughput(dry_run: bool, streams: list[int], input_len: int = 128,
                     output_len: int = 128) -> dict:
    import maxjax
    from maxjax.engine.memory import weight_bytes
    cfg = llama_8b(dry_run)
    dev = jax.devices()[0]
    t0 = time.perf_counter()
    model = random_model(cfg, jnp.bfloat16)
    engine = dict(max_batch_size=max(streams), max_length=input_len + output_len + 32,
                  max_batch_input_tokens=32 if dry_run else 2048,
                  enable_structured_output=False)
    shape = "a small 2-layer Llama" if dry_run else "Llama-3-8B-shaped model"
    print(f"\n{shape}, random bf16 weights on {dev.device_kind}; engine {engine}", flush=True)
    llm = maxjax.LLM(model, **engine)
    warm = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompt = lambda: list(map(int, rng.integers(100, cfg.vocab_size - 100, input_len)))   # noqa: E731
    params = maxjax.SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompt()], maxjax.SamplingParams(max_new_tokens=4))
    core = llm.core
    wbytes = weight_bytes(model.params)
    # rows as they are measured: a stage stopped at its time limit keeps what it had
    print(f"weights {wbytes / 1e9:.2f} GB, warm-up {warm:.0f} s\n", flush=True)
    print("| measure | value |")
    print("|---|---|", flush=True)
    decode_tps, phases, alone = decode_breakdown(core, prompt(), params,
                                                 input_len + output_len // 2)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    step_bytes = wbytes + kv_per_token * (input_len + output_len // 2)
    bw, bw_kind = nominal_bandwidth(dev)
    out = {"device": dev.device_kind, "layers": cfg.num_layers, "weight_bytes": wbytes,
           "warmup_s": warm, "decode_tok_s": decode_tps, "bandwidth": bw, "bandwidth_kind": bw_kind,
           "hbm_fraction": step_bytes * decode_tps / bw, "streams": {},
           "step_compiles": core.step_compiles, "engine": engine, "decode_phases_ms": phases,
           "decode_step_alone_ms": alone}
    print(f"| batch-1 decode tok/s | {decode_tps:.1f} |")
    print(f"| of {bw_kind} ({bw / 1e9:.0f} GB/s) | {100 * out['hbm_fraction']:.0f}% |")
    print("| batch-1 engine ms per step | "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + " |")
    print(f"| batch-1 step executable alone, ms (synced each / {alone['queued']} queued) | "
          f"{alone['synced']:.2f} / {alone['pipelined']:.2f} |", flush=True)
    for n in streams:
        prompts = [prompt() for _ in range(n)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        tps = out["streams"][n] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
        print(f"| output tok/s, {n} streams of {input_len} in / {output_len} out | {tps:.0f} |",
              flush=True)
    out["step_compiles"] = core.step_compiles
    print(f"| compiles after warm-up | {core.step_compiles} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["kernel", "throughput", "decode"])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes for a CPU")
    ap.add_argument("--streams", default=None, help="default 32,128,256 (dry run: 2,4)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.what == "kernel":
        res = bench_kernel(args.dry_run)
        ok = all(r["ok"] for r in res)
    elif args.what == "decode":
        res = bench_decode(args.dry_run)
        ok = True
    else:
        import logging     # the engine's compile progress, in the stage's log
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        streams = [int(s) for s in (args.streams or ("2,4" if args.dry_run else "32,128,256"))
                   .split(",")]
        res = bench_throughput(args.dry_run, streams)
        ok = res["step_compiles"] == 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
