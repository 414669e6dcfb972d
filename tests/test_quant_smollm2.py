"""SmolLM2-135M real weights (the embedded Q4_1 GGUF) in each encoding over a fixed ~2,000-token
text (tests/data/apache-2.0.txt): perplexity next to float32 (the GGUF dequantized) and the share
of positions whose top-1 token agrees with float32's, through the engine's prompt logprobs.
One engine per encoding, built in turn. Also: a quantized engine compiles nothing while serving.

Measured here (2026-12): float32 / int8 / q4_1 perplexity and top-1 agreement are printed with
`-s`; BENCHMARKS.md (Quantized weights) holds the figures."""
import math
import os

import pytest

from maxjax.engine.types import SamplingParams
from maxjax.llm import LLM
from maxjax.models.loader import load_model

TEXT = os.path.join(os.path.dirname(__file__), "data", "apache-2.0.txt")
MAX_TOKENS = 2048
ENCODINGS = ("float32", "int8", "q4_1")
PPL_TOLERANCE = {"int8": 0.01, "q4_1": 0.05}     # relative to float32 (the targets)
MIN_TOP1_AGREEMENT = {"int8": 0.90, "q4_1": 0.85}


def score(encoding: str, tokens: list[int]):
    """(logprob of each token after the first, top-1 token at each of those positions,
    step compiles while serving)."""
    model = load_model(None, encoding, progress=False)
    llm = LLM(model, max_batch_size=1, max_batch_input_tokens=256, max_length=MAX_TOKENS + 64,
              num_kv_pages=72)
    out = llm.generate([tokens], SamplingParams(max_new_tokens=1, temperature=0,
                                                prompt_logprobs=True, top_logprobs=1))[0]
    lps = out.prompt_logprobs[1:]
    return [lp.logprob for lp in lps], [lp.top[0][0] for lp in lps], llm.core.step_compiles


@pytest.fixture(scope="module")
def scores():
    tokenizer = load_model(None, "int8", progress=False).tokenizer
    with open(TEXT) as f:
        tokens = tokenizer.encode(f.read(), add_special_tokens=False)[:MAX_TOKENS]
    assert len(tokens) >= 1900
    return {e: score(e, tokens) for e in ENCODINGS}


def perplexity(logprobs) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.parametrize("encoding", ["int8", "q4_1"])
def test_perplexity_next_to_float32(scores, encoding):
    base, ours = perplexity(scores["float32"][0]), perplexity(scores[encoding][0])
    top_f32, top = scores["float32"][1], scores[encoding][1]
    agree = sum(a == b for a, b in zip(top_f32, top)) / len(top)
    print(f"\n{encoding}: perplexity {ours:.3f} vs float32 {base:.3f} "
          f"({100 * (ours / base - 1):+.2f}%), top-1 agreement {100 * agree:.1f}% "
          f"over {len(top)} positions")
    assert abs(ours / base - 1) <= PPL_TOLERANCE[encoding]
    assert agree >= MIN_TOP1_AGREEMENT[encoding]
    assert scores[encoding][2] == 0     # no compile while serving


def test_float32_perplexity_is_plausible(scores):
    # a sanity bound on the reference itself: a 135M model on English legal prose
    assert 2.0 < perplexity(scores["float32"][0]) < 60.0
