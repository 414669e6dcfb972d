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
        """Values a token keeps over every layer."""
        return cfg.num_layers * sum(h * d for h, d in self.pools(cfg))


KV = PagedState("kv", "paged K/V a token a layer",
                pools=lambda cfg: ((cfg.num_kv_heads, cfg.head_dim),) * 2,
                expanded_values=lambda cfg: 2 * cfg.num_kv_heads * cfg.head_dim)
LATENT = PagedState(
    "latent", "paged MLA latent (kv_lora_rank + qk_rope_head_dim) a token a layer",
    pools=lambda cfg: ((1, cfg.kv_lora_rank + cfg.qk_rope_head_dim),),
    expanded_values=lambda cfg: cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                 + cfg.v_head_dim))

KINDS = {k.name: k for k in (KV, LATENT)}


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
