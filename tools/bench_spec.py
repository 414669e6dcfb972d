"""Speculative decoding vs none, in the same process, on the same model and prompts: output tok/s
at 1, 8 and 32 concurrent streams (all prompts of a round submitted together, greedy, ignore_eos).

    .venv/bin/python tools/bench_spec.py [--streams 1,8,32] [--workloads copy,random]
        [--method ngram] [--num-speculative-tokens K] [--repeats 2]

Workloads: `copy` asks (chat template) to repeat or lightly edit a given text or code (the
repository's own source and README, ~256 tokens in); `random` is random vocabulary words. Each
(workload, streams) cell runs the two engines alternately `--repeats` times and keeps each
one's best round (the dev machine is shared). Prints a markdown table for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import glob
import os
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASKS = ["Copy this out again, word for word:\n\n{}",
        "{}\n\nRepeat the text above exactly.",
        "Rewrite the following, keeping everything the same but fixing any typos:\n\n{}"]


def copy_prompts(llm, n: int, length: int) -> list[list[int]]:
    """Chat prompts of about `length` tokens, each quoting a different slice of a source file."""
    files = sorted(glob.glob(os.path.join(ROOT, "maxjax", "engine", "*.py")))
    files = [f for f in files + [os.path.join(ROOT, "README.md")] if os.path.getsize(f) > 4000]
    out = []
    for i in range(n):
        text = open(files[i % len(files)]).read()
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        start = (i // len(files)) * length % max(1, len(ids) - length)
        body = llm.tokenizer.decode(ids[start:start + length - 40])
        msg = ASKS[i % len(ASKS)].format(body)
        out.append(llm.apply_chat_template([{"role": "user", "content": msg}]))
    return out


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(1000, 20000, length))) for _ in range(n)]


def run_round(llm, prompts, params, streams: int) -> float:
    """Output tok/s of `prompts` run `streams` at a time."""
    t, n = time.perf_counter(), 0
    for i in range(0, len(prompts), streams):
        n += sum(len(o.token_ids) for o in llm.generate(prompts[i:i + streams], params))
    return n / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--workloads", default="copy,random")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--draft-model-path", default=None)
    ap.add_argument("--max-batch-input-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    args = ap.parse_args()
    import maxjax
    from maxjax.models.loader import load_model
    streams = [int(s) for s in args.streams.split(",")]
    model = load_model(None, "float32", progress=False)
    engine = dict(max_batch_size=max(streams), max_batch_input_tokens=args.max_batch_input_tokens,
                  max_length=args.input_len + args.output_len + 64)
    spec_kw = dict(speculative_method=args.method,
                   num_speculative_tokens=args.num_speculative_tokens,
                   draft_model_path=args.draft_model_path,
                   **({"prompt_lookup_min": args.prompt_lookup_min,
                       "prompt_lookup_max": args.prompt_lookup_max}
                      if args.method == "ngram" else {}))
    t = time.perf_counter()
    base = maxjax.LLM(model, **engine)
    spec = maxjax.LLM(model, **engine, **spec_kw)
    print(f"two engines ready in {time.perf_counter() - t:.0f} s; buckets with speculation: "
          f"{len(spec.core.layout.buckets)}, without: {len(base.core.layout.buckets)}")
    params = maxjax.SamplingParams(max_new_tokens=args.output_len, temperature=0.0,
                                   ignore_eos=True)
    warm = random_prompts(1, 16, 99)
    for llm in (base, spec):
        llm.generate(warm, maxjax.SamplingParams(max_new_tokens=8))
    rows = []
    for workload in args.workloads.split(","):
        for n in streams:
            m = max(n, 3)          # 1 stream: three prompts one after the other
            prompts = (copy_prompts(base, m, args.input_len) if workload == "copy"
                       else random_prompts(m, args.input_len, n))
            best = {"base": 0.0, "spec": 0.0}
            for _ in range(args.repeats):
                for name, llm in (("base", base), ("spec", spec)):
                    before = llm.core.stats()
                    tps = run_round(llm, prompts, params, n)
                    best[name] = max(best[name], tps)
                    if name == "spec":
                        after = llm.core.stats()
                        rv = after.spec.rows_verified - before.spec.rows_verified
                        dr = after.spec.draft_tokens - before.spec.draft_tokens
                        ac = after.spec.accepted_tokens - before.spec.accepted_tokens
                        steps = after.steps - before.steps
            rows.append((workload, n, best["base"], best["spec"], steps, rv, dr, ac))
            print(rows[-1], flush=True)
    print(f"\nSmolLM2-135M f32, {args.input_len} in / {args.output_len} out, greedy, ignore_eos; "
          f"engine {engine}; speculation {spec_kw}; best of {args.repeats} alternating rounds\n")
    print("| workload | streams | no spec tok/s | spec tok/s | ratio | spec steps | rows verified "
          "| drafts | accepted |")
    # steps / rows verified / drafts / accepted: the speculating engine's last round
    print("|---|---|---|---|---|---|---|---|---|")
    for w, n, b, s, steps, rv, dr, ac in rows:
        print(f"| {w} | {n} | {b:.1f} | {s:.1f} | {s / b:.2f}x | {steps} | {rv} | {dr} | {ac} |")


if __name__ == "__main__":
    main()
