"""Which devices an engine runs on: `--devices` in max serve's syntax, and `--data-parallel-degree`.

`--devices` names a platform and which of its devices each process uses: `cpu` (one), `cpu:N`
(N host devices: JAX is started with N), `cpu:id=2` (host devices by index, maxjax's own form:
`cpu:N` is a count), `gpu` (the first), `gpu:all`, `gpu:0,1` (by local index). With
`--num-processes` the devices of every process together form the mesh. D replicas
split the devices, in order, into D equal groups; each group is one engine's tensor-parallel
mesh (one axis, `model`), and a single device with one replica is no mesh at all (the
single-device graphs, unchanged).

The mesh is where an engine's weights live: `place_model` puts the parameters on it by their
logical axes (graphs/sharding.py; a quantized weight's arrays by those of its float version,
graphs/quant.py) and everything downstream (layout, graph shardings, the KV
pool, the engine fingerprint) reads it back with `graphs.sharding.params_mesh`.

Called by maxjax/cli/main.py (`select_platform`, before JAX starts) and maxjax/engine/build.py.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

import numpy as np

from maxjax.errors import UserError

log = logging.getLogger("maxjax.engine")
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}
_SYNTAX = "expected cpu, cpu:N, cpu:id=ID[,ID...], gpu, gpu:all or gpu:ID[,ID...]"


@dataclass(frozen=True)
class DeviceSpec:
    text: str
    platform: str | None          # JAX platform; None: the first JAX finds
    count: int | None = 1         # devices per process; None: all of them
    ids: tuple[int, ...] | None = None   # local device indices (gpu:0,1)


def parse(text: str | None, name: str = "--devices") -> DeviceSpec:
    if text is None:
        return DeviceSpec("", None)
    m = re.fullmatch(r"\s*([a-z]+)\s*(?::\s*(.*?))?\s*", text.lower())
    if not m or m.group(1) not in PLATFORMS:
        raise UserError(f"{name} {text!r}: {_SYNTAX}")
    platform, rest = PLATFORMS[m.group(1)], m.group(2)
    if rest is None or rest == "":
        return DeviceSpec(text, platform)
    if rest == "all":
        return DeviceSpec(text, platform, None)
    by_id = platform == "cpu" and rest.startswith("id=")
    parts = [p.strip() for p in rest[3 if by_id else 0:].split(",")]
    if not all(p.isdigit() for p in parts):
        raise UserError(f"{name} {text!r}: {_SYNTAX}")
    nums = tuple(int(p) for p in parts)
    if platform == "cpu" and not by_id:
        if len(nums) != 1 or nums[0] < 1:
            raise UserError(f"{name} {text!r}: cpu:N takes one count N >= 1 (cpu:id=ID[,ID...] "
                            f"names devices)")
        return DeviceSpec(text, platform, nums[0])
    if len(set(nums)) != len(nums):
        raise UserError(f"{name} {text!r}: a device is listed twice")
    return DeviceSpec(text, platform, len(nums), nums)


def host_devices(spec: DeviceSpec) -> int:
    """How many host devices a cpu spec needs JAX to start with."""
    return max(spec.ids) + 1 if spec.ids is not None else spec.count or 1


def select_platform(text: str | None, start=None, draft: str | None = None) -> None:
    """Before JAX starts its backends: the platform, and for cpu:N or cpu:id= the host device
    count (`draft`: --draft-devices, on the same platform); then `start()` (joining a
    multi-host group) and the backend."""
    spec = parse(text)
    import jax
    try:
        if spec.platform is not None:
            jax.config.update("jax_platforms", spec.platform)
        cpus = max([host_devices(s) for s in (spec, parse(draft, "--draft-devices"))
                    if s.platform == "cpu"], default=1)
        if cpus > 1 and not _backends_started():
            jax.config.update("jax_num_cpu_devices", max(cpus, _forced_cpu_devices()))
        if start:
            start()
        if spec.platform is None and not start:
            return
        local = jax.local_devices()
    except (RuntimeError, AssertionError) as e:
        # jax with no plugin for the platform (a CPU-only install asked for a GPU) fails an
        # assertion in its xla_bridge rather than saying so.
        raise UserError(_no_backend(spec, e)) from None
    if spec.ids is not None and spec.platform != "cpu":
        missing = [i for i in spec.ids if i >= len(local)]
        if missing:
            raise UserError(f"--devices {spec.text}: no device {missing[0]} (this machine has "
                            f"{_count(local)})")
    elif spec.count is not None and spec.count > len(local) and spec.platform != "cpu":
        raise UserError(f"--devices {spec.text}: this machine has {_count(local)}")


def _count(local) -> str:
    n, kind = len(local), "GPU" if local[0].platform == "gpu" else local[0].platform
    return f"{n} {kind}{'s' if n != 1 else ''} (ID{'s 0-' if n > 1 else ' '}{n - 1})"


GPU_EXTRA = "pip install 'maxjax[cuda]'"


def _gpu_plugins() -> list[str]:
    """The jax GPU plugin distributions installed (jax-cuda12-plugin, jax-rocm7-plugin, ...)."""
    from importlib import metadata
    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    return sorted(n for n in names if re.fullmatch(r"jax-(cuda|rocm)\d+-plugin", n))


def _no_backend(spec: DeviceSpec, error: BaseException) -> str:
    """One line for a --devices whose platform jax cannot start."""
    error = " ".join(str(error).split())
    if spec.platform in ("cuda", "rocm"):
        vendor = "cuda" if spec.platform == "cuda" else "rocm"
        plugins = [p for p in _gpu_plugins() if f"-{vendor}" in p]
        if not plugins:
            how = GPU_EXTRA if vendor == "cuda" else "pip install 'jax[rocm7-local]'"
            return (f"--devices {spec.text}: this jax has no GPU backend (CPU only); install the "
                    f"GPU build: {how}")
        why = f" ({error})" if error else ""
        return (f"--devices {spec.text}: {', '.join(plugins)} is installed but finds no GPU on "
                f"this machine{why}")
    return f"--devices {spec.text}: no such device on this machine ({error})"


def _backends_started() -> bool:
    from jax._src import xla_bridge
    return bool(getattr(xla_bridge, "_backends", None))


def _forced_cpu_devices() -> int:
    import os
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def device_groups(text: str | None, data_parallel_degree: int = 1,
                  name: str = "--devices") -> list[list]:
    """The devices of each replica, in order (every process's selection, by process); `name`:
    the flag `text` came from."""
    import jax
    spec = parse(text, name)
    if data_parallel_degree < 1:
        raise UserError(f"--data-parallel-degree must be >= 1 (got {data_parallel_degree})")
    backend = spec.platform and ("gpu" if spec.platform in ("cuda", "rocm") else spec.platform)
    try:
        local = jax.local_devices(backend=backend)
    except RuntimeError as e:
        raise UserError(f"{name} {spec.text}: no such device on this machine ({e})") from e
    if spec.ids is not None:
        missing = [i for i in spec.ids if i >= len(local)]
        if missing:
            raise UserError(f"{name} {spec.text}: no device {missing[0]} (this process has "
                            f"{len(local)} {local[0].platform} devices)")
        index = list(spec.ids)
    else:
        n = len(local) if spec.count is None else spec.count
        if n > len(local):
            hint = (f"; JAX had started before the flag applied: set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={n}") if local[0].platform == "cpu" else ""
            raise UserError(f"{name} {spec.text}: this process has {len(local)} "
                            f"{local[0].platform} devices{hint}")
        index = list(range(n))
    by_process: dict[int, list] = {}
    for d in jax.devices(backend):
        by_process.setdefault(d.process_index, []).append(d)
    devices = [procs[i] for _, procs in sorted(by_process.items()) for i in index]
    if len(devices) % data_parallel_degree:
        raise UserError(f"--data-parallel-degree {data_parallel_degree} does not divide the "
                        f"{len(devices)} devices of --devices {spec.text or 'default'}")
    size = len(devices) // data_parallel_degree
    return [devices[i * size:(i + 1) * size] for i in range(data_parallel_degree)]


def replica_index(text: str | None, data_parallel_degree: int, mesh) -> int:
    """Which of the --data-parallel-degree replicas runs on `mesh` (0 for one replica, or no
    mesh)."""
    if data_parallel_degree <= 1 or mesh is None:
        return 0
    first = mesh.devices.flat[0]
    for i, group in enumerate(device_groups(text, data_parallel_degree)):
        if first in group:
            return i
    return 0


def replica_meshes(text: str | None, data_parallel_degree: int = 1, ep: int = 1) -> list:
    """One mesh per replica; [None] for a single device (the single-device graphs). `ep`
    (--ep-size) > 1 and dividing a replica's devices: each mesh is 2-D (graphs/sharding.py
    `mesh_over`); one that does not divide is refused by plan.py `check_mesh_flags`."""
    from maxjax.graphs.sharding import mesh_over
    groups = device_groups(text, data_parallel_degree)
    if len(groups) == 1 and len(groups[0]) == 1 and groups[0][0].process_index == 0:
        import jax
        if groups[0][0] == jax.devices()[0]:
            return [None]
    ep = ep if ep > 1 and len(groups[0]) % ep == 0 else 1
    return [mesh_over(g, ep) for g in groups]


def place_whole(model, mesh):
    """The LoadedModel with every parameter whole on `mesh`'s one device (a replica of
    --data-parallel-degree); the same object when `mesh` is None."""
    if mesh is None:
        return model
    import jax
    from maxjax.graphs import sharding
    if isinstance(jax.tree.leaves(model.params)[0], jax.ShapeDtypeStruct):    # shapes: a plan
        whole = sharding.replicated(mesh)
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole),
                              model.params)
    else:
        params = jax.device_put(model.params, sharding.replicated(mesh))
    return dataclasses.replace(model, params=params)


def place_model(model, mesh):
    """The LoadedModel with its parameters on `mesh`, sharded by their logical axes and the
    fused weights laid out per device (graphs/sharding.py); the same object when `mesh` is
    None."""
    if mesh is None:
        return model
    import jax
    from maxjax.graphs import quant, sharding
    from maxjax.models import quantize
    if sharding.params_mesh(model.params) == mesh:
        return model          # placed already (a multi-host process's arrays are not all here)
    cfg, params = model.config, model.params
    rules = sharding.mesh_rules(cfg, mesh)
    tp, ep = sharding.mesh_degrees(mesh)
    specs = quant.param_specs(model.arch.param_specs(cfg), params)
    for path, axis, size in sharding.undivided(specs, rules, dict(mesh.shape))[:1]:
        why = "" if not quantize.is_4bit(model.dtype) else (
            " (a 4-bit weight splits only between whole 32-input blocks: serve it as int8, or on "
            "a device count that divides the blocks)")
        raise UserError(f"tensor parallelism over {mesh.size} devices: {path} of the "
                        f"{model.dtype} weights has {size} along its {axis} axis, which does "
                        f"not divide by {mesh.size}{why}")
    if cfg.qkv_shards == cfg.gate_up_shards == 1 and not cfg.expert_mesh:   # not laid out yet
        whole = [a for a, r in rules.items() if r is None and sharding.TENSOR_PARALLEL[a]]
        if whole:
            log.warning("tensor parallelism over %d devices: %s do not divide by %d, so they "
                        "stay whole on every device%s", tp, ", ".join(whole), tp,
                        " (the whole KV pool on each)" if "kv_heads" in whole else "")
        cfg, params = sharding.tensor_parallel_layout(cfg, params, tp, ep)
    elif max(cfg.qkv_shards, cfg.gate_up_shards) != tp:
        raise UserError(f"the model's weights are laid out for {max(cfg.qkv_shards, cfg.gate_up_shards)} "
                        f"devices, not {tp}")
    if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct):    # shapes: a plan
        placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              params, sharding.shardings(specs, mesh, rules))
        return dataclasses.replace(model, config=cfg, params=placed)
    # From host arrays: resharding device arrays would compile a program per shape.
    params = jax.tree.map(np.asarray, params)
    placed = sharding.place(params, specs, mesh, rules)
    return dataclasses.replace(model, config=cfg, params=placed)
