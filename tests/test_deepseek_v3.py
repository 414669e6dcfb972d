"""DeepSeek-V3 (graphs/deepseek_v3.py) against transformers on tiny random checkpoints: MLA with
q_lora_rank and without, interleaved YaRN rope with mscale_all_dim in the softmax scale, one
dense first layer then routed layers (8 experts in 2 groups, 1 group kept, a correction bias,
a shared expert, the routed scaling factor). The paged pool holds one latent a token a layer;
greedy tokens through the engine, batched, prefilled in chunks and recomputed after a
preemption, equal transformers' generate; Kimi-K2's config loads through it."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxjax.engine.types import SamplingParams
from engine_runs import run_preempting
from maxjax.graphs import moe
from paged_harness import load_checkpoint, paged_greedy
from reference import assert_logits_close, hf_generate, hf_greedy, scramble_grouped_moe
from tiny_llama import write_word_tokenizer

pytestmark = pytest.mark.slow      # an engine's graphs and four checkpoints: ~2 min on 2 cores

VOCAB, NEW_TOKENS = 256, 32
# float32 throughout: the absorbed scores and the routed sum add in another order than
# transformers' expanded K/V and index_add_ (measured ~1e-7 of the largest logit); a wrong
# expert, rope pair or scale moves logits by ~1e-1 of it.
LOGIT_REL_TOL = 1e-3
RANK, ROPE, NOPE, V, HEADS, LAYERS = 32, 16, 16, 24, 4, 3
# --max-batch-input-tokens 16 cuts the 29-token prompt at 16 and the batch's prompts wherever
# the budget ends; pages of 8 tokens.
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8)
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8, "original_max_position_embeddings": 128,
        "rope_theta": 10000.0}


def _config(**over):
    from transformers import DeepseekV3Config
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=RANK,
                  q_lora_rank=48, qk_rope_head_dim=ROPE, v_head_dim=V, qk_nope_head_dim=NOPE,
                  n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                  max_position_embeddings=512, num_mtp_layers=0, eos_token_id=None,
                  rope_parameters=dict(YARN))
    return DeepseekV3Config(**{**fields, **over})


def _write(model, path):
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return str(path)



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, directory of its float32 checkpoint and a tokenizer)."""
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = scramble_grouped_moe(DeepseekV3ForCausalLM(_config()).eval())
    return model, _write(model, tmp_path_factory.mktemp("deepseek_v3"))


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(3, VOCAB, n))) for n in (5, 13, 29)]


def test_config_and_the_latent_pool(checkpoint):
    from maxjax.engine import memory
    from maxjax.graphs import decoder, state
    _, path = checkpoint
    _, cfg, params = load_checkpoint(path)
    assert cfg.paged_state == "latent" and (cfg.num_kv_heads, cfg.head_dim) == (1, RANK + ROPE)
    assert cfg.moe_layers == (False, True, True) and cfg.n_group == 2 and cfg.topk_group == 1
    mscale = 0.1 * 0.8 * np.log(4.0) + 1.0
    assert cfg.attn_scale == pytest.approx((NOPE + ROPE) ** -0.5 * mscale ** 2)
    assert cfg.rope_scaling[0] == "yarn" and cfg.rope_interleave
    assert params["layers"][1]["router_correction"].shape == (8,)
    assert params["layers"][1]["shared_gate_up"].shape == (64, 64)
    assert "router" not in params["layers"][0]
    (pool,) = decoder.kv_pool_specs(cfg, 10, 8)
    assert pool.shape == (LAYERS, 10, 1, 8, RANK + ROPE)
    assert memory.page_bytes(cfg, 8, 2) == LAYERS * 8 * (RANK + ROPE) * 2
    cmp = state.comparison(cfg, 800)
    kv = HEADS * (NOPE + ROPE + V)          # expanded K (nope + rope) and V of every head
    assert (cmp["values_per_token_layer"], cmp["kv_values_per_token_layer"]) == (48, kv)
    assert cmp["tokens_as_kv"] == 800 * 48 // kv and cmp["more_tokens_than_kv"] > 0


def test_paged_graph_matches_transformers(checkpoint):
    """The 29-token prompt prefilled in chunks of 8 beside a 13-token one, 8 greedy tokens."""
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    prompts = _prompts()[1:]
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=8, new_tokens=8,
                                  page_size=8)
    for prompt, lg, tk in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, 8)
        assert_logits_close(lg, ref_logits, rel=LOGIT_REL_TOL)
        assert tk == ref_tokens
    # the mscale in the softmax scale matters: without it the logits move
    import dataclasses
    plain = dataclasses.replace(cfg, attn_scale=(NOPE + ROPE) ** -0.5)
    off, _ = paged_greedy(arch, plain, params, prompts[1:], chunk=8, new_tokens=2, page_size=8)
    assert np.abs(off[0][0] - logits[1][0]).max() > 10 * LOGIT_REL_TOL * np.abs(logits[1]).max()


def test_without_q_lora_rank(tmp_path):
    """q_lora_rank None: one q_proj; no rope interleave; no shared expert; plain rope."""
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(1)
    model = scramble_grouped_moe(DeepseekV3ForCausalLM(_config(
        q_lora_rank=None, rope_interleave=False, n_shared_experts=0, num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval())
    arch, cfg, params = load_checkpoint(_write(model, tmp_path / "no_q_lora"))
    assert cfg.q_lora_rank == 0 and "wq" in params["layers"][0]
    assert "shared_gate_up" not in params["layers"][1]
    prompt = _prompts()[2]
    logits, tokens = paged_greedy(arch, cfg, params, [prompt], chunk=8, new_tokens=8,
                                  page_size=8)
    ref_logits, ref_tokens = hf_greedy(model, prompt, 8)
    assert_logits_close(logits[0], ref_logits, rel=LOGIT_REL_TOL)
    assert tokens[0] == ref_tokens


def test_routing_matches_transformers(checkpoint):
    """Layer 1's router on the states transformers gives it: the same experts (of the kept
    group) and weights, and the routed MLP with its shared expert the same output."""
    model, path = checkpoint
    _, cfg, params = load_checkpoint(path)
    block = model.model.layers[1].mlp
    seen = {}
    handle = block.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(torch.tensor([_prompts()[2]]))
        handle.remove()
        x = seen["x"][0]
        _, hf_weights, hf_idx = block.gate(x)
    p = params["layers"][1]
    weights, experts = moe.route_grouped(jnp.asarray(x.numpy()), p["router"],
                                         p["router_correction"], 2, 2, 1, True, 2.5)
    order = np.argsort(np.asarray(experts), axis=1)
    hf_order = np.argsort(hf_idx.numpy(), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(hf_idx.numpy(), hf_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(hf_weights.numpy(), hf_order, 1), rtol=1e-5)
    groups = np.asarray(experts) // 4          # one group of 4 experts kept a token
    assert (groups == groups[:, :1]).all() and len(np.unique(groups[:, 0])) == 2
    from maxjax.graphs.deepseek_v3 import _mlp
    out = _mlp(cfg, jnp.asarray(x.numpy()), p, None)
    np.testing.assert_allclose(np.asarray(out), seen["y"][0].numpy(), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def core(checkpoint):
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    from maxjax.models.loader import load_model
    return build_core(load_model(checkpoint[1], "float32", progress=False),
                      EngineConfig(**ENGINE))


def _hf_generate(model, prompt):
    return hf_generate(model, prompt, NEW_TOKENS)


def test_engine_holds_the_latent_pool(core):
    (pool,) = jax.tree.leaves(core.runner.kv)
    assert pool.shape == (LAYERS, ENGINE["num_kv_pages"], 1, 8, RANK + ROPE)


def test_engine_batched_chunked_equals_transformers_generate(checkpoint, core):
    """Three prompts batched, 32 greedy tokens each; the 29-token prompt is prefilled in
    chunks of at most 16 tokens (its boundaries inside the prompt, not on a page edge)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        core.add_request(f"r{i}", prompt, greedy)
    tokens = {f"r{i}": [] for i in range(3)}
    steps_with_prompt = 0
    while core.has_unfinished():
        outs = core.step()
        steps_with_prompt += 1
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert steps_with_prompt > NEW_TOKENS       # the prompts took more than one step
    for i, prompt in enumerate(_prompts()):
        assert tokens[f"r{i}"] == _hf_generate(checkpoint[0], prompt), i


def test_recomputed_after_preemption_matches_transformers(checkpoint, core):
    """A request preempted mid-decode (its latents and the prefix cache gone) recomputes its
    prompt and its tokens so far, beside another request."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts()
    tokens = run_preempting(core, {"pre": prompts[2], "other": prompts[1]}, greedy, "pre",
                            on_preempt=core.block_manager.reset_prefix_cache)
    assert tokens["pre"] == _hf_generate(checkpoint[0], prompts[2])
    assert tokens["other"] == _hf_generate(checkpoint[0], prompts[1])


def test_suggest_says_what_the_latent_holds(checkpoint, capsys):
    from maxjax import cli
    _, path = checkpoint
    code = cli.main(["suggest", "--json", "--model", path, "--max-batch-size", "4",
                     "--max-batch-input-tokens", "16", "--kv-cache-page-size", "8",
                     "--num-kv-pages", "101", "--max-length", "96"])
    out, _ = capsys.readouterr()
    plan = json.loads(out)["plan"]
    assert code == 0, out
    st = plan["paged_state"]
    assert plan["kv_tokens"] == 800 and plan["kv_pool_bytes"] == 101 * LAYERS * 8 * 48 * 4
    assert st["kind"] == "latent" and st["values_per_token_layer"] == RANK + ROPE
    assert st["tokens_as_kv"] == 800 * 48 // (HEADS * (NOPE + ROPE + V))
    assert st["more_tokens_than_kv"] == 800 - st["tokens_as_kv"]
    assert cli.main(["suggest", "--model", path, "--num-kv-pages", "101"]) == 0
    text = capsys.readouterr().out
    assert f"latent: 48 values a token a layer where K/V of its heads would keep " \
           f"{HEADS * (NOPE + ROPE + V)}" in text


KIMI_K2 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
           "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
           "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
           "moe_layer_freq": 1, "rope_theta": 50000.0,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
                            "type": "yarn"}}


def test_kimi_k2_config_loads(checkpoint, tmp_path):
    """Kimi-K2's config.json (model_type kimi_k2, its own code in auto_map, DeepSeek-V3's
    architecture; 1 group, its scaling factor, YaRN in the old rope_scaling layout) over the
    tiny weights: served through DeepseekV3ForCausalLM, equal to transformers' DeepSeek-V3
    with that config."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    model, path = checkpoint
    kimi = tmp_path / "kimi"
    shutil.copytree(path, kimi)
    with open(kimi / "config.json") as f:
        hf = json.load(f)
    hf.pop("rope_parameters", None)
    hf.update(KIMI_K2)
    with open(kimi / "config.json", "w") as f:
        json.dump(hf, f)
    arch, cfg, params = load_checkpoint(str(kimi))
    assert arch.name == "DeepseekV3ForCausalLM" and cfg.n_group == 1
    assert cfg.routed_scaling_factor == 2.827 and cfg.rope_scaling[:5] == ("yarn", 32.0, 1.0,
                                                                            1.0, 16)
    ref_cfg = DeepseekV3Config(**{k: v for k, v in hf.items()
                                  if k not in ("auto_map", "model_type", "architectures")})
    ref = DeepseekV3ForCausalLM(ref_cfg).eval()
    ref.load_state_dict(model.state_dict())
    prompt = _prompts()[2]
    logits, tokens = paged_greedy(arch, cfg, params, [prompt], chunk=8, new_tokens=8,
                                  page_size=8)
    ref_logits, ref_tokens = hf_greedy(ref, prompt, 8)
    assert_logits_close(logits[0], ref_logits, rel=LOGIT_REL_TOL)
    assert tokens[0] == ref_tokens


def test_fp8_checkpoint_is_refused_in_one_line(checkpoint, tmp_path):
    from maxjax.errors import UserError
    from maxjax.models.loader import load_model
    _, path = checkpoint
    shutil.copytree(path, tmp_path / "fp8")
    with open(tmp_path / "fp8" / "config.json") as f:
        hf = json.load(f)
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(tmp_path / "fp8" / "config.json", "w") as f:
        json.dump(hf, f)
    with pytest.raises(UserError, match="quant_method fp8: quantized DeepSeek-V3 weights") as e:
        load_model(str(tmp_path / "fp8"), "float32", progress=False)
    assert "\n" not in str(e.value)


def test_list_shows_the_family_and_its_state(capsys):
    from maxjax import cli
    assert cli.main(["list", "--json"]) == 0
    rows = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    assert rows["DeepseekV3ForCausalLM"]["state"] == "latent"
    assert rows["LlamaForCausalLM"]["state"] == "kv"
    assert "Kimi-K2" in rows["DeepseekV3ForCausalLM"]["description"]
