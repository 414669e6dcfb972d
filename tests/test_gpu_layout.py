"""The GPU side of the engine layout, on the CPU: platform defaults (rows, token budget, dtype),
the GPU bucket set and attention backend, and the KV pool planned from a fake device's memory."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.engine import memory
from maxjax.engine.buckets import Bucket
from maxjax.engine.config import EngineConfig
from maxjax.engine.plan import local_platform, plan_layout
from maxjax.errors import UserError
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.decoder import abstract_params
from maxjax.engine.encoding import default_dtype

GiB = 1 << 30
# Llama-3-8B's shapes
LLAMA_8B = ModelConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, max_position_embeddings=8192)


class FakeGpu:
    """What the planner reads of a jax device."""
    platform = "gpu"

    def __init__(self, limit: int, in_use: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


class FakeModel:
    def __init__(self, cfg, dtype=jnp.bfloat16):
        self.config, self.params = cfg, abstract_params(cfg, dtype)
        self.compute_dtype = dtype


def test_platform_defaults():
    flags = EngineConfig()
    assert (flags.max_batch_size, flags.max_batch_input_tokens) == (None, None)   # as given
    cpu = flags.for_platform("cpu")
    assert (cpu.max_batch_size, cpu.max_batch_input_tokens) == (32, 256)
    cpu = cpu.for_platform("cuda")
    assert (cpu.max_batch_size, cpu.max_batch_input_tokens) == (256, 4096)
    assert cpu.is_default("max_batch_size")
    given = EngineConfig(max_batch_size=8)
    given = given.for_platform("cuda")
    assert (given.max_batch_size, given.max_batch_input_tokens) == (8, 4096)
    assert not given.is_default("max_batch_size")
    assert default_dtype("cuda") == "bfloat16" and default_dtype("cpu") == "float32"


def test_gpu_bucket_set_and_attention():
    cfg = EngineConfig(num_kv_pages=1000)
    cfg = cfg.for_platform("cuda")
    lay = plan_layout(cfg, FakeModel(LLAMA_8B), "cuda")
    assert (lay.platform, lay.attention) == ("cuda", "pallas_paged")
    assert [b.num_tokens for b in lay.buckets] == [1 << i for i in range(13)]   # 1 .. 4096
    assert max(b.num_rows for b in lay.buckets) == 256
    assert all(b.num_rows == min(b.num_tokens, 256) for b in lay.buckets)
    # --max-length unset: the model's max_position_embeddings (the 1000 pages hold a row of it)
    assert lay.max_length == 8192 and lay.max_pages_per_row == 256
    odd_heads = dataclasses.replace(LLAMA_8B, head_dim=80, num_heads=40)
    assert plan_layout(cfg, FakeModel(odd_heads), "cuda").attention == "query_blocks"
    cpu = plan_layout(EngineConfig(num_kv_pages=1000), FakeModel(LLAMA_8B), "cpu")
    assert (cpu.platform, cpu.attention, cpu.buckets[-1]) == ("cpu", "query_blocks",
                                                              Bucket(256, 32))


def test_gpu_layout_errors_name_the_flag():
    # graphs for another platform than this machine's: no device to plan the pool from
    other = "cuda" if local_platform() == "cpu" else "cpu"
    cfg = EngineConfig().for_platform(other)
    with pytest.raises(UserError, match=f"--num-kv-pages is needed for graphs that run on {other}"):
        plan_layout(cfg, FakeModel(LLAMA_8B), other)
    with pytest.raises(UserError, match="--kv-cache-page-size 24: the GPU attention kernel"):
        plan_layout(EngineConfig(num_kv_pages=10, kv_cache_page_size=24), FakeModel(LLAMA_8B),
                    "cuda")


def test_pool_from_fake_h200_memory():
    """141 GiB device, 8B weights resident: pool = 0.9 x (free + weights) - weights -
    activations of the largest bucket, in pages of 32 tokens, rounded down to 3 bits."""
    model = FakeModel(LLAMA_8B)
    weights = sum(math.prod(a.shape) * 2 for a in jax.tree.leaves(model.params))
    assert 16.0e9 < weights < 16.1e9
    dev = FakeGpu(141 * GiB, weights + GiB // 2)
    largest = Bucket(4096, 256)
    plan = memory.plan_pool(LLAMA_8B, model.params, 32, 0.9, [Bucket(1, 1), largest], 1 << 20,
                            device=dev)
    page = 2 * 32 * 32 * 8 * 128 * 2
    act = 4096 * (3 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) * 2 + (3 * 256 + 2 * 4096) * 128256 * 4
    assert (plan.page_bytes, plan.weight_bytes, plan.activation_bytes) == (page, weights, act)
    fit = (int((141 * GiB - GiB // 2) * 0.9) - weights - act) // page
    assert plan.num_pages == memory.round_down(fit) and plan.num_pages <= fit < plan.num_pages * 1.25
    assert plan.largest_bucket == "step_t4096_r256" and not plan.capped
    assert "GiB free x 0.90 - weights 14.96 GiB - activations of step_t4096_r256" in plan.report()
    # a pool no row could fill is capped at every row at max length
    capped = memory.plan_pool(LLAMA_8B, model.params, 32, 0.9, [largest], 4097, device=dev)
    assert capped.num_pages == 4097 and capped.capped
    # the memory a second process holds is not the engine's
    busy = memory.plan_pool(LLAMA_8B, model.params, 32, 0.9, [largest], 1 << 20,
                            device=FakeGpu(141 * GiB, weights + 100 * GiB))
    assert busy.num_pages < plan.num_pages // 4


def test_plan_layout_on_a_fake_gpu(monkeypatch):
    """plan_layout on a (fake) CUDA machine sizes the pool from its memory and says how."""
    from maxjax.engine import plan
    monkeypatch.setattr(plan, "local_platform", lambda: "cuda")
    monkeypatch.setattr(memory.jax, "devices", lambda: [FakeGpu(141 * GiB, 17 * GiB)])
    cfg = EngineConfig()
    cfg = cfg.for_platform("cuda")
    lay = plan_layout(cfg, FakeModel(LLAMA_8B))
    assert lay.platform == "cuda" and 16384 <= lay.num_pages < 32769
    assert lay.memory_report.startswith("KV pool ") and "on cuda (" in lay.memory_report
    monkeypatch.setattr(memory.jax, "devices", lambda: [FakeGpu(20 * GiB, 17 * GiB)])
    with pytest.raises(UserError, match="the KV pool would have 0 pages"):
        plan_layout(cfg, FakeModel(LLAMA_8B))


def test_weight_bytes_of_real_arrays():
    params = {"embed": jnp.zeros((10, 4), jnp.bfloat16), "w": np.zeros((3,), np.float32)}
    assert memory.weight_bytes(params) == 10 * 4 * 2 + 3 * 4
