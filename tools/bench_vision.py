"""The image encoder's time per image: maxjax's compiled Gemma 3 encoder (graphs/gemma3_vision.py)
against transformers' Gemma3Model.get_image_features on the same random weights, float32, on this
machine's CPU, in the same run.

    python tools/bench_vision.py [--layers 12 --hidden 768 --image-size 224 --patch 16 --runs 10]

The default tower is SigLIP-base sized (Gemma 3's own is SigLIP-so400m at 896 px: `--layers 27
--hidden 1152 --intermediate 4304 --heads 16 --image-size 896 --patch 14 --tokens 256`, minutes
on two cores)."""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=49, help="mm_tokens_per_image")
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()

    import jax
    import numpy as np
    import torch
    from safetensors import safe_open
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)

    from maxjax.graphs import gemma3_vision as gv

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=128),
        vision_config=SiglipVisionConfig(hidden_size=args.hidden,
                                         intermediate_size=args.intermediate,
                                         num_hidden_layers=args.layers,
                                         num_attention_heads=args.heads,
                                         image_size=args.image_size, patch_size=args.patch),
        mm_tokens_per_image=args.tokens, image_token_id=500, boi_token_index=501,
        eoi_token_index=502)
    model = Gemma3ForConditionalGeneration(config).eval()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        import json
        hf = json.load(open(os.path.join(d, "config.json")))
        vcfg = gv.vision_config_from_hf(hf)
        with safe_open(os.path.join(d, "model.safetensors"), framework="numpy") as f:
            params = gv.vision_params_from_hf(vcfg, f.get_tensor, "float32")
    pixels = np.random.default_rng(0).uniform(-1, 1, (1, 3, args.image_size, args.image_size)
                                              ).astype(np.float32)
    t0 = time.perf_counter()
    encode = jax.jit(functools.partial(gv.encode_images, vcfg)).lower(params, pixels).compile()
    compile_s = time.perf_counter() - t0

    def ours():
        jax.block_until_ready(encode(params, pixels))

    def theirs():
        with torch.no_grad():
            model.model.get_image_features(torch.from_numpy(pixels))

    times = {}
    for name, fn in (("maxjax", ours), ("transformers", theirs)):
        fn()                                           # first run: allocation, caches
        runs = []
        for _ in range(args.runs):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        times[name] = statistics.median(runs)
    patches = (args.image_size // args.patch) ** 2
    print(f"SigLIP tower: {args.layers} layers, hidden {args.hidden}, {args.image_size} px, "
          f"{patches} patches -> {args.tokens} tokens; float32, {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}")
    print(f"maxjax compile: {compile_s:.2f} s (once, at start-up)")
    for name, s in times.items():
        print(f"{name:<13} {s * 1000:8.1f} ms per image (median of {args.runs})")
    print(f"ratio transformers / maxjax: {times['transformers'] / times['maxjax']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
