"""Offline throughput: maxjax.LLM vs transformers' generate on the same model and workload, and
maxjax's batch-1 decode against the float32 roofline (weight bytes / measured copy bandwidth).

    .venv/bin/python tools/bench_offline.py [--batches 1,8,32] [--input-len 128] [--output-len 128]
    .venv/bin/python tools/bench_offline.py --overlap-ab [--batches 1,32] [--repeats 3]

--overlap-ab: the overlap scheduler on and off in one run, on one engine of default flags (but
--num-kv-pages): the same prompts alternately with each, best of --repeats.

Prints a markdown table (paste it into BENCHMARKS.md with the command line).
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best              # bytes copied per second, as ../shared/DESIGN.md measures it


def prompts_of(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = [i for i in range(1000, 20000)]
    return [list(map(int, rng.choice(vocab, length))) for _ in range(n)]


def decode_probe(core, prompt, params) -> float:
    """Pure decode speed at batch 1, steps per second: the steps after the prefill of one request
    alone on an idle engine core."""
    core.add_request("decode-probe", prompt, params)
    while core.scheduler.requests["decode-probe"].num_output_tokens < 1:
        core.step()
    t, steps = time.perf_counter(), 0
    while core.has_unfinished():
        core.step()
        steps += 1
    return steps / (time.perf_counter() - t)


def bench_maxjax(batches, input_len, output_len, engine_kw):
    import maxjax
    from maxjax.models.loader import load_model
    model = load_model(None, "float32", progress=False)
    t = time.perf_counter()
    llm = maxjax.LLM(model, **engine_kw)
    warm = time.perf_counter() - t
    rows = {}
    params = maxjax.SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts_of(None, 1, input_len, 99), maxjax.SamplingParams(max_new_tokens=4))
    for b in batches:
        ps = prompts_of(None, b, input_len, b)
        t = time.perf_counter()
        outs = llm.generate(ps, params)
        dt = time.perf_counter() - t
        n = sum(len(o.token_ids) for o in outs)
        rows[b] = n / dt
    decode_tps = decode_probe(llm.core, prompts_of(None, 1, input_len, 7)[0], params)
    from maxjax.engine.memory import weight_bytes
    return rows, decode_tps, weight_bytes(model.params), warm, llm.stats()


def overlap_ab(batches, input_len, output_len, repeats, num_kv_pages):
    """{batch: (tok/s overlap on, tok/s off)}, best of `repeats`, alternating on one engine."""
    import maxjax
    from maxjax.engine.overlap import OverlapLoop
    llm = maxjax.LLM(enable_overlap_scheduler=True, num_kv_pages=num_kv_pages)
    params = maxjax.SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts_of(None, 1, input_len, 99), maxjax.SamplingParams(max_new_tokens=4))
    loops = {True: llm.core.overlap, False: None}
    best = {b: {True: 0.0, False: 0.0} for b in batches}
    tokens = {}
    for _ in range(repeats):
        for b in batches:
            ps = prompts_of(None, b, input_len, b)
            for on in (True, False):
                llm.core.overlap = loops[on]
                t = time.perf_counter()
                outs = llm.generate(ps, params)
                dt = time.perf_counter() - t
                got = [o.token_ids for o in outs]
                assert tokens.setdefault(b, got) == got, "overlap changed the output"
                best[b][on] = max(best[b][on], sum(map(len, got)) / dt)
    llm.core.overlap = loops[True] or OverlapLoop(llm.core)
    return {b: (v[True], v[False]) for b, v in best.items()}


def bench_transformers(batches, input_len, output_len):
    import torch
    from transformers import AutoModelForCausalLM
    from maxjax.models.loader import embedded_model_path
    import os
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32).eval()
    rows = {}
    for b in batches:
        ids = torch.tensor(prompts_of(None, b, input_len, b))
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            dt = time.perf_counter() - t
        rows[b] = b * (out.shape[1] - input_len) / dt
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-batch-input-tokens", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--overlap-ab", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-kv-pages", type=int, default=600)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.overlap_ab:
        got = overlap_ab(batches, args.input_len, args.output_len, args.repeats,
                         args.num_kv_pages)
        print(f"\nSmolLM2 (embedded GGUF, default flags, --num-kv-pages {args.num_kv_pages}), "
              f"{args.input_len}-token prompts, {args.output_len} new tokens, greedy, "
              f"ignore_eos; best of {args.repeats}, alternating\n")
        print("| prompts | overlap on tok/s | overlap off tok/s | on / off |")
        print("|---:|---:|---:|---:|")
        for b, (on, off) in got.items():
            print(f"| {b} | {on:.1f} | {off:.1f} | {on / off:.3f}x |")
        return
    engine_kw = dict(max_batch_size=max(batches), max_batch_input_tokens=args.max_batch_input_tokens,
                     max_length=args.input_len + args.output_len + 16, kv_cache_page_size=args.page_size)
    ours, decode_tps, wbytes, warm, stats = bench_maxjax(batches, args.input_len, args.output_len, engine_kw)
    bw = copy_bandwidth()
    roofline = bw / wbytes
    theirs = {} if args.skip_transformers else bench_transformers(batches, args.input_len, args.output_len)
    print(f"\nSmolLM2-135M f32, {args.input_len}-token prompts, {args.output_len} new tokens, ignore_eos; "
          f"engine {engine_kw}; warm-up (compile) {warm:.1f} s\n")
    print("| concurrent sequences | maxjax output tok/s | transformers output tok/s | ratio |")
    print("|---|---|---|---|")
    for b in batches:
        t = theirs.get(b)
        print(f"| {b} | {ours[b]:.1f} | {t:.1f} | {ours[b] / t:.2f}x |" if t else f"| {b} | {ours[b]:.1f} | - | - |")
    if theirs.get(1):
        print(f"\nmaxjax at {max(batches)} sequences vs transformers at batch 1: "
              f"{ours[max(batches)] / theirs[1]:.1f}x")
    print(f"\nbatch-1 decode: {decode_tps:.1f} tok/s; f32 roofline {roofline:.1f} tok/s "
          f"({wbytes / 1e6:.0f} MB of weights / {bw / 1e9:.1f} GB/s copy bandwidth) = "
          f"{100 * decode_tps / roofline:.0f}% of roofline")


if __name__ == "__main__":
    main()
