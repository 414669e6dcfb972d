"""GLM-4.5 (graphs/glm4_moe.py) against transformers on a tiny random checkpoint: GQA with q/k/v
biases, per-head q/k norm and half-rotary rope; one dense first layer, then DeepSeek-V3's routing
(8 experts in 2 groups, 1 kept, a correction bias, scaling 2.5) with a shared expert. Two prompts
prefilled in chunks of 8 in one batch, 8 greedy tokens each."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_harness import load_checkpoint, paged_greedy
from reference import assert_logits_close, hf_greedy, scramble_grouped_moe
from tiny_llama import write_word_tokenizer

VOCAB = 256
LOGIT_REL_TOL = 1e-3     # float32; as tests/test_deepseek_v3.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    torch.manual_seed(0)
    cfg = Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True, num_mtp_layers=0, eos_token_id=None, max_position_embeddings=512)
    model = scramble_grouped_moe(Glm4MoeForCausalLM(cfg).eval())
    path = tmp_path_factory.mktemp("glm4_moe")
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return model, str(path)


def test_config(checkpoint):
    _, cfg, params = load_checkpoint(checkpoint[1])
    assert cfg.rotary_dim == 8 and cfg.qk_norm and cfg.attention_bias
    assert not cfg.attention_out_bias and cfg.paged_state == "kv"
    assert cfg.moe_layers == (False, True, True) and cfg.router_scoring == "sigmoid"
    assert {"router_correction", "shared_gate_up", "bqkv"} <= set(params["layers"][1])


def test_paged_graph_matches_transformers(checkpoint):
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, VOCAB, n))) for n in (13, 29)]
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=8, new_tokens=8,
                                  page_size=8)
    for prompt, lg, tk in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, 8)
        assert_logits_close(lg, ref_logits, rel=LOGIT_REL_TOL)
        assert tk == ref_tokens
