"""What `tool_choice: auto`'s lazy grammar (server/tools.py: free text until <tool_call>, then the
call held to the tools' schemas) costs, in one process on the embedded SmolLM2:
  1. mask fill time per step at N rows, in free text and inside a call, beside N rows of a
     forced-call grammar;
  2. output tok/s of N streams with no grammar vs all under the auto grammar (writing free text,
     the common case), interleaved A B A B A.

    .venv/bin/python tools/bench_tool_grammar.py [--streams 32] [--tokens 48] [--reps 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from maxjax.engine.types import SamplingParams
from maxjax.llm import LLM
from maxjax.server.tools import lazy_tool_grammar, single_tokens, tool_grammar
from maxjax.structured import GrammarSpec

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
FNS = [{"name": "get_weather", "parameters": WEATHER},
       {"name": "add", "parameters": {"type": "object", "properties": {
           "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}]


def fill_ms(backend, spec, prefix: str, n: int, reps: int = 50) -> float:
    compiled = backend.compiled(spec)
    ids = backend.hf_tokenizer.encode(prefix, add_special_tokens=False)
    states = [backend.new_state(compiled, spec) for _ in range(n)]
    for s in states:
        assert s.accept(ids), s.error
    backend.fill_masks(states)
    t0 = time.perf_counter()
    for _ in range(reps):
        backend.fill_masks(states)
    return (time.perf_counter() - t0) / reps * 1e3


def run(llm, prompts, params) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    n = args.streams
    llm = LLM(max_batch_size=n, max_batch_input_tokens=max(128, n), max_length=512,
              kv_cache_page_size=32)
    tokens = single_tokens(llm.core.model.tokenizer)
    auto = GrammarSpec.lark(lazy_tool_grammar("hermes", FNS, True, tokens), "tools")
    forced = GrammarSpec.lark(tool_grammar("hermes", FNS, True, tokens), "tools")
    g = llm.core.grammars
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    print(f"mask fill per step at {n} rows (ms): auto in free text "
          f"{fill_ms(g, auto, 'Let me think about the', n):.2f}, auto inside a call "
          f"{fill_ms(g, auto, 'Sure. ' + call, n):.2f}, forced inside a call "
          f"{fill_ms(g, forced, call, n):.2f}")
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Tell me a story ({i})."}])
               for i in range(n)]
    plain = SamplingParams(max_new_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    held = SamplingParams(max_new_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True,
                          structured_output=auto)
    run(llm, prompts, [plain] * n)
    run(llm, prompts, [held] * n)
    a, b = [], []
    for _ in range(args.reps):
        a.append(run(llm, prompts, [plain] * n))
        b.append(run(llm, prompts, [held] * n))
    a.append(run(llm, prompts, [plain] * n))
    print(f"{n} streams x {args.tokens} tokens: no grammar {np.mean(a):.1f} tok/s, auto grammar "
          f"{np.mean(b):.1f} tok/s ({np.mean(b) / np.mean(a):.3f}x)")


if __name__ == "__main__":
    main()
