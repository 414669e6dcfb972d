"""Granite 4 (graphs/granitemoehybrid.py) against transformers on tiny random checkpoints: Mamba2
layers (8 heads in 2 groups, conv of 4 taps) interleaved with attention layers, routed MLPs (4
experts, top 2) beside the shared MLP, Granite's four multipliers; and a dense variant (the
shared MLP alone) without rope. Two prompts prefilled in chunks (boundaries inside the prompts
and inside pages) in one batch, 32 greedy tokens each; the paged pools hold the attention
layers only, the Mamba2 layers' conv window and state live in the request-state pools."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine_runs import run_preempting, run_tokens
from paged_harness import load_checkpoint, paged_greedy
from reference import assert_logits_close, hf_generate, hf_greedy
from tiny_llama import write_word_tokenizer

pytestmark = pytest.mark.slow      # transformers' torch Mamba2 and 2 x 32 decode steps: ~40 s CPU

VOCAB, NEW_TOKENS = 256, 32
# float32: the token-by-token scan adds in another order than transformers' chunked SSD
# (measured ~1e-6 of the largest logit over 61 tokens); a wrong group, gate or scale moves the
# logits by ~1e-1 of it.
LOGIT_REL_TOL = 1e-3
TYPES = ["mamba", "attention", "mamba", "attention"]
HEADS, HEAD_DIM, GROUPS, STATE, KERNEL = 8, 16, 2, 16, 4


def _model(seed, **over):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
                  shared_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=TYPES, mamba_n_heads=HEADS,
                  mamba_n_groups=GROUPS, mamba_d_state=STATE, mamba_d_head=HEAD_DIM,
                  mamba_d_conv=KERNEL, mamba_expand=2, num_local_experts=4,
                  num_experts_per_tok=2, embedding_multiplier=2.0, residual_multiplier=0.5,
                  attention_multiplier=0.2, logits_scaling=3.0, position_embedding_type="rope",
                  eos_token_id=None)
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**{**fields, **over})).eval()
    with torch.no_grad():      # initialization leaves logits near 0: make every weight count
        for name, p in model.named_parameters():
            if "norm" in name or name.rsplit(".", 1)[-1] in ("A_log", "dt_bias", "D"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def _write(model, path):
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = _model(0)
    return model, _write(model, tmp_path_factory.mktemp("granite4"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    model = _model(1, num_local_experts=0, position_embedding_type=None)
    return model, _write(model, tmp_path_factory.mktemp("granite4_dense"))


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(3, VOCAB, n))) for n in (13, 29)]


def _hf_generate(model, prompt, _done={}):
    key = (id(model), tuple(prompt))
    if key not in _done:
        _done[key] = hf_generate(model, prompt, NEW_TOKENS)
    return _done[key]


def test_config_params_and_pools(checkpoint):
    from maxjax.graphs import decoder, state
    _, cfg, params = load_checkpoint(checkpoint[1])
    assert cfg.state_layers == (True, False, True, False) and cfg.rotary_dim is None
    assert (cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_groups, cfg.ssm_state_dim,
            cfg.ssm_conv_kernel) == (HEADS, HEAD_DIM, GROUPS, STATE, KERNEL)
    assert cfg.moe_layers == (True,) * 4 and cfg.shared_expert_intermediate_size == 48
    assert (cfg.embed_scale, cfg.residual_scale, cfg.attn_scale, cfg.logits_scaling) == \
        (2.0, 0.5, 0.2, 3.0)
    mamba, attn = params["layers"][0], params["layers"][1]
    conv = 2 * GROUPS * STATE + HEADS * HEAD_DIM
    assert mamba["conv_w"].shape == (conv, KERNEL) and "wqkv" not in mamba
    assert mamba["w_in"].shape == (64, 2 * HEADS * HEAD_DIM + 2 * GROUPS * STATE + HEADS)
    assert {"router", "experts_gate_up", "shared_gate_up"} <= set(mamba)
    assert "wqkv" in attn and "w_in" not in attn
    k, v, conv_pool, ssm_pool = decoder.kv_pool_specs(cfg, 10, 8, state_slots=3)
    assert k.shape == v.shape == (2, 10, 2, 8, 16)          # the two attention layers only
    assert conv_pool.shape == (2, 3, conv, KERNEL - 1)
    assert ssm_pool.shape == (2, 3, HEADS, STATE, HEAD_DIM)
    assert [state.pool_layer(cfg, i) for i in range(4)] == [0, 0, 1, 1]


def test_paged_graph_matches_transformers(checkpoint):
    """The prompts (13 and 29 tokens) prefilled in chunks of 8 pages of 8 side by side, 32
    greedy tokens: logits as transformers' forward, tokens as its generate."""
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    prompts = _prompts()
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=8, new_tokens=NEW_TOKENS,
                                  page_size=8)
    for prompt, lg, tk in zip(prompts, logits, tokens):
        ref_logits, _ = hf_greedy(model, prompt, NEW_TOKENS)
        assert_logits_close(lg, ref_logits, rel=LOGIT_REL_TOL)
        assert tk == _hf_generate(model, prompt)


def test_dense_without_rope(dense):
    """num_local_experts 0 (the shared MLP is the layer's MLP) and no position embedding:
    chunks of 5 over pages of 4; rope where the config has none moves the logits."""
    model, path = dense
    arch, cfg, params = load_checkpoint(path)
    assert cfg.moe_layers == () and cfg.rotary_dim == 0 and cfg.intermediate_size == 48
    assert "router" not in params["layers"][0] and params["layers"][0]["w_gate_up"].shape \
        == (64, 96)
    prompts = _prompts()
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=5, new_tokens=NEW_TOKENS,
                                  page_size=4)
    for prompt, lg, tk in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, NEW_TOKENS)
        assert_logits_close(lg, ref_logits, rel=LOGIT_REL_TOL)
        assert tk == ref_tokens
    roped = dataclasses.replace(cfg, rotary_dim=None)
    off, _ = paged_greedy(arch, roped, params, prompts[1:], chunk=5, new_tokens=2, page_size=4)
    assert np.abs(off[0][0] - logits[1][0]).max() > 10 * LOGIT_REL_TOL * np.abs(logits[1]).max()


def test_refused_configs(checkpoint):
    from maxjax.models.hf import read_config
    from maxjax.graphs.granitemoehybrid import config_from_hf
    hf = read_config(checkpoint[1])
    for key, value in (("mamba_proj_bias", True), ("time_step_limit", [0.0, 0.1]),
                       ("position_embedding_type", "alibi")):
        with pytest.raises(ValueError, match=key):
            config_from_hf({**hf, key: value})


# --max-batch-input-tokens 16 cuts the 29-token prompt at 16 and the batch's prompts wherever
# the budget ends (inside pages of 8 tokens).
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8)


@pytest.fixture(scope="module")
def core(checkpoint):
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    from maxjax.models.loader import load_model
    return build_core(load_model(checkpoint[1], "float32", progress=False),
                      EngineConfig(**ENGINE))


def _engine_prompts():
    return [_prompts()[0][:5], *_prompts()]


def test_engine_holds_attention_pages_and_state_slots(core):
    import jax
    k, v, conv_pool, ssm_pool = jax.tree.leaves(core.runner.kv)
    assert k.shape == v.shape == (2, ENGINE["num_kv_pages"], 2, 8, 16)
    slots = 2 * ENGINE["max_batch_size"] + 1    # scratch, one a row, a prefix-cache snapshot a row
    assert conv_pool.shape == (2, slots, 2 * GROUPS * STATE + HEADS * HEAD_DIM, KERNEL - 1)
    assert ssm_pool.shape == (2, slots, HEADS, STATE, HEAD_DIM)


def test_engine_batched_chunked_equals_transformers_generate(checkpoint, core):
    """Three prompts batched, 32 greedy tokens each; the 29-token prompt is prefilled in
    chunks of at most 16 tokens (its state carried from chunk to chunk)."""
    from maxjax.engine.types import SamplingParams
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _engine_prompts()
    tokens, steps = run_tokens(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy)
    assert steps > NEW_TOKENS                     # the prompts took more than one step
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == _hf_generate(checkpoint[0], prompt), i


def test_engine_shared_prefix_resumes_from_its_state_snapshot(core):
    """The prefix cache on a real hybrid (tests/hybrid_prefix.py): a prompt sharing 3 pages
    with an earlier one resumes from the Mamba2 layers' snapshot at their end and gives the
    cold run's tokens; one diverging in the first page reuses nothing; a mixed workload with a
    preemption leaks no slot."""
    from hybrid_prefix import check_mixed_with_preemption, check_shared_prefix
    check_shared_prefix(core, VOCAB, NEW_TOKENS)
    check_mixed_with_preemption(core, VOCAB, 12)


def test_engine_recomputed_after_preemption(checkpoint, core):
    """A request preempted mid-decode (its slot given back, its state gone) recomputes its
    prompt and its tokens so far from zero state, beside another request."""
    from maxjax.engine.types import SamplingParams
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _engine_prompts()
    tokens = run_preempting(core, {"pre": prompts[2], "other": prompts[1]}, greedy, "pre")
    assert tokens["pre"] == _hf_generate(checkpoint[0], prompts[2])
    assert tokens["other"] == _hf_generate(checkpoint[0], prompts[1])
