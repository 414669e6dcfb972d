"""Array specs with logical axes, and the rule table that maps logical axes onto a device mesh.

Every parameter (and the KV pool) is declared once as an `ArraySpec`: its shape and one logical
axis name per dimension. Shapes, `ShapeDtypeStruct`s and shardings are all derived from that
declaration, so tensor parallelism is a sharding of the same pure graph function (GSPMD inserts
the collectives), in the manner of jax-llm-examples' `ArrayInfo` + `logical_to_physical`. A
quantized weight's arrays (graphs/quant.py) take specs derived from its float weight's.

Logical axes of the decoder (graphs/decoder.py declares which array has which):
  embed     the hidden size D
  vocab     the vocabulary
  q_heads   the flattened num_heads x head_dim axis (wo's input); a contiguous split of it is a
            split over heads whenever the mesh axis divides num_heads
  kv_heads  the KV pool's kv-head axis
  qkv       the fused q|k|v output axis of wqkv / bqkv
  gate_up   the fused gate|up output axis of w_gate_up
  mlp       the intermediate size F (w_down's input)
  head_dim  the per-head axis of the q/k norms
  heads     one entry per query head (gpt-oss's attention sinks; replicated: H numbers)
  layers, pages, page   the KV pool's layer, page and in-page token axes (head_dim as above)
  router    a routed layer's router output (one logit per expert; graphs/moe.py)
  experts   the expert axis of stacked expert weights; expert_gate_up / expert_mlp: their
            fused gate|up output and intermediate axes. `tensor_parallel_rules` splits experts
            whole over the mesh axis when their count divides (expert parallelism: each device
            runs the pairs routed to its own experts, one all-reduce after), else replicates.
            With --ep-size E the mesh is 2-D, (EXPERT_AXIS E, MODEL_AXIS devices/E): the
            experts split over the expert axis and each expert's intermediate (its fused
            gate|up per device block, like gate_up) over the model axis, where that divides;
            everything else splits over the model axis as on a 1-D mesh, replicated over the
            expert axis (`expert_parallel_rules`)

`TENSOR_PARALLEL` shards the fused axes too, in contiguous blocks. Laid out as they load (q, then
k, then v), one device would hold q and the other k|v, and GSPMD would reshard after every
projection; `tensor_parallel_layout` reorders them into per-device blocks ([q_i|k_i|v_i],
[gate_i|up_i]) so that q/k/v and gate/up are column-parallel and o/down row-parallel: one
all-reduce after each. `tensor_parallel_rules` leaves whole what does not divide.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

MODEL_AXIS = "model"
EXPERT_AXIS = "expert"

Rules = Mapping[str, str | None]   # logical axis -> mesh axis name, None: replicated

TENSOR_PARALLEL: Rules = {
    "embed": None, "vocab": MODEL_AXIS, "q_heads": MODEL_AXIS, "kv_heads": MODEL_AXIS,
    "qkv": MODEL_AXIS, "gate_up": MODEL_AXIS, "mlp": MODEL_AXIS, "head_dim": None, "heads": None,
    "layers": None, "pages": None, "page": None, "lora_slots": None, "lora_rank": None,
    "router": None, "experts": None, "expert_gate_up": None, "expert_mlp": None,
    "slots": None, "ssm": None,
}


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]     # one logical axis name per dimension
    # A matrix's output channels (where a per-channel quantization scale runs, graphs/quant.py):
    # the last axis of an [in, out] projection, the first of a [vocab, embed] table (stored
    # per row: the LM head is its transpose).
    out_axis: int = -1

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} has {len(self.shape)} dims, axes {self.axes} "
                             f"name {len(self.axes)}")


def _is_spec(x) -> bool:
    return isinstance(x, ArraySpec)


def shapes(specs):
    """The pytree of shape tuples."""
    return jax.tree.map(lambda s: s.shape, specs, is_leaf=_is_spec)


def abstract(specs, dtype):
    """The pytree of `ShapeDtypeStruct`s (nothing allocated)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=_is_spec)


def partition_spec(spec: ArraySpec, rules: Rules = TENSOR_PARALLEL) -> PartitionSpec:
    missing = [a for a in spec.axes if a not in rules]
    if missing:
        raise ValueError(f"no sharding rule for logical axes {missing} (rules: {sorted(rules)})")
    return PartitionSpec(*(rules[a] for a in spec.axes))


def partition_specs(specs, rules: Rules = TENSOR_PARALLEL):
    return jax.tree.map(lambda s: partition_spec(s, rules), specs, is_leaf=_is_spec)


def shardings(specs, mesh: jax.sharding.Mesh, rules: Rules = TENSOR_PARALLEL):
    """The pytree of `NamedSharding`s of `specs` on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, partition_spec(s, rules)), specs,
                        is_leaf=_is_spec)


def place(arrays, specs, mesh: jax.sharding.Mesh, rules: Rules = TENSOR_PARALLEL):
    """`arrays` (a pytree laid out like `specs`) put on `mesh`, each leaf sharded by its spec."""
    return jax.device_put(arrays, shardings(specs, mesh, rules))


def tensor_parallel_mesh(num_devices: int) -> jax.sharding.Mesh:
    """A 1-D mesh over the first `num_devices` devices, named `MODEL_AXIS`."""
    return mesh_over(jax.devices()[:num_devices])


def mesh_over(devices, ep: int = 1) -> jax.sharding.Mesh:
    """A 1-D mesh over `devices`, in order, named `MODEL_AXIS`; with `ep` > 1 (--ep-size) a 2-D
    one, (EXPERT_AXIS ep, MODEL_AXIS len(devices) / ep), each expert group's devices adjacent."""
    # jax 0.10 makes Explicit axes by default, under which a matmul over a sharded contracting
    # dimension raises ShardingTypeError; Auto lets GSPMD insert the reduction.
    if ep == 1:
        return jax.sharding.Mesh(np.asarray(devices), (MODEL_AXIS,), axis_types=(AxisType.Auto,))
    grid = np.asarray(devices).reshape(ep, -1)
    return jax.sharding.Mesh(grid, (EXPERT_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto,) * 2)


def mesh_degrees(mesh: jax.sharding.Mesh) -> tuple[int, int]:
    """(tensor-parallel degree, expert-parallel degree) of a mesh from `mesh_over`."""
    shape = dict(mesh.shape)
    return shape[MODEL_AXIS], shape.get(EXPERT_AXIS, 1)


def mesh_rules(cfg, mesh: jax.sharding.Mesh) -> Rules:
    """The rules of a model config on a mesh from `mesh_over` (1-D or 2-D)."""
    return tensor_parallel_rules(cfg, *mesh_degrees(mesh))


def tensor_parallel_rules(cfg, degree: int, ep: int = 1) -> Rules:
    """`TENSOR_PARALLEL` for a model config at `degree` devices. Attention splits by heads when
    both head counts divide by `degree`, else it stays whole on every device (the KV pool
    replicated: 3 kv heads on 2 devices); the MLP and the vocabulary split when they divide.
    `ep` > 1: `degree` is the model axis of a 2-D mesh (`expert_parallel_rules`)."""
    if ep > 1:
        return expert_parallel_rules(cfg, degree, ep)
    if degree == 1:
        return TENSOR_PARALLEL
    whole = []
    if cfg.num_heads % degree or cfg.num_kv_heads % degree:
        whole += ["q_heads", "kv_heads", "qkv"]
    if cfg.intermediate_size % degree:
        whole += ["gate_up", "mlp"]
    if cfg.vocab_size % degree:
        whole.append("vocab")
    # Experts split whole over the devices (expert parallelism, graphs/moe.py) when they divide.
    experts = MODEL_AXIS if cfg.num_experts and cfg.num_experts % degree == 0 else None
    return {**TENSOR_PARALLEL, **{a: None for a in whole}, "experts": experts}


def expert_parallel_rules(cfg, tp: int, ep: int) -> Rules:
    """The rules on a 2-D mesh (EXPERT_AXIS ep, MODEL_AXIS tp): attention, the dense MLP and
    the vocabulary as `tensor_parallel_rules` at `tp` (replicated over the expert axis); the
    expert stacks split over the expert axis (--ep-size divides the experts: plan.py checks),
    and each expert's intermediate over the model axis when it divides by `tp`, else whole."""
    split = tp > 1 and cfg.expert_intermediate_size % tp == 0
    inner = MODEL_AXIS if split else None
    return {**tensor_parallel_rules(cfg, tp), "experts": EXPERT_AXIS, "expert_gate_up": inner,
            "expert_mlp": inner}


def fuse_per_shard(w, sizes, shards: int):
    """The inverse layout of graphs/layers.py `split_fused`: w [..., sum(sizes)] (parts one
    after the other) with its last axis reordered into `shards` blocks of every part's slice
    (host numpy)."""
    bounds = np.cumsum([0, *sizes])
    parts = [w[..., a:b].reshape(*w.shape[:-1], shards, -1) for a, b in zip(bounds, bounds[1:])]
    return np.concatenate(parts, axis=-1).reshape(w.shape)


def tensor_parallel_layout(cfg, params, degree: int, ep: int = 1):
    """(config, params) for `degree` devices (`ep` > 1: the model axis of a 2-D mesh): the
    fused q|k|v and gate|up weights whose axis is split reordered into per-device blocks
    (graphs/layers.py `split_fused`), which the config's `qkv_shards` / `gate_up_shards` tell
    the graph (a QuantizedWeight: each of its arrays, all [..., out]); on a 2-D mesh the experts'
    fused gate|up too, and `expert_mesh` tells graphs/moe.py. Host arrays; `place` puts them on
    a mesh."""
    import dataclasses
    rules = tensor_parallel_rules(cfg, degree, ep)
    qkv = degree if rules["qkv"] else 1
    gate_up = degree if rules["gate_up"] else 1
    expert_gate_up = degree if rules["expert_gate_up"] else 1
    sizes = {"wqkv": (qkv, (cfg.q_size, cfg.kv_size, cfg.kv_size)),
             "bqkv": (qkv, (cfg.q_size, cfg.kv_size, cfg.kv_size)),
             "w_gate_up": (gate_up, (cfg.intermediate_size,) * 2),
             "experts_gate_up": (expert_gate_up, (cfg.expert_intermediate_size,) * 2),
             "experts_gate_up_bias": (expert_gate_up, (cfg.expert_intermediate_size,) * 2)}

    def per_shard(w, parts, shards):    # an array, or each of a QuantizedWeight's: [..., out]
        return jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else  # a shape
                            fuse_per_shard(np.asarray(a), parts, shards), w)

    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for key, (shards, parts) in sizes.items():
            if key in layer and shards > 1:
                layer[key] = per_shard(layer[key], parts, shards)
        layers.append(layer)
    if ep > 1:
        return dataclasses.replace(cfg, qkv_shards=qkv, gate_up_shards=gate_up, expert_shards=ep,
                                   expert_mesh=(ep, degree)), {**params, "layers": layers}
    cfg = dataclasses.replace(cfg, qkv_shards=qkv, gate_up_shards=gate_up,
                              expert_shards=degree if rules["experts"] else 1)
    return cfg, {**params, "layers": layers}


def undivided(specs, rules: Rules, degree: int | Mapping[str, int]) -> list[tuple[str, str, int]]:
    """(path, logical axis, size) of every dimension of `specs` that `rules` split but that does
    not divide by `degree` (a 4-bit weight's blocks, graphs/quant.py); `degree` a mapping: each
    mesh axis's size (a mesh's `shape`)."""
    def size(axis):
        return degree[axis] if isinstance(degree, Mapping) else degree
    bad = []
    for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]:
        bad += [(jax.tree_util.keystr(path), a, n) for n, a in zip(s.shape, s.axes)
                if rules[a] and n % size(rules[a])]
    return bad


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def params_mesh(params) -> jax.sharding.Mesh | None:
    """The mesh the parameters were placed on (maxjax/engine/devices.py), None on one device."""
    s = getattr(jax.tree.leaves(params)[0], "sharding", None)
    return s.mesh if isinstance(s, NamedSharding) else None
