"""Structured output cost, in one process (maxjax.LLM on the embedded SmolLM2):
  1. output tok/s of N streams all unconstrained vs half of them under a JSON schema (runs
     interleaved A B A, the same prompts and lengths: the schema is an array of exactly K digits,
     so a constrained stream writes as many tokens as an unconstrained one);
  2. grammar compile time p50/p99 over the test schemas (tests/structured_schemas.py), each
     compiled fresh;
  3. mask fill time per step at N constrained rows (all the test schemas, mid-output).

    .venv/bin/python tools/bench_structured.py [--streams 32] [--tokens 64] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from structured_schemas import SCHEMAS  # noqa: E402

from maxjax.engine.types import SamplingParams  # noqa: E402
from maxjax.llm import LLM  # noqa: E402
from maxjax.structured import GrammarSpec  # noqa: E402


def run(llm, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n, k = args.streams, args.tokens
    llm = LLM(max_batch_size=n, max_batch_input_tokens=max(128, n), max_length=512,
              kv_cache_page_size=32)
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"List {k} digits ({i})."}])
               for i in range(n)]
    digits = (k - 2) // 2 + 1      # "[d,d,...,d]" is 2 * digits + 1 tokens, then EOS
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": digits, "maxItems": digits}
    plain = SamplingParams(max_new_tokens=k, temperature=0.8, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=k, temperature=0.8, seed=1,
                                 structured_output=GrammarSpec.json_schema(schema))
    half = [constrained if i % 2 else plain for i in range(n)]
    run(llm, prompts, [plain] * n)                   # warm: first runs, prefix cache
    run(llm, prompts, half)
    a_runs, b_runs = [], []
    for _ in range(args.reps):                       # A B ... A: the machine's drift in both
        a_runs.append(run(llm, prompts, [plain] * n))
        b_runs.append(run(llm, prompts, half))
    a_runs.append(run(llm, prompts, [plain] * n))
    a = float(np.mean([r for r, _ in a_runs]))
    b = float(np.mean([r for r, _ in b_runs]))
    print(f"{n} streams x {k} tokens: all unconstrained {a:.1f} out tok/s "
          f"({', '.join(f'{r:.1f}' for r, _ in a_runs)}); half under a JSON schema {b:.1f} "
          f"({', '.join(f'{r:.1f}' for r, _ in b_runs)}; {b_runs[0][1]} vs {a_runs[0][1]} "
          f"tokens) = {100 * b / a:.1f}%")

    backend = llm.core.grammars
    backend.cache_size = 0                           # every compile fresh
    times = []
    for _ in range(5):
        for _, s in SCHEMAS:
            spec = GrammarSpec.json_schema(s)
            t0 = time.perf_counter()
            backend.compiled(spec)
            times.append(time.perf_counter() - t0)
    print(f"grammar compile over {len(SCHEMAS)} schemas x 5: p50 {np.percentile(times, 50) * 1e3:.2f} "
          f"ms, p99 {np.percentile(times, 99) * 1e3:.2f} ms")

    states = []
    for i in range(n):
        _, s = SCHEMAS[i % len(SCHEMAS)]
        spec = GrammarSpec.json_schema(s)
        st = backend.new_state(backend.compiled(spec), spec)
        # one token in: mid-output (the first masks of objects are forced, hence cheap)
        st.accept(llm.tokenizer.encode("{" if s.get("type") == "object" else "",
                                       add_special_tokens=False))
        states.append(st)
    fills = []
    for _ in range(50):
        t0 = time.perf_counter()
        backend.fill_masks(states)
        fills.append(time.perf_counter() - t0)
    print(f"mask fill at {n} constrained rows: median {np.median(fills) * 1e3:.2f} ms per step "
          f"(p90 {np.percentile(fills, 90) * 1e3:.2f} ms); step compiles since ready: "
          f"{llm.stats().xla_compiles_since_ready}")


if __name__ == "__main__":
    main()
