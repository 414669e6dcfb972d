"""gpt-oss (graphs/gpt_oss.py) against transformers on a tiny random checkpoint: sliding and full
layers alternating with a window of 8, attention sinks, q/k/v/o biases, YaRN rope, a biased
router and biased experts through the clamped SwiGLU (its limit low enough to clamp). The paged
graph's logits, greedy tokens through maxjax.LLM with other requests in the batch, int8, the
attention backend a model with sinks gets, and what is refused (MXFP4, GGUF, LoRA)."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxjax.errors import UserError
from maxjax.graphs import attention, cpu_kernels, moe, sharding
from maxjax.models import registry
from paged_harness import load_checkpoint, paged_greedy
from reference import assert_logits_close, hf_greedy
from tiny_llama import write_word_tokenizer

VOCAB, NEW_TOKENS = 512, 32
# float32 throughout: as tests/test_moe.py, 1e-3 of the largest logit (the routed sum's order
# differs from transformers' index_add_; a wrong expert, sink or window moves logits by ~1e-1).
LOGIT_REL_TOL = 1e-3
# int8 weights (per output channel) against float32 on the float model's own greedy text: its
# perplexity within 5% (measured 0.1%; the float perplexity ~27 of a vocabulary of 512).
INT8_PPL_RATIO = 1.05
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8)


def _model():
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=2.0,
        attention_bias=True, eos_token_id=None,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 128,
                         "rope_theta": 10000.0})
    return GptOssForCausalLM(cfg)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, directory of its float32 safetensors checkpoint and a tokenizer)."""
    torch.manual_seed(0)
    model = _model().eval()
    with torch.no_grad():
        # Initialization zeroes the biases and keeps activations far below the clamp: make
        # every parameter count.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")) or name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return model, str(path)


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(3, VOCAB, n))) for n in (5, 13, 29)]


def test_config(checkpoint):
    _, path = checkpoint
    _, cfg, params = load_checkpoint(path)
    assert cfg.layer_windows == (8, 0) and cfg.attention_sinks and cfg.attention_out_bias
    assert cfg.rope_scaling[:6] == ("yarn", 4.0, 8.0, 1.0, 128, False)
    assert cfg.clamped_swiglu == (1.702, 2.0) and cfg.norm_topk_prob and cfg.moe_bias
    layer = params["layers"][0]
    assert layer["sinks"].shape == (4,) and layer["bo"].shape == (64,)
    assert layer["experts_gate_up_bias"].shape == (4, 64) and layer["router_bias"].shape == (4,)


def test_paged_graph_matches_transformers(checkpoint):
    """A 29-token prompt prefilled in chunks of 8 and 8 greedy tokens: past the window."""
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    prompt = _prompts()[2]
    logits, tokens = paged_greedy(arch, cfg, params, [prompt], chunk=8, new_tokens=8,
                                  page_size=8)
    ref_logits, ref_tokens = hf_greedy(model, prompt, 8)
    assert_logits_close(logits[0], ref_logits, rel=LOGIT_REL_TOL)
    assert tokens[0] == ref_tokens


def test_routed_block_matches_transformers(checkpoint):
    """The routed MLP of layer 1 (router bias, softmax over the top k, interleaved gate|up,
    clamped SwiGLU, expert biases) on the states transformers gives it, both grouped forms."""
    model, path = checkpoint
    _, cfg, params = load_checkpoint(path)
    block = model.model.layers[1].mlp
    seen = {}
    handle = block.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out[0]))
    with torch.no_grad():
        model(torch.tensor([_prompts()[2]]))
        handle.remove()
        x = seen["x"][0]
        _, hf_weights, hf_idx = block.router(x)
    p = params["layers"][1]
    weights, experts = moe.route(jnp.asarray(x.numpy()), p["router"], 2, True, p["router_bias"])
    np.testing.assert_array_equal(np.asarray(experts), hf_idx.numpy())
    np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), rtol=1e-5, atol=1e-6)
    for grouped in (moe.grouped_blocks, moe.grouped_ragged):
        out = moe.moe_mlp(cfg, jnp.asarray(x.numpy()), p, grouped=grouped)
        np.testing.assert_allclose(np.asarray(out), seen["y"][0].numpy(), rtol=1e-4, atol=1e-5)


def test_expert_parallel_with_biases_equals_one_device(checkpoint):
    _, path = checkpoint
    _, cfg, params = load_checkpoint(path)
    ep_cfg, laid = sharding.tensor_parallel_layout(cfg, jax.tree.map(np.asarray, params), 4)
    assert ep_cfg.expert_shards == 4
    specs = sharding.tensor_parallel_rules(cfg, 4)
    layer_specs = moe.layer_specs(cfg, {})
    placed = sharding.place({k: laid["layers"][1][k] for k in layer_specs}, layer_specs,
                            sharding.tensor_parallel_mesh(4), specs)
    assert placed["experts_down_bias"].addressable_shards[0].data.shape == (1, 64)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((24, 64)), jnp.float32)
    four = jax.jit(lambda h, p: moe.moe_mlp(ep_cfg, h, p))(x, placed)
    one = moe.moe_mlp(cfg, x, params["layers"][1])
    np.testing.assert_allclose(np.asarray(four), np.asarray(one), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """The checkpoint through maxjax's loader (float32)."""
    from maxjax.models.loader import load_model
    return load_model(checkpoint[1], "float32", progress=False)


@pytest.mark.slow   # an engine's graphs: ~25 s of this module's ~55 on two shared cores
def test_engine_greedy_equals_transformers_generate(checkpoint, loaded):
    """Three prompts of different lengths batched (--max-batch-size 4), 32 new tokens each,
    with this machine's defaults (the CPU kernels on where they run)."""
    from maxjax.engine.types import SamplingParams
    from maxjax.llm import LLM
    model, _ = checkpoint
    llm = LLM(loaded, **ENGINE)
    assert llm.core.layout.attention == "query_blocks"
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_prompts(), greedy)
    for prompt, out in zip(_prompts(), outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


def test_sinks_choose_the_query_block_backend(loaded, monkeypatch):
    """With the CPU kernels on (this machine's default where they run) an engine for gpt-oss
    plans the query-block attention: the CPU and Pallas kernels have no sinks."""
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.plan import plan_engine
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda isa=None: None)
    plan = plan_engine(EngineConfig(**ENGINE), loaded, kernels=True)
    assert plan.config.use_experimental_kernels is True
    assert plan.layout.attention == "query_blocks"
    assert attention.choose_backend("cpu", 16, 8, kernels=True).name == "cpu_paged_kernel"
    assert attention.choose_backend("cuda", 64, 16).name == "pallas_paged"
    for platform in ("cpu", "cuda"):
        assert attention.choose_backend(platform, 16, 8, True, sinks=True).name == "query_blocks"


def test_int8_perplexity_close_to_float(checkpoint):
    """Perplexity of the float model's greedy continuation (24 tokens after an 8-token prompt)
    in one 32-token step, float32 against int8 weights."""
    from maxjax.graphs.decoder import hidden_states, init_kv, lm_logits
    from maxjax.graphs.step import RowSlice, build_step_inputs
    model, path = checkpoint
    prompt = _prompts()[2][:8]
    tokens = prompt + hf_greedy(model, prompt, 24)[1]

    step = build_step_inputs([RowSlice(tokens, 0, [1, 2, 3, 4])], 32, 1, 4, 8)

    def ppl(quantized):
        _, cfg, params = load_checkpoint(path, int8=quantized)

        @jax.jit
        def nll(params, step):
            h, _ = hidden_states(cfg, params, init_kv(cfg, 5, 8, jnp.float32), step)
            logp = jax.nn.log_softmax(lm_logits(cfg, params, h[7:31]), axis=-1)
            return -jnp.mean(logp[jnp.arange(24), jnp.asarray(tokens[8:])])
        return float(jnp.exp(nll(params, step)))
    base, q = ppl(False), ppl(True)
    assert base < VOCAB / 10 and q / base < INT8_PPL_RATIO, (base, q)


def test_mxfp4_is_refused_in_one_line(checkpoint, tmp_path):
    from maxjax.models.loader import load_model
    _, path = checkpoint
    shutil.copytree(path, tmp_path / "mxfp4")
    with open(tmp_path / "mxfp4" / "config.json") as f:
        hf = json.load(f)
    hf["quantization_config"] = {"quant_method": "mxfp4"}
    with open(tmp_path / "mxfp4" / "config.json", "w") as f:
        json.dump(hf, f)
    with pytest.raises(UserError, match="config.json quantization_config quant_method mxfp4: "
                       "MXFP4 weights are not supported yet") as e:
        load_model(str(tmp_path / "mxfp4"), "float32", progress=False)
    assert "\n" not in str(e.value) and str(tmp_path / "mxfp4") in str(e.value)
    # the expert blocks without the config's word: refused by their tensor name
    arch, cfg, _ = load_checkpoint(path)
    get = lambda name: None                                            # noqa: E731
    get.names = lambda: ["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    with pytest.raises(UserError, match="gate_up_proj_blocks: MXFP4 weights are not supported"):
        arch.params_from_hf(cfg, get, jnp.float32)


def test_gguf_and_lora_are_refused(checkpoint):
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.plan import check_model_flags
    _, path = checkpoint
    _, cfg, _ = load_checkpoint(path)
    with pytest.raises(UserError, match="unsupported GGUF architecture 'gpt-oss'"):
        registry.for_gguf_arch("gpt-oss")
    with pytest.raises(UserError, match="--enable-lora: GptOssForCausalLM routes its MLPs"):
        check_model_flags(EngineConfig(enable_lora=True), cfg)


def test_list_shows_gpt_oss(capsys):
    from maxjax.cli.main import main
    assert main(["list", "--json"]) == 0
    archs = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    assert "gpt-oss" in json.dumps(archs["GptOssForCausalLM"])
