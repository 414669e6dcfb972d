"""The newer MoE families (DeepSeek-V3 with MLA, GLM-4.5; the hybrids Qwen3-Next, Qwen3.5 MoE
and Granite 4, whose request-state pools and linear layers stay whole) on 4 forced CPU devices, at tensor
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
from families import MAKERS
from paged_harness import load_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe",
                                        "granitemoehybrid"])
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    model = MAKERS[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _one_step(arch, cfg, params):
    """Logits of one ragged step: a 5-token prompt and 12-token chunks of two others."""
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, 256, n))) for n in (5, 20, 30)]
    hybrid = any(cfg.state_layers)
    rows = [RowSlice(p[:12], 0, [1 + r], state_slot=1 + r if hybrid else 0)
            for r, p in enumerate(prompts)]
    step = build_step_inputs(rows, 32, 4, 1, 16, state=hybrid)
    kv = init_kv(cfg, 4, 16, jnp.float32, state_slots=4 if hybrid else 0)
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
    layers = placed["layers"]
    routed = next(p for p in layers if "experts_down" in p)
    for key, shard in shards.items():
        assert {s.data.shape for s in routed[key].addressable_shards} == {shard}
    for dense in (p for p in layers if "w_down" in p):
        assert {s.data.shape for s in dense["w_down"].addressable_shards} == \
            {(cfg.intermediate_size // tp, D)}
    np.testing.assert_allclose(_one_step(arch, ep_cfg, placed), one, rtol=1e-4, atol=1e-4)
