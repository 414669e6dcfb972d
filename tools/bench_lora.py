"""Multi-LoRA cost, in one process (maxjax.LLM on the embedded SmolLM2, one loaded model, two
engines): output tok/s of N streams on an engine without LoRA (A), the same load spread over 4
adapters on a LoRA engine (B), and the same base-model load on the LoRA engine (C: the slots'
matmuls run for every token). Runs interleaved A B C ... A, same prompts and lengths.
Adapters: random PEFT-format files (rank --rank on all 7 projections), written here.

    .venv/bin/python tools/bench_lora.py [--streams 32] [--tokens 64] [--reps 3] [--rank 16]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from maxjax.engine.types import SamplingParams
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


def run(llm, prompts, params, lora) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora=lora)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
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
    for _ in range(args.reps):
        for c, (llm, lr) in cases.items():
            got[c].append(run(llm, prompts, params, lr))
    got["A"].append(run(base, prompts, params, None))
    mean = {c: float(np.mean(v)) for c, v in got.items()}
    runs = {c: ", ".join(f"{x:.1f}" for x in v) for c, v in got.items()}
    print(f"{n} streams x {k} tokens, rank {args.rank}, 4 device slots:")
    print(f"  A no-LoRA engine, base model:      {mean['A']:.1f} out tok/s ({runs['A']})")
    print(f"  B LoRA engine, 4 adapters spread:  {mean['B']:.1f} ({runs['B']}) = "
          f"{mean['B'] / mean['A']:.3f} x A")
    print(f"  C LoRA engine, base model:         {mean['C']:.1f} ({runs['C']}) = "
          f"{mean['C'] / mean['A']:.3f} x A")
    print(f"  step compiles since ready: {base.stats()['xla_compiles_since_ready']}, "
          f"{lora.stats()['xla_compiles_since_ready']}; adapter swaps {lora.core.lora.swaps}")


if __name__ == "__main__":
    main()
