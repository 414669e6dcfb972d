"""The graphs an artifact directory holds, and their flat calling convention: what decides the
bytes of an exported or compiled graph, shared by maxjax/aot/export.py and maxjax/aot/load.py.

The graphs are one step graph per bucket (graphs/program.py's step_graph_specs), one sampler per
number of sample slots (sampler_specs) and the KV pool's initializer (graphs/program.py
kv_init_spec, which ModelRunner runs), so a server started from artifacts compiles nothing. Every
graph is exported with the same flat convention, `(*arg_leaves) -> (output_leaves, kv_leaves)`,
tuples of arrays only, so the files do not depend on pytree registrations: a step graph takes
`(params, kv, step)` leaves and returns its step output's and the donated pool's; a sampler takes
`(logits, sampling)` and returns no pool; the KV initializer takes nothing and returns no outputs
and the pool's leaves. The output's pytree is recorded as JSON (`tree_spec`) while exporting and
rebuilt around the flat leaves (`rebuild`) without tracing anything.

The executable is compiled from the exported module (`jax.jit(exp.call)`), the same path the
loader takes when no executable fits, so both give the same program. `Exported.call` does not
donate; `jax.jit(exp.call, donate_argnums=(1,))` does, and a serialized executable keeps it.
"""
from __future__ import annotations

import importlib
import io
import pickle
from typing import Callable

import jax
import numpy as np
from jaxlib import xla_client

from maxjax.errors import UserError
from maxjax.graphs import cpu_kernels
from maxjax.graphs.attention import backend_named, custom_calls
from maxjax.graphs.decoder import kv_specs
from maxjax.graphs.lora import lora_specs
from maxjax.graphs.program import (KV_INIT, GraphSpec, kv_init_spec, sampled_steps,
                                   sampler_specs, step_graph_specs)
from maxjax.graphs.sharding import abstract
from maxjax.graphs.vision import vision_graph_specs


# The custom calls the graphs may hold: every attention backend's (graphs/attention.py), and
# --use-experimental-kernels' CPU kernels, registered before an artifact holding one is
# compiled (maxjax/engine/build.experimental_kernels).
EXPORT_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(c)
                 for c in dict.fromkeys((*custom_calls(), *cpu_kernels.TARGETS))]


def graph_specs(model, layout) -> list[GraphSpec]:
    """The step graphs of `layout`'s buckets, their samplers, then the KV initializer, sharded
    over the layout's mesh when it has one; nothing is allocated (the pool may be sized for
    another machine). With
    LoRA the step graphs take the adapter slot stacks as params["lora"] (graphs/lora.py), whose
    shapes the layout pins."""
    from maxjax.engine.types import MAX_TOP_LOGPROBS
    cfg, dtype = model.config, layout.kv_dtype
    params = model.params
    if layout.lora_slots:
        params = {**params, "lora": abstract(lora_specs(cfg, layout.lora_slots,
                                                        layout.max_lora_rank), model.compute_dtype)}
    steps = step_graph_specs(model.arch, cfg, params, pool_specs(model, layout),
                             layout.buckets, layout.max_pages_per_row,
                             MAX_TOP_LOGPROBS, backend_named(layout.attention),
                             mesh=layout.mesh, hidden=layout.mtp_layers > 0)
    samplers = sampler_specs(cfg, layout.buckets, layout.max_length, MAX_TOP_LOGPROBS,
                             mesh=layout.mesh)
    vision = vision_graph_specs(model.vision) if model.vision else []
    return steps + samplers + [kv_init_spec(cfg, layout.num_pages, layout.page_size, dtype,
                                            layout.mesh, layout.attention, layout.state_slots,
                                            layout.state_dtype or None)] + vision


def execution_devices(layout) -> list:
    """The devices a loaded executable runs on: the mesh's, in order, else the default one
    (deserializing onto more devices than the executable has aborts the process)."""
    if layout.mesh is None:
        return [jax.devices()[0]]
    return list(layout.mesh.devices.flat)


def pool_specs(model, layout):
    """The KV pool's ShapeDtypeStructs: every graph returns the pool's leaves."""
    return kv_specs(model.config, layout.num_pages, layout.page_size, layout.kv_dtype,
                    layout.state_slots, layout.state_dtype or None)


def flat_args(args) -> tuple:
    return tuple(tuple(jax.tree.leaves(a)) for a in args)


def flat_jit_kwargs(spec: GraphSpec) -> dict:
    """jax.jit's keywords for the flat convention: the donation, and on a mesh the output
    shardings (one for the step outputs, one per kv leaf)."""
    kw = {"donate_argnums": spec.donate_argnums}
    if spec.out_shardings is not None:
        out, kv = spec.out_shardings
        kw["out_shardings"] = (out, tuple(jax.tree.leaves(kv)))
    return kw


def export(spec: GraphSpec, platforms: list[str]) -> tuple[jax.export.Exported, object]:
    """The graph exported for `platforms`, and its output's `tree_spec`."""
    defs = [jax.tree.structure(a) for a in spec.args]
    structure: dict = {}

    def flat(*leaves):
        out, kv = spec.fn(*(d.unflatten(x) for d, x in zip(defs, leaves)))
        structure["spec"] = tree_spec(out)      # recorded while tracing
        return tuple(jax.tree.leaves(out)), tuple(jax.tree.leaves(kv))
    exp = jax.export.export(jax.jit(flat, **flat_jit_kwargs(spec)), platforms=platforms,
                            disabled_checks=EXPORT_CHECKS)(*flat_args(spec.args))
    return exp, structure["spec"]


def compile_export(exp, spec: GraphSpec) -> jax.stages.Compiled:
    return jax.jit(exp.call, **flat_jit_kwargs(spec)).lower(*flat_args(spec.args)).compile()


def movable(devices) -> bool:
    """Whether an executable compiled for another device loads onto `devices`: one CPU device
    (XLA:CPU code does not depend on which), so data-parallel replicas share one compile."""
    return len(devices) == 1 and devices[0].platform == "cpu"


class _Onto(pickle.Unpickler):
    """serialize_executable's pickle, every device it names read as `device`, the executable's
    device assignment replaced by it."""

    def __init__(self, blob: bytes, device):
        super().__init__(io.BytesIO(blob))
        self.device = device

    def persistent_load(self, pid):
        if pid[0] == "exec":
            options = xla_client.CompileOptions()
            options.device_assignment = xla_client.DeviceAssignment.create(
                np.array([[self.device.id]]))
            return self.device.client.deserialize_executable(
                pid[1], executable_devices=xla_client.DeviceList((self.device,)),
                compile_options=options)
        if pid[0] == "device":
            return self.device
        if pid[0] == "client":
            return self.device.client
        raise pickle.UnpicklingError(f"unknown persistent id {pid[0]!r}")


def load_executable(blob: bytes, in_tree, out_tree, devices: list) -> jax.stages.Compiled:
    """A serialized executable (serialize_executable's) loaded onto `devices`; where they are
    `movable`, whichever device it was compiled for."""
    if not movable(devices):
        from jax.experimental import serialize_executable
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                         execution_devices=devices)
    unloaded, args_info, no_kwargs = _Onto(blob, devices[0]).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), out_tree,
                               no_kwargs=no_kwargs)


def executable_trees(args, num_outputs: int, num_kv: int):
    """The pytree defs `serialize_executable` leaves to us, rebuilt from the flat convention."""
    in_tree = jax.tree.structure((tuple(tuple(0 for _ in a) for a in flat_args(args)), {}))
    out_tree = jax.tree.structure((tuple(0 for _ in range(num_outputs)),
                                   tuple(0 for _ in range(num_kv))))
    return in_tree, out_tree


class StepCallable:
    """A step graph as SampledStep calls it: (params, kv, step) -> (outputs, kv), kv donated."""

    def __init__(self, compiled, source: str, out_spec):
        self.compiled = compiled
        self.source = source        # "executable", "export" or "compiled" (here, just now)
        self.out_spec = out_spec

    def __call__(self, params, kv, step):
        kv_leaves, kv_def = jax.tree.flatten(kv)
        out, new_kv = self.compiled(tuple(jax.tree.leaves(params)), tuple(kv_leaves),
                                    tuple(jax.tree.leaves(step)))
        return rebuild(self.out_spec, iter(out)), kv_def.unflatten(new_kv)


class OutputCallable(StepCallable):
    """A graph without a KV pool (a sampler, an image encoder): (*args) -> (outputs, ())."""

    def __call__(self, *args):
        out, _ = self.compiled(*(tuple(jax.tree.leaves(a)) for a in args))
        return rebuild(self.out_spec, iter(out)), ()


def engine_graphs(compiled: dict, model, layout) -> tuple:
    """{graph name: (executable, source, output_structure)} -> what EngineCore takes after the
    layout: ({Bucket: SampledStep}, the KV initializer), and for a model that reads images
    {graph name: OutputCallable}."""
    specs = graph_specs(model, layout)
    init = compiled[KV_INIT][0]
    steps = sampled_steps([s.bucket for s in specs if s.bucket is not None], compiled,
                          lambda c: StepCallable(*c), lambda c: OutputCallable(*c))
    out = (steps, kv_initializer(init, pool_specs(model, layout)))
    if model.vision:
        out += ({s.name: OutputCallable(*compiled[s.name])
                 for s in vision_graph_specs(model.vision)},)
    return out


def kv_initializer(compiled, kv) -> Callable:
    """What ModelRunner runs to make its pool: () -> a zero pool with `kv`'s structure."""
    kv_def = jax.tree.structure(kv)
    return lambda: kv_def.unflatten(compiled()[1])


# ---- output structure ----------------------------------------------------------------------------
def tree_spec(tree):
    """A JSON description of a graph output's structure (tuples, lists, None and NamedTuples of
    maxjax), from which `rebuild` puts the flat output leaves back."""
    if tree is None:
        return None
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        cls = type(tree)
        return {"namedtuple": f"{cls.__module__}:{cls.__qualname__}",
                "children": [tree_spec(x) for x in tree]}
    if isinstance(tree, (tuple, list)):
        return {type(tree).__name__: [tree_spec(x) for x in tree]}
    if isinstance(tree, dict):
        return {"dict": {k: tree_spec(v) for k, v in sorted(tree.items())}}
    return "leaf"


def rebuild(spec, leaves):
    """Inverse of `tree_spec` over an iterator of leaves."""
    if spec is None:
        return None
    if spec == "leaf":
        return next(leaves)
    if "namedtuple" in spec:
        module, name = spec["namedtuple"].split(":")
        if not module.startswith("maxjax."):
            raise UserError(f"artifact output type {spec['namedtuple']} is not a maxjax type")
        cls = getattr(importlib.import_module(module), name)
        return cls(*(rebuild(c, leaves) for c in spec["children"]))
    if "tuple" in spec or "list" in spec:
        kind = tuple if "tuple" in spec else list
        return kind(rebuild(c, leaves) for c in spec[kind.__name__])
    return {k: rebuild(v, leaves) for k, v in spec["dict"].items()}


def spec_leaves(spec) -> int:
    if spec is None:
        return 0
    if spec == "leaf":
        return 1
    children = (spec.get("children") or spec.get("tuple") or spec.get("list")
                or list(spec.get("dict", {}).values()))
    return sum(spec_leaves(c) for c in children)
