"""The state a model keeps per token in the paged pool, declared once per kind.

A model's `ModelConfig.paged_state` names its kind; the kind says which pools the pool pytree
holds and each pool's (heads, values) per token per layer. graphs/decoder.py `kv_pool_specs`
builds the pool from it (and so the step graphs, the zero pool, the sharding and the artifacts'
pool signature), maxjax/engine/memory.py `page_bytes` sizes the memory plan from it, and the
config's `to_dict` (the artifacts' model fingerprint) carries the kind's name.

  kv      K and V: two pools of num_kv_heads x head_dim values a token a layer (GQA, MHA, MQA).
  latent  MLA (DeepSeek-V3): one pool of one compressed latent a token a layer, the normed
          kv_lora_rank projection then the roped qk_rope_head_dim key (graphs/deepseek_v3.py);
          attention reads it as one KV head of head_dim = kv_lora_rank + qk_rope_head_dim,
          the up-projections folded into the query and the output.

A hybrid model (Qwen3-Next and Qwen3.5: Gated DeltaNet; Granite 4: Mamba2) also has layers that
keep no per-token state but a fixed-size one per request (`ModelConfig.state_layers`): a short
convolution's last inputs and a recurrent state, declared by `RECURRENT`. Its pools follow the
paged ones in the pool pytree, each [state layers, slots, ...]; a request holds one slot from its
first step to its end (StepInputs.state_slot; slot 0 is scratch, as page 0 is), and the graphs
(graphs/recurrent.py) read it at the request's first token of a step (zero at position 0) and
write it back after its last. The paged pools then have one layer per attention layer only.
The prefix cache's state snapshots take more slots of the same pools, after the requests'
(graphs/snapshots.py copies a row's state from or to one around the step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class PagedState:
    name: str
    description: str
    # cfg -> ((heads, values), ...): each pool's values a token a layer
    pools: Callable[..., tuple[tuple[int, int], ...]]
    # cfg -> the values a token a layer the same attention keeps as expanded K and V (what a
    # GQA cache of its heads would hold); the kv kind's own
    expanded_values: Callable[..., int]

    def values_per_token(self, cfg) -> int:
        """Values a token keeps over every paged layer."""
        return len(paged_layers(cfg)) * sum(h * d for h, d in self.pools(cfg))


KV = PagedState("kv", "paged K/V a token a layer",
                pools=lambda cfg: ((cfg.num_kv_heads, cfg.head_dim),) * 2,
                expanded_values=lambda cfg: 2 * cfg.num_kv_heads * cfg.head_dim)
LATENT = PagedState(
    "latent", "paged MLA latent (kv_lora_rank + qk_rope_head_dim) a token a layer",
    pools=lambda cfg: ((1, cfg.kv_lora_rank + cfg.qk_rope_head_dim),),
    expanded_values=lambda cfg: cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                 + cfg.v_head_dim))

KINDS = {k.name: k for k in (KV, LATENT)}


@dataclass(frozen=True)
class RequestState:
    name: str
    description: str
    # cfg -> ((shape of one request's array in one state layer), ...), in pool order
    arrays: Callable[..., tuple[tuple[int, ...], ...]]

    def values_per_request(self, cfg) -> int:
        """Values one request keeps over every state layer."""
        n = sum(cfg.state_layers)
        return n * sum(_prod(shape) for shape in self.arrays(cfg))


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def conv_channels(cfg) -> int:
    """The short convolution's channels: the keys' and queries' groups, then the values (Gated
    DeltaNet's q|k|v; Mamba2's x|B|C, the same sizes)."""
    return 2 * cfg.ssm_groups * cfg.ssm_state_dim + cfg.ssm_heads * cfg.ssm_head_dim


# conv: the last (kernel - 1) inputs of the convolution, oldest first; recurrent: per head a
# state_dim x head_dim matrix (Gated DeltaNet's k x v state; Mamba2's state x head transposed)
RECURRENT = RequestState(
    "recurrent", "fixed-size conv + recurrent state a request a layer (linear attention, SSM)",
    arrays=lambda cfg: ((conv_channels(cfg), cfg.ssm_conv_kernel - 1),
                        (cfg.ssm_heads, cfg.ssm_state_dim, cfg.ssm_head_dim)))


def request_state_of(cfg) -> RequestState | None:
    return RECURRENT if any(cfg.state_layers) else None


def paged_layers(cfg) -> list[int]:
    """The layers that keep per-token state in the paged pools, in pool order."""
    return [i for i in range(cfg.num_layers) if not (cfg.state_layers and cfg.state_layers[i])]


def pool_layer(cfg, layer: int) -> int:
    """A layer's index in its pools: its place among the paged layers, or among the state
    layers."""
    mine = bool(cfg.state_layers) and cfg.state_layers[layer]
    return sum(1 for i in range(layer) if bool(cfg.state_layers and cfg.state_layers[i]) == mine)


def state_of(cfg) -> PagedState:
    return KINDS[cfg.paged_state]


def comparison(cfg, tokens: int) -> dict:
    """What the pool of `tokens` tokens holds as this kind against expanded K/V: values a token
    a layer each way, and the tokens the same bytes would hold as K/V."""
    s = state_of(cfg)
    mine = sum(h * d for h, d in s.pools(cfg))
    kv = s.expanded_values(cfg)
    as_kv = tokens * mine // kv
    return {"kind": s.name, "values_per_token_layer": mine, "kv_values_per_token_layer": kv,
            "tokens_as_kv": as_kv, "more_tokens_than_kv": tokens - as_kv}
