"""Embeddings throughput, in one process on the embedded SmolLM2 (float32, maxjax.LLM):

1. Embeddings per second at batch --batch (default 64) inputs of the same sentences: maxjax
   (`LLM.embed`, last-token pooling: prefill-only requests through the engine's steps) beside
   transformers (torch CPU, the same GGUF dequantized to float32, one padded batch with an
   attention mask, the base model without its LM head, the last real token's final hidden
   state; torch's own thread count), interleaved --reps times; the vectors' agreement (min
   cosine) is printed too.
2. --streams (default 32) concurrent greedy generation streams of --tokens new tokens, alone and
   with an embeddings load beside them (--load inputs kept queued at all times, refilled as they
   finish): generation output tok/s with / without (the ratio), and the embeddings/s that load
   got. Interleaved: without, with, without, with ...

    .venv/bin/python tools/bench_embeddings.py [--batch 64] [--reps 3] [--streams 32]
        [--tokens 32] [--load 16] [--max-batch-size 64] [--max-batch-input-tokens 256]
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import numpy as np

from maxjax.engine.types import SamplingParams
from maxjax.llm import LLM

WORDS = ("red green blue small large quick lazy old new bright cat dog bird fox river mountain "
         "table window garden city sits runs sleeps jumps over under near beside").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(8, 24)))).capitalize() + "."
            for _ in range(n)]


def maxjax_embed(llm, texts) -> tuple[float, np.ndarray]:
    t0 = time.perf_counter()
    vecs = llm.embed(texts, "last")
    return len(texts) / (time.perf_counter() - t0), np.asarray(vecs)


def hf_embed(model, tok, texts) -> tuple[float, np.ndarray]:
    import torch
    ids = [tok.encode(t) for t in texts]
    n = max(map(len, ids))
    x = torch.tensor([i + [0] * (n - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i in ids])
    t0 = time.perf_counter()
    with torch.no_grad():      # the base model: no LM head over every token
        h = model.model(x, attention_mask=mask).last_hidden_state
    last = h[torch.arange(len(ids)), torch.tensor([len(i) - 1 for i in ids])].double().numpy()
    took = time.perf_counter() - t0
    return len(texts) / took, last / np.linalg.norm(last, axis=1, keepdims=True)


def generation(llm, prompts, tokens: int, load: int, texts) -> tuple[float, float]:
    """(generation output tok/s, embeddings/s beside it) for the streams, with `load` embedding
    requests kept queued (0: none)."""
    core = llm.core
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    gen = {f"g{i}" for i in range(len(prompts))}
    for rid, p in zip(sorted(gen), prompts):
        core.add_request(rid, p, params)
    ids, queued, embedded = itertools.count(), set(), 0

    def refill():
        while len(queued) < load:
            rid = f"e{next(ids)}"
            core.add_embedding(rid, texts[len(queued) % len(texts)], "last")
            queued.add(rid)
    refill()
    out_tokens, t0 = 0, time.perf_counter()
    while gen:
        for out in core.step():
            if out.request_id in gen:
                out_tokens += len(out.new_token_ids)
                if out.finished:
                    gen.discard(out.request_id)
            elif out.finished and out.request_id in queued:
                queued.discard(out.request_id)
                embedded += 1
        refill()
    took = time.perf_counter() - t0
    for rid in list(queued):
        core.abort(rid)
    return out_tokens / took, embedded / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--load", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-batch-input-tokens", type=int, default=256)
    args = ap.parse_args()

    llm = LLM(None, quantization_encoding="float32", max_batch_size=args.max_batch_size,
              max_batch_input_tokens=args.max_batch_input_tokens, max_length=512)
    texts = sentences(args.batch)
    tok_ids = [llm.encode(t) for t in texts]
    print(f"{args.batch} inputs, {sum(map(len, tok_ids))} tokens "
          f"({min(map(len, tok_ids))}-{max(map(len, tok_ids))} each); "
          f"cpu count {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")

    import torch
    from transformers import AutoModelForCausalLM

    from maxjax.models.loader import embedded_model_path
    directory, name = os.path.split(embedded_model_path())
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                              dtype=torch.float32).eval()
    maxjax_embed(llm, texts[:8])                      # first runs of the executables
    hf_embed(hf, llm.tokenizer, texts[:8])
    ours, theirs = [], []
    for _ in range(args.reps):
        rate, a = maxjax_embed(llm, texts)
        ours.append(rate)
        rate, b = hf_embed(hf, llm.tokenizer, texts)
        theirs.append(rate)
    cos = float(np.min(np.sum(a * b, axis=1)))
    print(f"embeddings/s at batch {args.batch}: maxjax {statistics.median(ours):.1f} "
          f"(runs {', '.join(f'{r:.1f}' for r in ours)}), transformers "
          f"{statistics.median(theirs):.1f} (runs {', '.join(f'{r:.1f}' for r in theirs)}); "
          f"min cosine {cos:.6f}")

    prompts = [llm.encode(t) for t in sentences(args.streams, seed=1)]
    alone, beside, rates = [], [], []
    for _ in range(args.reps):
        alone.append(generation(llm, prompts, args.tokens, 0, tok_ids)[0])
        tps, eps = generation(llm, prompts, args.tokens, args.load, tok_ids)
        beside.append(tps)
        rates.append(eps)
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"{args.streams} streams x {args.tokens} tokens: output tok/s alone {a:.1f} (runs "
          f"{', '.join(f'{r:.1f}' for r in alone)}), with {args.load} embedding inputs queued "
          f"beside {b:.1f} (runs {', '.join(f'{r:.1f}' for r in beside)}): ratio {b / a:.2f}; "
          f"embeddings/s beside {statistics.median(rates):.1f}")
    s = llm.stats()
    print(f"pages used after: {s.kv.pages_used}, compiles since ready: "
          f"{s.xla_compiles_since_ready}")


if __name__ == "__main__":
    main()
