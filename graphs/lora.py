"""LoRA in the graph: per target projection, every adapter slot's A [in, S, r] and B [S, r, out]
stacked (slot 0 all zeros: the base model), selected per token by the step's `lora_slot`; A is
laid out [in, S, r] so both stacks flatten into plain matmul operands.

Fused projections hold their parts' adapters side by side: q|k|v's A is [A_q | A_k | A_v] along
the rank and its B block-diagonal, so one matmul pair serves all three (rank 3r, exact).
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
    """Per layer, per target: {"a": [in, S, parts * r], "b": [S, parts * r, out]}."""
    shapes = module_shapes(cfg)
    layer = {}
    for key, (modules, (ax_in, ax_out)) in TARGETS.items():
        d_in = shapes[modules[0]][0]
        d_out = sum(shapes[m][1] for m in modules)
        r = len(modules) * max_rank
        layer[key] = {"a": ArraySpec((d_in, num_slots, r), (ax_in, "lora_slots", "lora_rank")),
                      "b": ArraySpec((num_slots, r, d_out), ("lora_slots", "lora_rank", ax_out))}
    return [dict(layer) for _ in range(cfg.num_layers)]


def slot_onehot(lora_slot, num_slots: int, dtype):
    """[T, S] one-hot of each token's adapter slot."""
    return jax.nn.one_hot(lora_slot, num_slots, dtype=dtype)


def with_adapters(p: dict, lora_layer: dict, onehot) -> dict:
    """One layer's parameters with every target wrapped in its LowRankDelta."""
    return {**p, **{k: L.LowRankDelta(p[k], ab["a"], ab["b"], onehot)
                    for k, ab in lora_layer.items()}}
