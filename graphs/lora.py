"""LoRA in the graph: per target projection, every adapter slot's A [in, N, r] and B [N, r, out]
stacked, selected per token by the step's `lora_slot` (1..N; slot 0, the base model, is stored
nowhere: its one-hot row is all zeros); A is laid out [in, N, r] so both stacks flatten into
plain matmul operands.

Fused projections share one A: q|k|v's is [A_q | A_k | A_v] along the rank (one matmul for the
three), and keep one B per part ([N, r, out_q], [N, r, out_k], [N, r, out_v]): a fused B would be
block-diagonal, two thirds zeros that every decode step reads (BENCHMARKS.md, Multi-LoRA).
Loading an adapter writes its slot of these arrays (maxjax/lora/); the graph never changes.
"""
from __future__ import annotations

import jax

from maxjax.graphs import layers as L
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.sharding import ArraySpec

# fused parameter -> (HF module names in fusion order, logical axes of its in and out dims)
TARGETS = {
    "wqkv": (("q_proj", "k_proj", "v_proj"), ("embed", "qkv")),
    "wo": (("o_proj",), ("q_heads", "embed")),
    "w_gate_up": (("gate_proj", "up_proj"), ("embed", "gate_up")),
    "w_down": (("down_proj",), ("mlp", "embed")),
}


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module name -> (in, out) features of that projection."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (D, cfg.q_size), "k_proj": (D, cfg.kv_size), "v_proj": (D, cfg.kv_size),
            "o_proj": (cfg.q_size, D), "gate_proj": (D, F), "up_proj": (D, F),
            "down_proj": (F, D)}


def lora_specs(cfg: ModelConfig, num_slots: int, max_rank: int) -> list[dict]:
    """Per layer, per target: {"a": [in, N, parts * r], "b": ([N, r, out] per part)}, N =
    num_slots - 1 (slot 0 is not stored)."""
    shapes = module_shapes(cfg)
    n = num_slots - 1
    layer = {}
    for key, (modules, (ax_in, ax_out)) in TARGETS.items():
        d_in = shapes[modules[0]][0]
        r = len(modules) * max_rank
        layer[key] = {"a": ArraySpec((d_in, n, r), (ax_in, "lora_slots", "lora_rank")),
                      "b": tuple(ArraySpec((n, max_rank, shapes[m][1]),
                                           ("lora_slots", "lora_rank", ax_out)) for m in modules)}
    return [dict(layer) for _ in range(cfg.num_layers)]


def slot_onehot(lora_slot, num_stored: int, dtype):
    """[T, N] one-hot of each token's adapter slot over the stored slots 1..N (slot 0: zeros)."""
    return jax.nn.one_hot(lora_slot - 1, num_stored, dtype=dtype)


def with_adapters(p: dict, lora_layer: dict, onehot) -> dict:
    """One layer's parameters with every target wrapped in its LowRankDelta."""
    return {**p, **{k: L.LowRankDelta(p[k], ab["a"], ab["b"], onehot)
                    for k, ab in lora_layer.items()}}
