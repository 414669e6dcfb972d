"""Mixture-of-experts families (graphs/moe.py, graphs/qwen3_moe.py, graphs/mixtral.py) against
transformers on tiny random checkpoints: greedy parity through the paged graph with chunked
prefill and several sequences per step, routing counts per expert against transformers' router,
the grouped compute against a plain per-token reference, and int8 expert weights."""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxjax.graphs import moe, quant, sharding
from maxjax.graphs.config import MOE_FIELDS
from maxjax.models import quantize, registry
from paged_harness import load_checkpoint, paged_greedy
from reference import assert_logits_close, hf_greedy
from tiny_llama import write_word_tokenizer

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

VOCAB, NEW_TOKENS = 512, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, num_hidden_layers=2, num_experts_per_tok=2)
# float32 throughout; the grouped compute sums each token's k expert outputs in another order
# than transformers' index_add_, which moves logits by ~1e-6 of their scale: 1e-3 of the largest
# logit (the other parity tests' bound) leaves room for that and nothing like a wrong expert.
LOGIT_REL_TOL = 1e-3


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    # layer 0 dense (mlp_only_layers), layer 1 routed: 8 experts, top 2, renormalised
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, intermediate_size=128, moe_intermediate_size=32, head_dim=32, num_experts=8,
        norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4))


MODELS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral}


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    """(transformers model, directory of its safetensors checkpoint)."""
    torch.manual_seed(0)
    model = MODELS[request.param]().eval()
    with torch.no_grad():
        # Norms start at 1; randomize them, and give the router logits a spread so that routing
        # decisions are clear (initialization leaves them near-tied).
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(0, VOCAB, n))) for n in (5, 40, 90)]


def _one_step(arch, cfg, params):
    """Logits of one ragged step: a 5-token prompt and 24-token chunks of two others (64 token
    slots, 11 of them padding)."""
    from maxjax.graphs.decoder import init_kv
    from maxjax.graphs.step import RowSlice, build_step_inputs
    rows = [RowSlice(p[:24], 0, [1 + 2 * r, 2 + 2 * r]) for r, p in enumerate(_prompts())]
    step = build_step_inputs(rows, 64, 4, 2, 16)
    kv = init_kv(cfg, 8, 16, jnp.float32)
    logits, _ = jax.jit(lambda p, k, s: arch.forward(cfg, p, k, s))(params, kv, step)
    return np.asarray(logits)[:3]


@functools.cache
def _one_device_step(path: str, int8: bool):
    """_one_step of the checkpoint's params on one device, computed once per (path, int8)."""
    arch, cfg, params = load_checkpoint(path, int8=int8)
    return _one_step(arch, cfg, params)


def test_paged_graph_matches_transformers(checkpoint):
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    prompts = _prompts()
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=24, new_tokens=NEW_TOKENS,
                                  page_size=16)
    for prompt, ours, our_tokens in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, NEW_TOKENS)
        assert_logits_close(ours, ref_logits, rel=LOGIT_REL_TOL)
        assert our_tokens == ref_tokens


def test_configs_and_param_layout(checkpoint):
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    if cfg.architecture == "Qwen3MoeForCausalLM":
        assert cfg.moe_layers == (False, True) and cfg.qk_norm and cfg.norm_topk_prob
        assert (cfg.num_experts, cfg.expert_intermediate_size) == (8, 32)
        assert "w_gate_up" in params["layers"][0] and "router" not in params["layers"][0]
    else:
        assert cfg.moe_layers == (True, True) and cfg.norm_topk_prob
        assert (cfg.num_experts, cfg.expert_intermediate_size) == (4, 64)
    assert cfg.experts_per_token == 2
    layer = params["layers"][1]
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    assert layer["experts_gate_up"].shape == (E, D, 2 * F)
    assert layer["experts_down"].shape == (E, F, D)
    specs = arch.param_specs(cfg)["layers"][1]
    assert specs["experts_gate_up"].axes[0] == specs["experts_down"].axes[0] == "experts"


def test_dense_families_keep_their_config():
    """The new ModelConfig fields default off: a dense family's config routes nothing."""
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = registry.get_architecture("Qwen3ForCausalLM").config_from_hf(hf)
    assert cfg.moe_layers == () and cfg.num_experts == 0
    # ... and its fingerprint (maxjax/aot/manifest.py digests to_dict) does not name them
    assert not set(MOE_FIELDS) & set(cfg.to_dict())
    assert all("router" not in lay for lay in
               registry.get_architecture("Qwen3ForCausalLM").param_specs(cfg)["layers"])


def _moe_block_and_input(model, cfg):
    """transformers' routed block of layer 1, and the hidden states it sees for a prompt."""
    block = model.model.layers[1].mlp if cfg.architecture == "Qwen3MoeForCausalLM" else \
        model.model.layers[1].mlp
    seen = {}
    handle = block.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(torch.tensor([_prompts()[2]]))
    handle.remove()
    return block, seen["x"][0], seen["y"][0]


def test_routed_counts_match_transformers_router(checkpoint):
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    block, x, y = _moe_block_and_input(model, cfg)
    with torch.no_grad():
        _, hf_weights, hf_idx = block.gate(x)
    hf_counts = np.bincount(hf_idx.numpy().reshape(-1), minlength=cfg.num_experts)
    p = params["layers"][1]
    weights, experts = moe.route(jnp.asarray(x.numpy()), p["router"], cfg.experts_per_token,
                                 cfg.norm_topk_prob)
    ours = np.asarray(moe.routed_counts(experts, cfg.num_experts))
    np.testing.assert_array_equal(ours, hf_counts)
    assert ours.sum() == x.shape[0] * cfg.experts_per_token and (ours > 0).sum() > 1
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(hf_idx.numpy(), -1))
    np.testing.assert_allclose(np.sort(np.asarray(weights), -1),
                               np.sort(hf_weights.numpy(), -1), rtol=1e-5, atol=1e-6)
    # and the whole routed MLP on those states equals transformers' block
    out = moe.moe_mlp(cfg, jnp.asarray(x.numpy()), p)
    np.testing.assert_allclose(np.asarray(out), y.numpy(), rtol=1e-4, atol=1e-5)


def test_padding_slots_route_nowhere_and_do_not_move_real_rows(checkpoint):
    model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    _, x, _ = _moe_block_and_input(model, cfg)
    x = jnp.asarray(x.numpy())[:24]
    padded = jnp.concatenate([x, 100.0 * jnp.ones((8, x.shape[1]), x.dtype)])
    p = params["layers"][1]
    run = jax.jit(lambda h, live: moe.moe_mlp(cfg, h, p, live))
    out = np.asarray(run(padded, jnp.int32(24)))
    np.testing.assert_allclose(out[:24], np.asarray(moe.moe_mlp(cfg, x, p)), rtol=1e-5,
                               atol=1e-6)
    assert not np.any(out[24:])
    _, experts = moe.route(padded, p["router"], cfg.experts_per_token, cfg.norm_topk_prob)
    assert int(moe.routed_counts(experts, cfg.num_experts, 24).sum()) == 24 * cfg.experts_per_token


@pytest.mark.parametrize("rows", [1, 3, 32, 200])
def test_grouped_blocks_equal_ragged_dot_and_a_per_token_loop(checkpoint, rows):
    _, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    p = params["layers"][1]
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cfg.hidden_size)),
                    jnp.float32)
    blocks = np.asarray(jax.jit(lambda h: moe.moe_mlp(cfg, h, p))(x))
    ragged = np.asarray(moe.moe_mlp(cfg, x, p, grouped=moe.grouped_ragged))
    np.testing.assert_allclose(blocks, ragged, rtol=1e-5, atol=1e-5)
    weights, experts = moe.route(x, p["router"], cfg.experts_per_token, cfg.norm_topk_prob)
    wgu, wd = np.asarray(p["experts_gate_up"]), np.asarray(p["experts_down"])
    F = cfg.expert_intermediate_size
    want = np.zeros_like(blocks)
    for t in range(rows):
        for w, e in zip(np.asarray(weights[t]), np.asarray(experts[t])):
            gu = np.asarray(x[t]) @ wgu[e]
            h = gu[:F] / (1 + np.exp(-gu[:F])) * gu[F:]
            want[t] += w * (h @ wd[e])
    np.testing.assert_allclose(blocks, want, rtol=1e-4, atol=1e-5)


def test_int8_experts_stay_close_to_float(checkpoint):
    """int8 per expert and output channel (routers float): a step's logits stay within 3% of
    the float logits' scale (two-digit activations and int8 weights give ~0.5% on dense
    models, tests/test_quant.py)."""
    _, path = checkpoint
    arch, cfg, _ = load_checkpoint(path)
    _, _, qparams = load_checkpoint(path, int8=True)
    layer = qparams["layers"][1]
    assert isinstance(layer["experts_gate_up"], quant.QuantizedWeight)
    assert layer["experts_gate_up"].q.dtype == jnp.int8
    E, F = cfg.num_experts, cfg.expert_intermediate_size
    assert layer["experts_gate_up"].scale.shape == (E, 2 * F)
    assert layer["router"].dtype == jnp.float32
    abstract = quantize.abstract_params(arch.param_specs(cfg), "int8")
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), qparams)
    quant.param_specs(arch.param_specs(cfg), qparams)      # specs derive for the 3-D stacks
    assert_logits_close(_one_device_step(path, True), _one_device_step(path, False), rel=0.03)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_expert_parallel_on_four_devices_equals_one(checkpoint, quantized):
    """The tensor-parallel layout on 4 devices splits the experts whole (expert parallelism):
    each device holds E/4 experts, runs the pairs routed to them, and the step's logits equal
    one device's (summation order aside)."""
    _, path = checkpoint
    arch, cfg, params = load_checkpoint(path, int8=quantized)
    n = 4
    rules = sharding.tensor_parallel_rules(cfg, n)
    assert rules["experts"] == sharding.MODEL_AXIS
    ep_cfg, laid = sharding.tensor_parallel_layout(cfg, jax.tree.map(np.asarray, params), n)
    assert ep_cfg.expert_shards == n
    specs = quant.param_specs(arch.param_specs(ep_cfg), laid)
    placed = sharding.place(laid, specs, sharding.tensor_parallel_mesh(n), rules)
    stack = placed["layers"][1]["experts_down"]
    stack = stack.q if quantized else stack
    assert {s.data.shape[0] for s in stack.addressable_shards} == {cfg.num_experts // n}
    np.testing.assert_allclose(_one_step(arch, ep_cfg, placed), _one_device_step(path, quantized),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
def test_expert_parallel_2_by_tensor_parallel_2_equals_one_device(checkpoint, quantized):
    """--ep-size 2 on 4 devices: a 2-D mesh (expert 2, model 2). Attention and the dense MLP
    split over the model axis, each expert stack over the expert axis and each expert's
    intermediate over the model axis; the step's logits equal one device's."""
    _, path = checkpoint
    arch, cfg, params = load_checkpoint(path, int8=quantized)
    mesh = sharding.mesh_over(jax.devices()[:4], ep=2)
    assert dict(mesh.shape) == {sharding.EXPERT_AXIS: 2, sharding.MODEL_AXIS: 2}
    rules = sharding.mesh_rules(cfg, mesh)
    assert (rules["experts"], rules["expert_mlp"], rules["qkv"]) == \
        (sharding.EXPERT_AXIS, sharding.MODEL_AXIS, sharding.MODEL_AXIS)
    ep_cfg, laid = sharding.tensor_parallel_layout(cfg, jax.tree.map(np.asarray, params), 2, ep=2)
    assert (ep_cfg.expert_shards, ep_cfg.expert_mesh, ep_cfg.qkv_shards) == (2, (2, 2), 2)
    specs = quant.param_specs(arch.param_specs(ep_cfg), laid)
    placed = sharding.place(laid, specs, mesh, rules)
    E, F, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    for key, shard in (("experts_gate_up", (E // 2, D, F)), ("experts_down", (E // 2, F // 2, D))):
        stack = placed["layers"][1][key]
        stack = stack.q if quantized else stack
        assert {s.data.shape for s in stack.addressable_shards} == {shard}
    np.testing.assert_allclose(_one_step(arch, ep_cfg, placed), _one_device_step(path, quantized),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("devices,ep,why", [
    ("cpu:4", 3, "--ep-size 3 does not divide the 4 devices"),
    ("cpu", 2, "--ep-size 2 does not divide the 1 device "),
    ("cpu:4", 0, "--ep-size must be >= 1"),
])
def test_ep_size_refusals_for_devices(devices, ep, why):
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.plan import check_flags, check_mesh_flags, replica_mesh
    from maxjax.errors import UserError
    flags = EngineConfig(devices=devices, ep_size=ep)
    with pytest.raises(UserError, match=why):
        check_flags(flags)
        check_mesh_flags(flags, replica_mesh(flags))


def test_ep_size_refusals_for_models(checkpoint):
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.plan import check_mesh_flags, replica_mesh
    from maxjax.errors import UserError
    _, path = checkpoint
    _, cfg, _ = load_checkpoint(path)
    flags = EngineConfig(devices="cpu:4", ep_size=4)
    check_mesh_flags(flags, replica_mesh(flags), cfg)       # 4 and 8 experts: both divide
    dense = registry.get_architecture("Qwen3ForCausalLM").config_from_hf(
        {"architectures": ["Qwen3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})
    with pytest.raises(UserError, match="--ep-size 4: Qwen3ForCausalLM is a dense model"):
        check_mesh_flags(flags, replica_mesh(flags), dense)
    odd = dataclasses.replace(cfg, num_experts=6)
    flags = EngineConfig(devices="cpu:4", ep_size=4)
    with pytest.raises(UserError, match=f"--ep-size 4 does not divide the 6 experts of "
                                        f"{cfg.architecture}"):
        check_mesh_flags(flags, replica_mesh(flags), odd)


def test_engine_serves_moe_on_one_and_four_devices(checkpoint):
    """Through the loader and the engine (scheduler, buckets, sampling): the same greedy tokens
    on one device, with the experts split over four (--devices cpu:4), and on the 2-D mesh of
    --ep-size 2 (experts over its expert axis, their intermediate and attention over its model
    axis); int8 serves."""
    from maxjax.engine.types import SamplingParams
    from maxjax.llm import LLM
    from maxjax.models.loader import load_model
    _, path = checkpoint
    if "mixtral" in path:
        pytest.skip("one family through the engine; the graph-level tests cover both")
    write_word_tokenizer(path, VOCAB)     # the engine needs a tokenizer
    model = load_model(path, "float32", progress=False)
    # a 4-token budget: 3 graphs per engine (not 5), prompts still prefilled in shared chunks
    engine = dict(max_batch_size=4, max_batch_input_tokens=4, max_length=64, num_kv_pages=24,
                  kv_cache_page_size=8)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [p[:20] for p in _prompts()]
    one = LLM(model, **engine).generate(prompts, greedy)
    llm = LLM(model, devices="cpu:4", **engine)
    four = llm.generate(prompts, greedy)
    assert [o.token_ids for o in four] == [o.token_ids for o in one]
    assert llm.core.model.config.expert_shards == 4
    stack = llm.core.model.params["layers"][1]["experts_gate_up"]
    assert stack.sharding.spec[0] == sharding.MODEL_AXIS
    llm = LLM(model, devices="cpu:4", ep_size=2, **engine)
    stack = llm.core.model.params["layers"][1]["experts_down"]
    assert dict(stack.sharding.mesh.shape) == {sharding.EXPERT_AXIS: 2, sharding.MODEL_AXIS: 2}
    assert stack.sharding.spec[:2] == (sharding.EXPERT_AXIS, sharding.MODEL_AXIS)
    assert llm.core.model.config.expert_mesh == (2, 2)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [o.token_ids for o in one]
    # int8 through the loader and the engine (its CPU kernels pack the 2-D matrices only)
    int8 = LLM(load_model(path, "int8", progress=False), **engine)
    assert int8.core.model.params["layers"][1]["experts_down"].q.ndim == 3
    assert [len(o.token_ids) for o in int8.generate(prompts, greedy)] == [12] * len(prompts)


def test_lora_on_moe_is_refused(checkpoint):
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.plan import check_model_flags
    from maxjax.errors import UserError
    _, path = checkpoint
    _, cfg, _ = load_checkpoint(path)
    with pytest.raises(UserError, match="--enable-lora: .* routes its MLPs over experts"):
        check_model_flags(EngineConfig(enable_lora=True), cfg)


def test_list_shows_the_moe_families(capsys):
    from maxjax.cli.main import main
    assert main(["list", "--json"]) == 0
    names = {a["name"] for a in json.loads(capsys.readouterr().out)}
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM"} <= names
