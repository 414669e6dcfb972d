"""Multi-LoRA cost, in one process (maxjax.LLM on the embedded SmolLM2, one loaded model, two
engines): output tok/s of N streams on an engine without LoRA (A), the same load spread over 4
adapters on a LoRA engine (B), and the same base-model load on the LoRA engine (C: the slots'
matmuls run for every token). Runs interleaved A B C ... A, same prompts and lengths.
Adapters: random PEFT-format files (rank --rank on all 7 projections), written here.

Then the decode step executable alone, A B C interleaved (--step-rounds rounds of 5), for the
same 32 rows: the device cost without the scheduling, less exposed to a busy machine.

    .venv/bin/python tools/bench_lora.py [--streams 32] [--tokens 64] [--reps 3] [--rank 16]
        [--step-rounds 10]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

import jax
import numpy as np
from safetensors.numpy import save_file

from maxjax.engine.buckets import pick_bucket
from maxjax.engine.types import SamplingParams
from maxjax.graphs import sampling
from maxjax.graphs.step import SCRATCH_PAGE, RowSlice, build_step_inputs
from maxjax.graphs.lora import module_shapes
from maxjax.llm import LLM
from maxjax.models.loader import load_model


def write_adapter(path: str, cfg, rank: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for m, (d_in, d_out) in module_shapes(cfg).items():
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[key + ".lora_A.weight"] = (rng.standard_normal((rank, d_in)) * 0.02).astype(np.float32)
            tensors[key + ".lora_B.weight"] = (rng.standard_normal((d_out, rank)) * 0.02).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(module_shapes(cfg))}, f)
    return path


PHASES = ("schedule", "build_inputs", "device_step", "update", "detokenize")


def run(llm, prompts, params, lora, profile: dict | None = None) -> float:
    """Output tok/s; `profile` sums the engine's seconds per phase and its steps."""
    before = dict(llm.core.profile)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora=lora)
    took = time.perf_counter() - t0
    if profile is not None:
        for k in (*PHASES, "steps"):
            profile[k] = profile.get(k, 0) + llm.core.profile[k] - before[k]
    return sum(len(o.token_ids) for o in outs) / took


def decode_step_ms(llm, slots: list[int], context: int, iters: int) -> list[float]:
    """Milliseconds of the decode step executable alone (one token for each of len(slots) rows,
    each `context` tokens deep, row i in adapter slot slots[i]), `iters` times."""
    r = llm.core.runner
    bucket = pick_bucket(r.buckets, len(slots), len(slots), len(slots))
    pages = [SCRATCH_PAGE] * -(-(context + 1) // r.page_size)
    rows = [RowSlice([0], context, pages, lora_slot=s) for s in slots]
    step = build_step_inputs(rows, bucket.num_tokens, bucket.num_rows, r.max_pages, r.page_size,
                             bucket.num_samples, r.attention, r.lora is not None)
    samp = sampling.build_sampling_arrays([(SamplingParams(temperature=0.8), [0], [], 0)]
                                          * len(slots), bucket.num_samples, r.history_len, r.eos,
                                          r.cfg.vocab_size)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out, r.kv = r.executables[bucket](r.params, r.kv, step, samp)
        jax.block_until_ready(out)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--step-rounds", type=int, default=10)
    args = ap.parse_args()
    n, k = args.streams, args.tokens
    model = load_model(None, "float32", progress=False)
    opts = dict(max_batch_size=n, max_batch_input_tokens=max(128, n), max_length=512,
                kv_cache_page_size=32, num_kv_pages=8 * n + 1)
    base = LLM(model, **opts)
    tmp = tempfile.mkdtemp(prefix="maxjax-bench-lora-")
    names = [f"ad{i}" for i in range(4)]
    lora = LLM(model, enable_lora=True, max_num_loras=4, max_lora_rank=args.rank,
               lora_paths=[f"{nm}={write_adapter(os.path.join(tmp, nm), model.config, args.rank, i)}"
                           for i, nm in enumerate(names)], **opts)
    prompts = [base.apply_chat_template([{"role": "user", "content": f"Tell a story ({i})."}])
               for i in range(n)]
    params = SamplingParams(max_new_tokens=k, temperature=0.8, seed=1, ignore_eos=True)
    spread = [names[i % 4] for i in range(n)]
    cases = {"A": (base, None), "B": (lora, spread), "C": (lora, None)}
    for llm, lr in cases.values():                   # warm: first runs, prefix cache
        run(llm, prompts, params, lr)
    got = {c: [] for c in cases}
    prof: dict = {c: {} for c in cases}
    for _ in range(args.reps):
        for c, (llm, lr) in cases.items():
            got[c].append(run(llm, prompts, params, lr, prof[c]))
    got["A"].append(run(base, prompts, params, None, prof["A"]))
    mean = {c: float(np.mean(v)) for c, v in got.items()}
    runs = {c: ", ".join(f"{x:.1f}" for x in v) for c, v in got.items()}
    print(f"{n} streams x {k} tokens, rank {args.rank}, 4 device slots:")
    print(f"  A no-LoRA engine, base model:      {mean['A']:.1f} out tok/s ({runs['A']})")
    print(f"  B LoRA engine, 4 adapters spread:  {mean['B']:.1f} ({runs['B']}) = "
          f"{mean['B'] / mean['A']:.3f} x A")
    print(f"  C LoRA engine, base model:         {mean['C']:.1f} ({runs['C']}) = "
          f"{mean['C'] / mean['A']:.3f} x A")
    print("  ms per step (engine phases, summed over the timed runs):")
    for c, p in prof.items():
        print(f"    {c}: " + ", ".join(f"{k} {1e3 * p[k] / p['steps']:.2f}" for k in PHASES)
              + f" ({p['steps']} steps)")
    # The decode step alone, interleaved A B C in rounds: less exposed to a busy machine.
    pinned = [lora.core.lora.resolve(nm) for nm in names]
    pins = [SimpleNamespace(adapter_id=u, lora_slot=0) for u in pinned]
    for p in pins:
        lora.core.lora.acquire(p)
    slot_rows = {"A": [0] * n, "B": [pins[i % 4].lora_slot for i in range(n)], "C": [0] * n}
    steps = {c: [] for c in cases}
    for _ in range(args.step_rounds):
        for c, (llm, _) in cases.items():
            steps[c] += decode_step_ms(llm, slot_rows[c], 160, 5)
    for p in pins:
        lora.core.lora.release(p)
    med = {c: float(np.median(v)) for c, v in steps.items()}
    print(f"  decode step alone ({n} rows at 160 tokens, median / min of {len(steps['A'])}):")
    for c in cases:
        print(f"    {c}: {med[c]:.1f} / {min(steps[c]):.1f} ms = {med['A'] / med[c]:.3f} x A "
              f"(by min {min(steps['A']) / min(steps[c]):.3f})")
    print(f"  step compiles since ready: {base.stats().xla_compiles_since_ready}, "
          f"{lora.stats().xla_compiles_since_ready}; adapter swaps {lora.core.lora.swaps}")


if __name__ == "__main__":
    main()
