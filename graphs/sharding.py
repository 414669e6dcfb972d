"""Array specs with logical axes, and the rule table that maps logical axes onto a device mesh.

Every parameter (and the KV pool) is declared once as an `ArraySpec`: its shape and one logical
axis name per dimension. Shapes, `ShapeDtypeStruct`s and shardings are all derived from that
declaration, so tensor parallelism is a sharding of the same pure graph function (GSPMD inserts
the collectives), in the manner of jax-llm-examples' `ArrayInfo` + `logical_to_physical`.

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
  layers, pages, page   the KV pool's layer, page and in-page token axes (head_dim as above)

`TENSOR_PARALLEL` shards the fused axes too, in contiguous blocks: on 2 devices one holds q (and
gate), the other k|v (and up), so GSPMD reshards after the projection. That is correct, only not
communication-optimal; it is chosen because the fused weights hold most of the parameters and
replicating them would forfeit most of the memory split. An optimal layout needs the fused axes
ordered per shard ([q_i|k_i|v_i] for each device i) at load time; a caller may instead map `qkv`
and `gate_up` to None. A sharded dimension must be divisible by its mesh axis size
(`jax.device_put` rejects it otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

MODEL_AXIS = "model"

Rules = Mapping[str, str | None]   # logical axis -> mesh axis name, None: replicated

TENSOR_PARALLEL: Rules = {
    "embed": None, "vocab": MODEL_AXIS, "q_heads": MODEL_AXIS, "kv_heads": MODEL_AXIS,
    "qkv": MODEL_AXIS, "gate_up": MODEL_AXIS, "mlp": MODEL_AXIS, "head_dim": None,
    "layers": None, "pages": None, "page": None, "lora_slots": None, "lora_rank": None,
}


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]     # one logical axis name per dimension

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


def mesh_over(devices) -> jax.sharding.Mesh:
    """A 1-D mesh over `devices`, in order, named `MODEL_AXIS`."""
    # jax 0.10 makes Explicit axes by default, under which a matmul over a sharded contracting
    # dimension raises ShardingTypeError; Auto lets GSPMD insert the reduction.
    return jax.sharding.Mesh(np.asarray(devices), (MODEL_AXIS,), axis_types=(AxisType.Auto,))


def tensor_parallel_rules(cfg, degree: int) -> Rules:
    """`TENSOR_PARALLEL` for a model config at `degree` devices: ValueError when its heads or
    MLP do not split evenly; the vocabulary stays whole (replicated) when it does not."""
    if degree == 1:
        return TENSOR_PARALLEL
    for what, n in (("kv heads", cfg.num_kv_heads), ("attention heads", cfg.num_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % degree:
            raise ValueError(f"the model's {n} {what} do not divide over {degree} devices "
                             f"(tensor parallelism needs a degree that divides them)")
    if cfg.vocab_size % degree:
        return {**TENSOR_PARALLEL, "vocab": None}
    return TENSOR_PARALLEL


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def params_mesh(params) -> jax.sharding.Mesh | None:
    """The mesh the parameters were placed on (maxjax/engine/devices.py), None on one device."""
    s = getattr(jax.tree.leaves(params)[0], "sharding", None)
    return s.mesh if isinstance(s, NamedSharding) else None
