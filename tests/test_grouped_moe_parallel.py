"""The group-routed families (DeepSeek-V3 with MLA, GLM-4.5) on 4 forced CPU devices, at tensor
parallelism 4 and at expert parallelism 2 x tensor parallelism 2 (--ep-size 2: the experts split
over the expert axis, the rest over the model axis; MLA's one latent head stays whole): one ragged
step's logits equal one device's within 1e-4 (a sharded matmul sums in another order, measured
~4e-6; a dense MLP split with the wrong per-shard layout moved them by ~5)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxjax.graphs import quant, sharding
from maxjax.graphs.decoder import init_kv
from maxjax.graphs.step import RowSlice, build_step_inputs
from paged_harness import load_checkpoint
from reference import scramble_grouped_moe

pytestmark = pytest.mark.slow


def _deepseek_v3():
    from transformers import DeepseekV3ForCausalLM
    from test_deepseek_v3 import _config
    return DeepseekV3ForCausalLM(_config())


def _glm4_moe():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    return Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True, num_mtp_layers=0, eos_token_id=None, max_position_embeddings=512))


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    make = {"deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe}[request.param]
    model = scramble_grouped_moe(make().eval())
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _one_step(arch, cfg, params):
    """Logits of one ragged step: a 5-token prompt and 12-token chunks of two others."""
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, 256, n))) for n in (5, 20, 30)]
    rows = [RowSlice(p[:12], 0, [1 + r]) for r, p in enumerate(prompts)]
    step = build_step_inputs(rows, 32, 4, 1, 16)
    kv = init_kv(cfg, 4, 16, jnp.float32)
    logits, _ = jax.jit(lambda p, k, s: arch.forward(cfg, p, k, s))(params, kv, step)
    return np.asarray(logits)[:3]


@pytest.mark.parametrize("tp,ep", [(4, 1), (2, 2)], ids=["tp4", "ep2xtp2"])
def test_parallel_equals_one_device(checkpoint, tp, ep):
    arch, cfg, params = load_checkpoint(checkpoint)
    one = _one_step(arch, cfg, params)
    mesh = sharding.mesh_over(jax.devices()[:4], ep=ep)
    rules = sharding.mesh_rules(cfg, mesh)
    inner = sharding.MODEL_AXIS if ep > 1 else None
    axis = sharding.EXPERT_AXIS if ep > 1 else sharding.MODEL_AXIS
    assert (rules["experts"], rules["expert_mlp"]) == (axis, inner)
    ep_cfg, laid = sharding.tensor_parallel_layout(cfg, jax.tree.map(np.asarray, params), tp,
                                                   ep=ep)
    specs = quant.param_specs(arch.param_specs(ep_cfg), laid)
    placed = sharding.place(laid, specs, mesh, rules)
    E, F, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    # tp 4: each device 2 whole experts; ep 2 x tp 2: 4 experts, each's intermediate halved
    split, inner_f = (E // 4, F) if ep == 1 else (E // 2, F // 2)
    shards = {"experts_gate_up": (split, D, 2 * inner_f), "experts_down": (split, inner_f, D)}
    for key, shard in shards.items():
        assert {s.data.shape for s in placed["layers"][1][key].addressable_shards} == {shard}
    assert {s.data.shape for s in placed["layers"][0]["w_down"].addressable_shards} == \
        {(cfg.intermediate_size // tp, D)}
    np.testing.assert_allclose(_one_step(arch, ep_cfg, placed), one, rtol=1e-4, atol=1e-4)
