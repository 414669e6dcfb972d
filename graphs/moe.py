"""Mixture-of-experts MLP layers: routing, grouped expert compute, and their parameters.

A layer is routed where `ModelConfig.moe_layers` says so (graphs/decoder.py asks `is_moe`). Its
parameters replace the dense w_gate_up / w_down:
  router           [D, E]       float always (a quantized router could flip a top-k choice)
  experts_gate_up  [E, D, 2F]   each expert's gate|up, stacked at load time from per-expert tensors
  experts_down     [E, F, D]
and where `cfg.moe_bias` (gpt-oss) their biases router_bias [E], experts_gate_up_bias [E, 2F],
experts_down_bias [E, D]; with the logical axis "experts" first, so a mesh axis can shard experts
(graphs/sharding.py). The experts' gate|up is act(gate) * up, or gpt-oss's clamped SwiGLU
(`cfg.clamped_swiglu`, graphs/layers.py `glu`).

Routing (transformers' Qwen3MoeTopKRouter / MixtralTopKRouter): softmax over the router logits
in float32, the top k, renormalised over the k when `norm_topk_prob` (Mixtral always). gpt-oss's
GptOssTopKRouter (a softmax over the top k logits) is that renormalised form: exp(l_i) over the
k's sum of exp(l_j) either way. Every routed (token, expert) pair is computed; nothing is
dropped for capacity.

Grouped compute: the T*k pairs are sorted by expert, each expert's run padded to a multiple of a
block of B rows, and a loop with a traced trip count runs the used blocks only, each through its
one expert's MLP (the full gated MLP per block: one dynamic slice of the expert's weights).
`jax.lax.ragged_dot` is the textbook form, but XLA:CPU (jax 0.10.2) lowers it to a masked dense
dot of every expert over every row (E/k times the active compute); `grouped_ragged` keeps that
form for comparison (tests/test_moe.py; tools/bench_moe.py measures both). Padding token
slots of a step bucket route nowhere (an expert id past the last): they cost no block and come
out as zeros.

Expert parallelism: where graphs/sharding.py `tensor_parallel_rules` splits the "experts" axis
over the mesh (`cfg.expert_shards` devices), the layer runs under shard_map: every device routes
all tokens (x and the router are replicated), computes the pairs routed to its own E/n experts,
and one psum adds the partial outputs. With --ep-size the mesh is 2-D (`cfg.expert_mesh`): the
experts over its expert axis and their intermediate over its model axis (`_expert_mesh`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import layers as L
from maxjax.graphs import quant
from maxjax.graphs.sharding import ArraySpec

# 2-D parameters never quantized (maxjax/models/quantize.py asks); MLA's up-projections too
# (graphs/deepseek_v3.py folds them per head into the query and the output), the shared
# expert's gate and Gated DeltaNet's convolution taps (graphs/gated_deltanet.py).
FLOAT_MATRICES = ("router", "experts_gate_up_bias", "experts_down_bias", "w_uk", "w_uv",
                  "shared_gate", "conv_w")
# A routed layer's stacked expert parameters (the ones split over the mesh under parallelism).
EXPERT_KEYS = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")
ROUTER_KEYS = ("router", "router_bias", "router_correction")
MAX_BLOCK = 64


def is_moe(cfg, layer: int) -> bool:
    return bool(cfg.moe_layers) and cfg.moe_layers[layer]


def layer_specs(cfg, dense: dict) -> dict:
    """A routed layer's specs: the dense layer's `dense` with its MLP swapped for experts."""
    D, F, E = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    lay = {k: v for k, v in dense.items() if k not in ("w_gate_up", "w_down")}
    lay["router"] = ArraySpec((D, E), ("embed", "router"))
    lay["experts_gate_up"] = ArraySpec((E, D, 2 * F), ("experts", "embed", "expert_gate_up"))
    lay["experts_down"] = ArraySpec((E, F, D), ("experts", "expert_mlp", "embed"))
    if cfg.router_scoring == "sigmoid":
        lay["router_correction"] = ArraySpec((E,), ("router",))
    Fs = cfg.shared_expert_intermediate_size
    if Fs:
        lay["shared_gate_up"] = ArraySpec((D, 2 * Fs), ("embed", "gate_up"))
        lay["shared_down"] = ArraySpec((Fs, D), ("mlp", "embed"))
    if cfg.moe_bias:
        lay["router_bias"] = ArraySpec((E,), ("router",))
        lay["experts_gate_up_bias"] = ArraySpec((E, 2 * F), ("experts", "expert_gate_up"))
        lay["experts_down_bias"] = ArraySpec((E, D), ("experts", "embed"))
    return lay


# --- routing -----------------------------------------------------------------------------------

def grouped_routing_config(hf: dict, *, experts: int, first_dense: int, expert_f: int,
                           scaling: float) -> dict:
    """base_config's MoE settings for DeepSeek-V3's routing (sigmoid, group-limited top-k,
    correction bias, routed scaling, a shared expert after the first dense layers), read from a
    config.json `hf`; the keyword arguments are the family's defaults for keys it leaves out."""
    n = int(hf["num_hidden_layers"])
    experts = int(hf.get("n_routed_experts", experts) or 0)
    first_dense = int(hf.get("first_k_dense_replace", first_dense) or 0)
    routed = tuple(experts > 0 and i >= first_dense for i in range(n))
    expert_f = int(hf.get("moe_intermediate_size", expert_f))
    groups = int(hf.get("n_group") or 1)
    if experts and (experts % groups or experts // groups < 2):
        raise ValueError(f"n_group {groups}: {experts} experts split into groups of 2 or more")
    return dict(
        moe_layers=routed if any(routed) else (), num_experts=experts,
        experts_per_token=int(hf.get("num_experts_per_tok", 8)),
        expert_intermediate_size=expert_f, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        router_scoring="sigmoid", n_group=groups, topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", scaling)),
        shared_expert_intermediate_size=expert_f * int(hf.get("n_shared_experts", 1) or 0))


def route(x, router, k: int, norm_topk_prob: bool, bias=None):
    """(weights float32 [T, k], expert ids int32 [T, k]) of each token's top k experts."""
    logits = jnp.matmul(x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def route_grouped(x, router, correction, k: int, n_group: int, topk_group: int,
                  norm_topk_prob: bool, scaling: float):
    """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter): sigmoid scores; with the
    correction bias added they pick the `topk_group` groups (of `n_group`) whose two best
    experts sum highest, then the top k experts within those; each chosen expert weighs its
    sigmoid score (no bias), renormalised over the k when `norm_topk_prob`, times `scaling`."""
    logits = jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    choice = scores + correction.astype(jnp.float32)
    T, E = choice.shape
    grouped = choice.reshape(T, n_group, E // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_scores, topk_group)
    keep = jnp.any(groups[:, :, None] == jnp.arange(n_group), axis=1)       # [T, n_group]
    choice = jnp.where(jnp.repeat(keep, E // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, experts.astype(jnp.int32)


def route_for(cfg, x, router: dict):
    """(weights, expert ids) of each token as `cfg.router_scoring` routes it."""
    k = cfg.experts_per_token
    if cfg.router_scoring == "sigmoid":
        return route_grouped(x, router["router"], router["router_correction"], k, cfg.n_group,
                             cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    return route(x, router["router"], k, cfg.norm_topk_prob, router.get("router_bias"))


def routed_counts(experts, num_experts: int, live=None):
    """Routed (token, expert) pairs per expert [E], padding slots (from `live` on) not counted."""
    if live is not None:
        experts = jnp.where(jnp.arange(experts.shape[0])[:, None] < live, experts, num_experts)
    return jnp.sum(experts.reshape(-1)[:, None] == jnp.arange(num_experts), axis=0,
                   dtype=jnp.int32)


# --- grouped expert compute -------------------------------------------------------------------

def block_rows(pairs: int, num_experts: int) -> int:
    """The block size B for `pairs` routed rows: about the mean rows per expert (a power of
    two), so a block is mostly real rows yet an expert's weights are read once per B rows."""
    mean = max(1, pairs // num_experts)
    return min(MAX_BLOCK, 1 << (mean.bit_length() - 1))


def expert(w, e):
    """Expert e's [in, out] matrix of a stack [E, in, out] (float or int8 QuantizedWeight)."""
    if isinstance(w, quant.QuantizedWeight):
        return quant.QuantizedWeight(w.q[e], w.scale[e])
    return w[e]


def expert_mlp(x, experts: dict, e, glu):
    """x [B, D] through expert e's gated MLP (`experts`: the layer's EXPERT_KEYS it has)."""
    gate_up = L.linear(x, expert(experts["experts_gate_up"], e))
    if "experts_gate_up_bias" in experts:
        gate_up = gate_up + experts["experts_gate_up_bias"][e]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = L.linear(glu(gate, up), expert(experts["experts_down"], e))
    if "experts_down_bias" in experts:
        out = out + experts["experts_down_bias"][e]
    return out


def grouped_blocks(xs, sorted_e, group_sizes, experts: dict, glu):
    """Each row of xs [N, D] (sorted by expert `sorted_e`, rows past sum(group_sizes) unused)
    through its expert's gated MLP (`glu`: (gate, up) -> hidden), as blocks of rows of one
    expert each; -> [N, D]."""
    N, D = xs.shape
    E = group_sizes.shape[0]
    B = block_rows(N, E)
    blocks = -(-N // B) + min(E, N)          # static bound on the used blocks
    padded = (group_sizes + B - 1) // B * B
    pstart = jnp.cumsum(padded) - padded
    gstart = jnp.cumsum(group_sizes) - group_sizes
    real = jnp.arange(N) < jnp.sum(group_sizes)
    e = jnp.minimum(sorted_e, E - 1)
    dest = jnp.where(real, pstart[e] + jnp.arange(N) - gstart[e], blocks * B)
    xp = jnp.zeros((blocks * B, D), xs.dtype).at[dest].set(xs, mode="drop")
    block_end = jnp.cumsum(padded) // B
    block_expert = jnp.searchsorted(block_end, jnp.arange(blocks), side="right")
    used = block_end[-1]

    def body(b, yp):
        ex = block_expert[b]
        xb = jax.lax.dynamic_slice_in_dim(xp, b * B, B)
        out = expert_mlp(xb, experts, ex, glu)
        return jax.lax.dynamic_update_slice_in_dim(yp, out.astype(yp.dtype), b * B, 0)

    yp = jax.lax.fori_loop(0, used, body, jnp.zeros_like(xp))
    return jnp.where(real[:, None], yp[jnp.minimum(dest, blocks * B - 1)], 0)


def grouped_ragged(xs, sorted_e, group_sizes, experts: dict, glu):
    """`grouped_blocks` through jax.lax.ragged_dot (float weights): rows past the groups are 0."""
    e = jnp.minimum(sorted_e, group_sizes.shape[0] - 1)
    gate_up = jax.lax.ragged_dot(xs, experts["experts_gate_up"], group_sizes)
    if "experts_gate_up_bias" in experts:
        gate_up = gate_up + experts["experts_gate_up_bias"][e]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = jax.lax.ragged_dot(glu(gate, up), experts["experts_down"], group_sizes)
    if "experts_down_bias" in experts:
        out = out + experts["experts_down_bias"][e]
    return jnp.where((jnp.arange(xs.shape[0]) < jnp.sum(group_sizes))[:, None], out, 0)


def routed_mlp(cfg, x, p, live=None):
    """A routed layer's MLP: `moe_mlp`, plus its shared expert's where it has one (scaled by
    sigmoid(x . shared_gate) where it has that gate [D, 1]: Qwen3-Next's and Qwen3.5's)."""
    out = moe_mlp(cfg, x, p, live)
    if "shared_gate_up" in p:
        shared = L.gated_mlp(x, p["shared_gate_up"], p["shared_down"], cfg.hidden_act, 1, live)
        if "shared_gate" in p:
            gate = L.linear(x, p["shared_gate"], out_dtype=jnp.float32, live=live)
            shared = (shared * jax.nn.sigmoid(gate)).astype(shared.dtype)
        out = out + shared
    return out


def moe_mlp(cfg, x, p, live=None, grouped=None):
    """The routed MLP of one layer: x [T, D] -> [T, D]. `live`: the leading real token slots.
    With `cfg.expert_shards` > 1 the expert stacks are split over the mesh axis: each device
    runs the pairs routed to its own experts, and the partial outputs are summed. `grouped`:
    the grouped compute (None: `grouped_blocks`)."""
    grouped = grouped or grouped_blocks
    live = jnp.int32(x.shape[0]) if live is None else live
    router = {k: p[k] for k in ROUTER_KEYS if k in p}
    experts = {k: p[k] for k in EXPERT_KEYS if k in p}
    if cfg.expert_shards == 1:
        return _routed(cfg, x, router, experts, live, grouped)
    from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
    from maxjax.graphs.sharding import MODEL_AXIS
    if cfg.expert_mesh:
        return _expert_mesh(cfg, x, router, experts, live, grouped)
    n = cfg.expert_shards
    local = cfg.num_experts // n

    def shard(x, router, experts, live):
        first = jax.lax.axis_index(MODEL_AXIS) * local
        y = _routed(cfg, x, router, experts, live, grouped, first)
        return jax.lax.psum(y, MODEL_AXIS)

    mesh = AbstractMesh((n,), (MODEL_AXIS,), axis_types=(AxisType.Auto,))
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(MODEL_AXIS), P()),
                         out_specs=P(), check_vma=False)(x, router, experts, live)


def _expert_mesh(cfg, x, router: dict, experts: dict, live, grouped):
    """`moe_mlp` on the 2-D mesh of --ep-size (`cfg.expert_mesh`: (ep, tp)): each device holds
    E/ep experts, each cut to its F/tp slice of the intermediate when that divides (its gate|up
    block, graphs/sharding.py `tensor_parallel_layout`); the gated MLP is elementwise in F, so a
    slice's down projection is a partial sum, and one psum over both axes makes it whole (over
    the expert axis alone where the experts stay whole on the model axis)."""
    from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
    from maxjax.graphs import sharding
    ep, tp = cfg.expert_mesh
    local = cfg.num_experts // ep
    rules = sharding.expert_parallel_rules(cfg, tp, ep)
    declared = layer_specs(cfg, {})
    specs = quant.param_specs({k: declared[k] for k in experts}, experts)
    split = rules["expert_mlp"] is not None
    summed = (sharding.EXPERT_AXIS, sharding.MODEL_AXIS) if split else sharding.EXPERT_AXIS

    def shard(x, router, experts, live):
        first = jax.lax.axis_index(sharding.EXPERT_AXIS) * local
        if split and "experts_down_bias" in experts:    # added once, not once per slice
            first_slice = jax.lax.axis_index(sharding.MODEL_AXIS) == 0
            experts = {**experts, "experts_down_bias":
                       jnp.where(first_slice, experts["experts_down_bias"], 0)}
        y = _routed(cfg, x, router, experts, live, grouped, first)
        return jax.lax.psum(y, summed)

    mesh = AbstractMesh((ep, tp), (sharding.EXPERT_AXIS, sharding.MODEL_AXIS),
                        axis_types=(AxisType.Auto,) * 2)
    return jax.shard_map(shard, mesh=mesh,
                         in_specs=(P(), P(), sharding.partition_specs(specs, rules), P()),
                         out_specs=P(), check_vma=False)(x, router, experts, live)


def _routed(cfg, x, router: dict, experts: dict, live, grouped, first=0):
    """The routed MLP over the experts [first, first + len(experts)) of the router's E: pairs
    routed elsewhere (and padding slots, from `live` on) sort last, outside every group."""
    T, D = x.shape
    k = cfg.experts_per_token
    w_gate_up = experts["experts_gate_up"]
    E = (w_gate_up.q if isinstance(w_gate_up, quant.QuantizedWeight) else w_gate_up).shape[0]
    weights, chosen = route_for(cfg, x, router)
    chosen = chosen - first
    mine = (chosen >= 0) & (chosen < E) & (jnp.arange(T)[:, None] < live)
    flat = jnp.where(mine, chosen, E).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    group_sizes = jnp.sum(flat[:, None] == jnp.arange(E), axis=0, dtype=jnp.int32)
    glu = functools.partial(L.glu, act=cfg.hidden_act, clamped=cfg.clamped_swiglu)
    ys = grouped(x[order // k], sorted_e, group_sizes, experts, glu)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(T, k, D)
    return jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1).astype(x.dtype)


# --- checkpoint conversion -------------------------------------------------------------------

def stacked_experts(get, names: list[str], num_experts: int, put, quantizer=None):
    """A stacked expert weight [E, in, out] (or bias [E, out]) from HF tensors `names`, fused on
    their output axis per expert as the dense w_gate_up is: per-expert tensors (names with {j}
    for the expert; weights [out, in]) or whole stacks already [E, in, out] (gpt-oss).
    `quantizer`: int8 per expert and output channel (a QuantizedWeight with q [E, in, out],
    scale [E, out])."""
    if "{j}" in names[0]:
        stack = np.stack([np.concatenate([np.asarray(get(n.format(j=j)), np.float32)
                                          for n in names]).T for j in range(num_experts)])
    else:
        stack = np.concatenate([np.asarray(get(n), np.float32) for n in names], axis=-1)
    if quantizer is None:
        return put(stack)
    if quantizer.encoding != "int8":
        from maxjax.errors import UserError
        raise UserError(f"--quantization-encoding {quantizer.encoding}: expert weights of a "
                        "mixture-of-experts model quantize to int8 only; supported: float32, "
                        "bfloat16, float16, int8")
    return quantizer.expert_stack(stack)
