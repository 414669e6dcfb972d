"""Tensor-parallel overhead on one CPU: the SmolLM2-135M step graph (random weights in
--encoding: float32, or quantized as a checkpoint is, maxjax/models/quantize.py; then its
sampler graph, as the engine compiles them: graphs/program.py step_graph_specs, sampler_specs)
at TP=1 and TP=N on N forced host devices, which add no cores, so what the figures show is the
cost of the sharding: the collectives GSPMD inserts and the smaller per-device matmuls. Runs
interleave the two engines in one process; a profile of the TP=N steps gives the time in
collectives.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python tools/bench_tp.py \
        [--tp 2] [--rows 1,8,32] [--prefill 128] [--rounds 3] [--encoding int8]
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
import time

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from maxjax.engine.buckets import Bucket
from maxjax.engine.types import SamplingParams
from maxjax.graphs import decoder, quant, sampling, sharding
from maxjax.graphs.program import jit_kwargs, sampled_steps, sampler_specs, step_graph_specs
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.models import quantize
from maxjax.models.registry import get_architecture

ARCH = get_architecture("LlamaForCausalLM")
SMOLLM2 = ARCH.config_from_hf({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True})
HISTORY = 4096
COLLECTIVES = re.compile(r"all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute")


def random_params(cfg, encoding: str):
    """Random weights (std 0.02) of `cfg`'s shapes, every matrix and the embedding table
    quantized to `encoding` as a checkpoint's are (4-bit: GGUF blocks from gguf's quantizer)."""
    key = jax.random.PRNGKey(0)
    params = jax.tree.map(lambda s: jax.random.normal(key, s.shape, s.dtype) * 0.02,
                          decoder.abstract_params(cfg, jnp.float32))
    if encoding == "float32":
        return params

    def matrix(w):           # [in, out] -> a checkpoint's [out, in] -> QuantizedWeight [in, out]
        w = np.asarray(w).T.copy()
        raw = None
        if quantize.is_4bit(encoding):
            from gguf import GGMLQuantizationType
            from gguf.quants import quantize as gguf_quantize
            qt = quantize.Q4_TYPES[encoding]
            blocks = gguf_quantize(w, GGMLQuantizationType[qt]).reshape(-1)
            raw = lambda _: quantize.decode_q4(qt, w.shape, blocks)
        return quantize.Quantizer(encoding, lambda _: w, raw).matrix(["w"])
    layers = [{k: matrix(v) if v.ndim == 2 else v for k, v in layer.items()}
              for layer in params["layers"]]
    table = quantize.Quantizer(encoding, lambda _: np.asarray(params["embed"])).table("embed")
    return {**params, "embed": table, "layers": layers}


def engine(cfg, tp: int, num_pages: int, page: int, buckets, max_pages: int, encoding: str):
    """(params, kv, {bucket: compiled}) on a TP mesh of `tp` devices (tp 1: one device)."""
    params = random_params(cfg, encoding)
    kv = decoder.init_kv(cfg, num_pages, page, jnp.float32)
    mesh = None
    if tp > 1:        # as maxjax/engine/devices.py place_model does
        mesh = sharding.tensor_parallel_mesh(tp)
        rules = sharding.tensor_parallel_rules(cfg, tp)
        specs = quant.param_specs(ARCH.param_specs(cfg), params)
        cfg, params = sharding.tensor_parallel_layout(cfg, params, tp)
        params = sharding.place(jax.tree.map(np.asarray, params), specs, mesh, rules)
        kv = sharding.place(kv, decoder.kv_pool_specs(cfg, num_pages, page), mesh, rules)
    specs = (step_graph_specs(ARCH, cfg, params, kv, buckets, max_pages, 20, mesh=mesh)
             + sampler_specs(cfg, buckets, HISTORY, 20, mesh=mesh))
    graphs = {s.name: jax.jit(s.fn, **jit_kwargs(s)).lower(*s.args).compile() for s in specs}
    compiled = sampled_steps(buckets, graphs)
    return [params, kv, compiled]


def model_config(args):
    """SmolLM2-135M, or its shape with other head counts (--heads, --kv-heads)."""
    import dataclasses
    heads = args.heads or SMOLLM2.num_heads
    return dataclasses.replace(SMOLLM2, num_heads=heads, num_kv_heads=args.kv_heads or
                               SMOLLM2.num_kv_heads)


def collective_ops(compiled) -> dict:
    """Collective HLO ops of a compiled step, by kind."""
    counts: dict = {}
    for m in re.finditer(r"= \S+ (all-reduce|all-gather|all-to-all|reduce-scatter|"
                         r"collective-permute)(-start)?\(", compiled.as_text()):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def time_step(eng, bucket, step, samp, iters: int) -> float:
    params, _, compiled = eng
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out, eng[1] = compiled[bucket](params, eng[1], step, samp)
        jax.device_get(out[0].token_ids)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def profile_collectives(eng, bucket, step, samp, iters: int) -> tuple[float, float]:
    """(ms per step in collective ops, ms per step in all ops) from a jax.profiler trace."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            time_step(eng, bucket, step, samp, iters)
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
        coll = total = 0.0
        for plane in data.planes:
            for line in plane.lines:
                for ev in line.events:
                    if not re.search(r"\.\d+$|^(fusion|dot|copy)", ev.name):
                        continue       # HLO op thunks only (names like all-reduce.3, fusion.12)
                    total += ev.duration_ns
                    if COLLECTIVES.search(ev.name):
                        coll += ev.duration_ns
    return coll / iters / 1e6, total / iters / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, help="attention heads (default: SmolLM2's 9)")
    ap.add_argument("--kv-heads", type=int, help="kv heads (default: SmolLM2's 3)")
    ap.add_argument("--encoding", default="float32",
                    choices=["float32", "int8", *(e for e in quantize.Q4_TYPES if e != "q4_k")],
                    help="weights (q4_k: gguf has no quantizer for it)")
    args = ap.parse_args()
    if jax.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} devices: XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={args.tp}")
    cfg, page = model_config(args), args.page_size
    per_row = -(-(args.context + 1) // page)
    rows_list = [int(r) for r in args.rows.split(",")]
    max_pages, num_pages = 4096 // page, 1 + per_row * max(rows_list)
    cases = [(f"decode R={r}", [RowSlice([5], args.context,
                                         list(range(1 + per_row * i, 1 + per_row * (i + 1))))
                                for i in range(r)]) for r in rows_list]
    if args.prefill:
        cases.append((f"prefill {args.prefill}",
                      [RowSlice([5] * args.prefill, 0, list(range(1, 1 + -(-args.prefill // page))))]))
    inputs = []
    for name, rows in cases:
        T = 1 << (sum(len(r.token_ids) for r in rows) - 1).bit_length()
        R = 1 << (len(rows) - 1).bit_length()
        b = Bucket(T, R)
        st = build_step_inputs(rows, T, R, max_pages, page)
        sa = sampling.build_sampling_arrays([(SamplingParams(temperature=0), [], [], 0)] * len(rows),
                                            R, HISTORY, vocab_size=cfg.vocab_size)
        inputs.append((name, b, st, sa, sum(len(r.token_ids) for r in rows)))
    buckets = sorted({b for _, b, *_ in inputs})
    t0 = time.perf_counter()
    engines = {1: engine(cfg, 1, num_pages, page, buckets, max_pages, args.encoding)}
    t1 = time.perf_counter()
    engines[args.tp] = engine(cfg, args.tp, num_pages, page, buckets, max_pages, args.encoding)
    print(f"{args.encoding} weights, {cfg.num_heads} heads, {cfg.num_kv_heads} kv heads; "
          f"rules at TP={args.tp}: "
          f"{ {k: v for k, v in sharding.tensor_parallel_rules(cfg, args.tp).items() if v} }")
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, weights + compile of {len(buckets)} "
          f"graphs: "
          f"TP=1 {t1 - t0:.1f} s, TP={args.tp} {time.perf_counter() - t1:.1f} s")
    times = {(n, tp): [] for n, *_ in inputs for tp in engines}
    for _ in range(args.rounds):
        for name, b, st, sa, _ in inputs:
            for tp, eng in engines.items():
                time_step(eng, b, st, sa, 2)     # warm
                times[(name, tp)].append(time_step(eng, b, st, sa, args.iters))
    print(f"| step | tokens | TP=1 ms | TP={args.tp} ms | ratio | collectives in the TP={args.tp} "
          f"step (HLO ops) | profiled ms in collectives / in all ops |")
    print("|---|---|---|---|---|---|---|")
    for name, b, st, sa, ntok in inputs:
        one, tp = (float(np.median(times[(name, k)])) for k in (1, args.tp))
        ops = collective_ops(engines[args.tp][2][b].step)
        coll, total = profile_collectives(engines[args.tp], b, st, sa, args.iters)
        print(f"| {name} | {ntok} | {one:.1f} | {tp:.1f} | {tp / one:.2f}x | "
              f"{', '.join(f'{v} {k}' for k, v in sorted(ops.items()))} | "
              f"{coll:.1f} / {total:.1f} |", flush=True)


if __name__ == "__main__":
    main()
