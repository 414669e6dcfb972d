"""Static model hyperparameters: everything a graph needs that is not an array.

`ModelConfig` is what the architecture files in graphs/ produce from a HF config.json (or GGUF
metadata) and what every graph function takes as its static first argument. It is frozen and
hashable, so it can be a static argument of `jax.jit` and part of an artifact fingerprint.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from maxjax.graphs.state import KINDS


# Fields added after artifacts and compile-cache entries were first stored: `to_dict` leaves them
# out at their default, so an existing model's fingerprint (maxjax/aot/manifest.py) stays the same.
_OMIT_DEFAULT = {"omit_default": True}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings),
    # ("linear", factor), ("yarn", factor, beta_fast, beta_slow, original_max_position_embeddings,
    # truncate, attention_factor) or None (graphs/arch.py `scaling_tuple`).
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # Per layer: the sliding window in tokens, 0 for full attention.
    layer_windows: tuple[int, ...] = ()
    # Per layer: True where the layer uses `rope_local_theta` (Gemma3's local layers).
    layer_local_rope: tuple[bool, ...] = ()
    rope_local_theta: float | None = None
    hidden_act: str = "silu"
    # Gemma-style: norms scale by (1 + w), embeddings scaled by sqrt(hidden), extra post-norms.
    norm_plus_one: bool = False
    embed_scale: float | None = None
    post_norms: bool = False
    attn_scale: float | None = None
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: tuple = field(default=(), compare=True)
    # Tensor parallelism (graphs/sharding.py `tensor_parallel_layout`): the fused q|k|v and
    # gate|up weights laid out as this many per-device blocks, each [q_i|k_i|v_i] ([g_i|u_i]).
    qkv_shards: int = 1
    gate_up_shards: int = 1
    # OLMo 2: no norms before attention and MLP (only the post-norms), and q/k RMSNorm over the
    # whole projection (all heads at once) rather than per head.
    pre_norms: bool = field(default=True, metadata=_OMIT_DEFAULT)
    qk_norm_full: bool = field(default=False, metadata=_OMIT_DEFAULT)
    # Phi-3 / Phi-4-mini: rope on the first `rotary_dim` dims of each head (None: all of them).
    rotary_dim: int | None = field(default=None, metadata=_OMIT_DEFAULT)
    # Gemma 2: attention scores (after the scale) through cap * tanh(s / cap).
    attn_logit_softcap: float | None = field(default=None, metadata=_OMIT_DEFAULT)
    # Granite: h + out * residual_scale after attention and MLP; logits / logits_scaling.
    residual_scale: float | None = field(default=None, metadata=_OMIT_DEFAULT)
    logits_scaling: float | None = field(default=None, metadata=_OMIT_DEFAULT)
    # Mixture of experts (graphs/moe.py): per layer, True where the MLP is routed to
    # `experts_per_token` of `num_experts` experts of `expert_intermediate_size` each (the
    # top-k weights renormalised when `norm_topk_prob`); (): every layer dense.
    moe_layers: tuple[bool, ...] = field(default=(), metadata=_OMIT_DEFAULT)
    num_experts: int = field(default=0, metadata=_OMIT_DEFAULT)
    experts_per_token: int = field(default=0, metadata=_OMIT_DEFAULT)
    expert_intermediate_size: int = field(default=0, metadata=_OMIT_DEFAULT)
    norm_topk_prob: bool = field(default=False, metadata=_OMIT_DEFAULT)
    # Expert parallelism (graphs/sharding.py `tensor_parallel_layout`): the expert stacks split
    # over this many devices of the mesh axis, each running the pairs routed to its experts.
    expert_shards: int = field(default=1, metadata=_OMIT_DEFAULT)
    # Multi-token prediction layers the checkpoint ships after its decoder (DeepSeek-V3's
    # num_nextn_predict_layers: graphs/mtp.py), drafts for --speculative-method mtp.
    num_mtp_layers: int = field(default=0, metadata=_OMIT_DEFAULT)
    # --ep-size: the 2-D mesh (expert groups, model-axis devices) the experts are split over
    # (graphs/sharding.py `expert_parallel_rules`); (): a 1-D mesh, or one device.
    expert_mesh: tuple[int, ...] = field(default=(), metadata=_OMIT_DEFAULT)
    # gpt-oss: a learned per-head logit joining each softmax's denominator (`sinks` [heads]); a
    # bias on the output projection; biases on the router and the experts' projections; the
    # experts' clamped SwiGLU as (alpha, limit) (graphs/layers.py `glu`), None: act(gate) * up.
    attention_sinks: bool = field(default=False, metadata=_OMIT_DEFAULT)
    attention_out_bias: bool = field(default=False, metadata=_OMIT_DEFAULT)
    moe_bias: bool = field(default=False, metadata=_OMIT_DEFAULT)
    clamped_swiglu: tuple[float, float] | None = field(default=None, metadata=_OMIT_DEFAULT)
    # A model that reads images (graphs/vision.py): the token that stands for one image
    # embedding in a prompt, and whether an image's tokens attend to each other both ways
    # (Gemma 3) rather than causally. Its step graphs take the image inputs (graphs/step.py).
    image_token_id: int | None = field(default=None, metadata=_OMIT_DEFAULT)
    bidirectional_images: bool = field(default=False, metadata=_OMIT_DEFAULT)
    # Qwen2.5-VL's M-RoPE (graphs/mrope.py): the rope frequencies split into (temporal, height,
    # width) bands, each turned by its own row of the step's `rope_positions`; None: 1-D rope.
    mrope_section: tuple[int, ...] | None = field(default=None, metadata=_OMIT_DEFAULT)
    # The state a token keeps in the paged pool (graphs/state.py KINDS): "kv" or MLA's "latent".
    paged_state: str = field(default="kv", metadata=_OMIT_DEFAULT)
    # MLA (graphs/deepseek_v3.py): q through a rank-`q_lora_rank` bottleneck (0: one q_proj);
    # a kv latent of `kv_lora_rank`; per head qk_nope + qk_rope query/key dims and v_head_dim
    # value dims. head_dim is the latent attention's (kv_lora_rank + qk_rope_head_dim).
    q_lora_rank: int = field(default=0, metadata=_OMIT_DEFAULT)
    kv_lora_rank: int = field(default=0, metadata=_OMIT_DEFAULT)
    qk_nope_head_dim: int = field(default=0, metadata=_OMIT_DEFAULT)
    qk_rope_head_dim: int = field(default=0, metadata=_OMIT_DEFAULT)
    v_head_dim: int = field(default=0, metadata=_OMIT_DEFAULT)
    rope_interleave: bool = field(default=False, metadata=_OMIT_DEFAULT)
    # DeepSeek-V3 routing (graphs/moe.py `route_grouped`): sigmoid scores plus a correction
    # bias choose, within the `topk_group` best of `n_group` groups, the top k; their sigmoid
    # scores (renormalised when norm_topk_prob) times `routed_scaling_factor` weigh them.
    # "softmax": the top k of a softmax. A shared expert of `shared_expert_intermediate_size`
    # (0: none) runs on every token beside the routed ones.
    router_scoring: str = field(default="softmax", metadata=_OMIT_DEFAULT)
    n_group: int = field(default=1, metadata=_OMIT_DEFAULT)
    topk_group: int = field(default=1, metadata=_OMIT_DEFAULT)
    routed_scaling_factor: float = field(default=1.0, metadata=_OMIT_DEFAULT)
    shared_expert_intermediate_size: int = field(default=0, metadata=_OMIT_DEFAULT)
    # Hybrid models (graphs/state.py RECURRENT): per layer, True where the layer is linear
    # attention or an SSM keeping a fixed-size state per request, not paged K/V; (): none.
    # `ssm_heads` value heads of `ssm_head_dim`, `ssm_groups` key/query (B/C) groups of
    # `ssm_state_dim`, a depthwise causal convolution of `ssm_conv_kernel` taps.
    state_layers: tuple[bool, ...] = field(default=(), metadata=_OMIT_DEFAULT)
    ssm_heads: int = field(default=0, metadata=_OMIT_DEFAULT)
    ssm_head_dim: int = field(default=0, metadata=_OMIT_DEFAULT)
    ssm_groups: int = field(default=0, metadata=_OMIT_DEFAULT)
    ssm_state_dim: int = field(default=0, metadata=_OMIT_DEFAULT)
    ssm_conv_kernel: int = field(default=0, metadata=_OMIT_DEFAULT)

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if not self.layer_local_rope:
            object.__setattr__(self, "layer_local_rope", (False,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers or len(self.layer_local_rope) != self.num_layers:
            raise ValueError("layer_windows and layer_local_rope need one entry per layer")
        if self.paged_state not in KINDS:
            raise ValueError(f"paged_state {self.paged_state!r}: one of {', '.join(KINDS)}")
        if self.state_layers:
            if len(self.state_layers) != self.num_layers:
                raise ValueError("state_layers needs one entry per layer")
            if min(self.ssm_heads, self.ssm_head_dim, self.ssm_groups, self.ssm_state_dim,
                   self.ssm_conv_kernel) < 1 or self.ssm_heads % self.ssm_groups:
                raise ValueError("a hybrid model needs ssm_heads, ssm_head_dim, ssm_groups "
                                 "(dividing ssm_heads), ssm_state_dim and ssm_conv_kernel")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("omit_default") and d[f.name] == f.default:
                del d[f.name]
        return d


MOE_FIELDS = ("moe_layers", "num_experts", "experts_per_token", "expert_intermediate_size",
              "norm_topk_prob", "expert_shards", "expert_mesh", "moe_bias", "clamped_swiglu",
              "router_scoring", "n_group", "topk_group", "routed_scaling_factor",
              "shared_expert_intermediate_size")
