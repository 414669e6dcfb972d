"""SmolLM2-135M real weights (the embedded Q4_1 GGUF) in each encoding over a fixed text (the
first 1,024 tokens of tests/data/apache-2.0.txt): perplexity next to float32 (the GGUF dequantized)
and the share of positions whose top-1 token agrees with float32's. The text is prefilled through
the paged step graph in chunks of 512 (one compile per encoding), logits at every position;
"int8-kernel" and "q4_1-kernel" go through the CPU kernels (graphs/cpu_kernels.py, this CPU's
best ISA) and "q4_1-kernel-avx2" through their AVX2 path (MAXJAX_CPU_ISA=avx2); the 4-bit ones
keep the GGUF's block arithmetic, within +0.5% of float32, also over the bfloat16 KV pool
the default serve gives them ("q4_1-kernel-bf16-kv"). On a CPU with AMX-INT8 the int8 calls
(int8-kernel's linears, every kernel case's LM head: 512-row chunks) run on its tiles, the VNNI
path's bits (tests/test_cpu_kernel_isas.py).
Figures (printed with `-s`) are in BENCHMARKS.md, Quantized weights."""
import dataclasses
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.graphs import cpu_kernels
from maxjax.graphs.decoder import init_kv
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.models.loader import load_model

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

TEXT = os.path.join(os.path.dirname(__file__), "data", "apache-2.0.txt")
NUM_TOKENS, CHUNK, PAGE = 1024, 512, 32
PPL_TOLERANCE = {"int8": 0.01, "int8-kernel": 0.01, "q4_1": 0.05, "q4_1-kernel": 0.005,
                 "q4_1-kernel-avx2": 0.005, "q4_1-kernel-bf16-kv": 0.005}
MIN_TOP1_AGREEMENT = {"int8": 0.93, "int8-kernel": 0.93, "q4_1": 0.93, "q4_1-kernel": 0.95,
                      "q4_1-kernel-avx2": 0.95, "q4_1-kernel-bf16-kv": 0.95}


def score(model, tokens, kv_dtype=None):
    """(log-probability of each next token, top-1 token at each position but the last), over a
    KV pool of `kv_dtype` (default: the activations')."""
    cfg, arch = model.config, model.arch
    pages = list(range(1, len(tokens) // PAGE + 1))
    kv = init_kv(cfg, len(pages) + 1, PAGE, kv_dtype or model.compute_dtype)

    # log-softmax in float32 on the device (its rounding, ~1e-7 of a logprob, moves a
    # perplexity by ~1e-7 relative, far inside every tolerance); only [CHUNK] values come back
    @partial(jax.jit, donate_argnums=(1,))
    def prefill(params, kv, step, nxt):
        h, kv = arch.hidden_states(cfg, params, kv, step)
        logits = arch.lm_logits(cfg, params, h).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(lp, nxt[:, None], 1)[:, 0], jnp.argmax(logits, -1), kv
    logprobs, top = [], []
    for start in range(0, len(tokens), CHUNK):
        step = build_step_inputs([RowSlice(tokens[start:start + CHUNK], start, pages)], CHUNK, 1,
                                 len(pages), PAGE)
        nxt = tokens[start + 1:start + CHUNK + 1]
        padded = np.zeros(CHUNK, np.int32)
        padded[:len(nxt)] = nxt
        lp, best, kv = prefill(model.params, kv, step, padded)
        logprobs += [float(x) for x in np.asarray(lp)[:len(nxt)]]
        top += list(np.asarray(best)[:len(nxt)])
    return logprobs, top


@pytest.fixture(scope="module")
def scores():
    out = {}
    for encoding in ("float32", "int8", "q4_1"):
        model = load_model(None, encoding, progress=False)
        if "tokens" not in out:
            with open(TEXT) as f:
                ids = model.tokenizer.encode(f.read(), add_special_tokens=False)
            out["tokens"] = ids[:NUM_TOKENS]
            assert len(out["tokens"]) == NUM_TOKENS
        out[encoding] = score(model, out["tokens"])
        if encoding != "float32" and cpu_kernels.unavailable() is None:
            packed = dataclasses.replace(model, params=cpu_kernels.pack_params(model.params))
            out[f"{encoding}-kernel"] = score(packed, out["tokens"])
            if encoding == "q4_1":      # as the default serve runs it: a bfloat16 KV pool
                out["q4_1-kernel-bf16-kv"] = score(packed, out["tokens"], jnp.bfloat16)
            if encoding == "q4_1" and cpu_kernels.isa() != "avx2" \
                    and cpu_kernels.unavailable("avx2") is None:
                with pytest.MonkeyPatch.context() as mp:   # traced with the AVX2 kernels
                    mp.setenv(cpu_kernels.ISA_ENV, "avx2")
                    out["q4_1-kernel-avx2"] = score(packed, out["tokens"])
        del model
    return out


def perplexity(logprobs) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.parametrize("encoding", ["int8", "int8-kernel", "q4_1", "q4_1-kernel",
                                      "q4_1-kernel-avx2", "q4_1-kernel-bf16-kv"])
def test_perplexity_next_to_float32(scores, encoding):
    if encoding not in scores:
        pytest.skip(f"CPU kernels: {cpu_kernels.unavailable()}")
    base, ours = perplexity(scores["float32"][0]), perplexity(scores[encoding][0])
    top_f32, top = scores["float32"][1], scores[encoding][1]
    agree = sum(int(a == b) for a, b in zip(top_f32, top)) / len(top)
    print(f"\n{encoding}: perplexity {ours:.3f} vs float32 {base:.3f} "
          f"({100 * (ours / base - 1):+.2f}%), top-1 agreement {100 * agree:.1f}% "
          f"over {len(top)} positions")
    assert abs(ours / base - 1) <= PPL_TOLERANCE[encoding]
    assert agree >= MIN_TOP1_AGREEMENT[encoding]


def test_float32_perplexity_is_plausible(scores):
    # a sanity bound on the reference itself: a 135M model on English legal prose
    assert 2.0 < perplexity(scores["float32"][0]) < 60.0
