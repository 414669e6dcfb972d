"""Sizing the KV pool from memory (`--device-memory-utilization`), called by engine/core.py
`plan_layout` when `--num-kv-pages` is unset, and checking a `--num-kv-pages` against the host's
memory on the CPU (`check_host_pages`).

On a GPU each device has its own memory, and the least free one counts:

    pool = utilization x (free memory + weights) - weights - activations of the largest bucket

"free memory + weights" is what was free before the weights were placed: the allocator's
`bytes_limit - bytes_in_use` (the weights are resident, so counted in use).

On the CPU every device is the same host RAM: each device's buffers (its weight shards or
replicas, its pool or pool shard, its activations) and every `--data-parallel-degree` replica
come out of ONE MemAvailable, so the plan is a host plan (`host_plan`):

    per engine = utilization x (MemAvailable + this engine's weights) / engines left to build
                 - weights on all devices - activations x devices - compiler allowance
    pool pages = per engine / (page bytes x pool copies)

where the weights are counted by their actual placement (a replicated array once per device, a
sharded one by its shards), the pool has one copy per device when its kv heads are not split
(`tensor_parallel_rules`: SmolLM2's 3 kv heads over 4 devices) and one copy in all when they
are, and "engines left to build" counts this replica and the ones after it (the earlier ones are
already out of MemAvailable). Activations are an estimate of the largest step's live buffers
(`activation_bytes`), counted on every device. The pool is capped at what every row at max
length could use, and rounded down to 3 significant bits so that the free memory's drift
between starts does not change it (the pool shapes every graph, and so the compile cache key).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

from maxjax.errors import UserError

GiB = float(1 << 30)
# XLA's compiler footprint on the CPU, per engine: compiling the embedded SmolLM2-135M's 9
# default step graphs (float32, one device, compile cache off) grew the RSS by 1.0 GiB over the
# placed weights and pool, and none of it went back after the compile (the executables, and
# the compiler's caches and malloc arenas). An engine whose executables come from the compile
# cache holds them too. Never more than an eighth of the host's free memory (a small machine,
# or a test's fake one: the 2-page floor then decides).
COMPILER_ALLOWANCE = 1 << 30
ALLOWANCE_SHARE = 8
POOL_FLAGS = ("lower --max-batch-size / --max-batch-input-tokens / --max-length or raise "
              "--device-memory-utilization")


@dataclass
class MemoryPlan:
    num_pages: int
    page_bytes: int
    free_bytes: int          # free memory before the weights (see the module docstring)
    utilization: float
    weight_bytes: int        # GPU: per device; CPU: this engine's, over all its devices
    activation_bytes: int    # of one device
    largest_bucket: str
    capped: bool             # True: the pool is all the rows can use (memory allows more)
    platform: str
    # The CPU's host plan (`host_plan`): host is True, the rest as counted there.
    host: bool = False
    devices: int = 1         # devices of this engine's mesh
    pool_copies: int = 1     # copies of the whole pool in host RAM (devices, or 1 when split)
    engines: int = 1         # replicas planned from this MemAvailable (this one and later ones)
    allowance: int = 0       # the compiler allowance of one engine (COMPILER_ALLOWANCE)
    fit: int = 0             # pages the memory holds, before the cap and the rounding
    state_bytes: int = 0     # a hybrid model's request-state pools, on each device

    def report(self) -> str:
        pool = self.num_pages * self.page_bytes
        if self.host:
            return self._host_report()
        how = "all the rows can use" if self.capped else (
            f"{self.free_bytes / GiB:.1f} GiB free x {self.utilization:.2f} - weights "
            f"{self.weight_bytes / GiB:.2f} GiB - activations of {self.largest_bucket} "
            f"~{self.activation_bytes / GiB:.2f} GiB{self._state()}")
        return f"KV pool {pool / GiB:.2f} GiB on {self.platform} ({how})"

    def _state(self, sep: str = " - ") -> str:
        return f"{sep}request state {self.state_bytes / GiB:.3f} GiB" if self.state_bytes else ""

    def _host_report(self) -> str:
        """One line: the host's MemAvailable and utilization, and what each engine takes of it
        (weights, pool and activations on each of its devices, the compiler allowance)."""
        n, e, pool = self.devices, self.engines, self.num_pages * self.page_bytes

        def per_device(b: float) -> str:
            return f"{b / GiB:.2f} GiB" + (f" x {n} devices" if n > 1 else "")
        copies = "" if n == 1 else " (split by kv heads)" if self.pool_copies == 1 else \
            " (replicated)"
        cap = (", capped at what the rows can use (every row at max length, up to "
               "4096 tokens a row unless --max-length is given)") if self.capped else ""
        total = self.free_bytes * self.utilization
        each = f", / {e} replicas = {total / e / GiB:.1f} GiB each" if e > 1 else ""
        return (f"KV pool {pool / GiB:.2f} GiB on {self.platform}{copies}: host MemAvailable "
                f"{(self.free_bytes - self.weight_bytes) / GiB:.1f} GiB + this engine's weights, "
                f"x {self.utilization:.2f} utilization = {total / GiB:.1f} GiB{each}: weights "
                f"{per_device(self.weight_bytes / n)} + pool "
                f"{per_device(pool * self.pool_copies / n)}{cap} + activations of "
                f"{self.largest_bucket} ~{per_device(self.activation_bytes)}"
                f"{self._state(' + ')}{' a device' if self.state_bytes and n > 1 else ''} + "
                f"compiler allowance {self.allowance / GiB:.2f} GiB")


def device_free_bytes(device=None) -> int:
    """Free memory of `device` (default: the first JAX device) with the weights already placed;
    the host's MemAvailable for a CPU device (or one without memory stats)."""
    dev = device if device is not None else jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def weight_bytes(params) -> int:
    """Bytes of a pytree of arrays (or ShapeDtypeStructs)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))


def resident_weight_bytes(params, num_devices: int) -> int:
    """Bytes a pytree of arrays holds over the `num_devices` devices of its engine together: an
    array placed on a mesh by its shards (a replicated one once per device, a split one once in
    all); one without a sharding (host or abstract) once per device, as if replicated."""
    total = 0
    for a in jax.tree.leaves(params):
        item = np.dtype(a.dtype).itemsize
        sh = getattr(a, "sharding", None)
        try:
            total += math.prod(sh.shard_shape(a.shape)) * item * len(sh.device_set)
        except (AttributeError, TypeError, ValueError):
            total += math.prod(a.shape) * item * num_devices
    return total


def page_bytes(mc, page_size: int, itemsize: int) -> int:
    """Bytes of one page of the model's paged state (graphs/state.py: K and V, or MLA's
    latent) over every layer."""
    from maxjax.graphs.state import state_of
    return state_of(mc).values_per_token(mc) * page_size * itemsize


def activation_bytes(mc, bucket, itemsize: int) -> int:
    """Estimated live buffers of one step of `bucket`: per token the residual stream, norms,
    q/k/v, attention output and the MLP's gate|up and product (compute dtype); per sample slot
    about three float32 rows of the vocabulary (logits, sorted for top-p/top-k, softmax), and per
    token two (prompt logprobs take every slot's logits and their log-softmax)."""
    T, S = bucket.num_tokens, bucket.num_samples
    per_token = 3 * mc.hidden_size + 2 * mc.q_size + 2 * mc.kv_size + 3 * mc.intermediate_size
    return int(T * per_token * itemsize + (3 * S + 2 * T) * mc.vocab_size * 4)


def round_down(n: int, bits: int = 3) -> int:
    drop = max(0, n.bit_length() - bits)
    return (n >> drop) << drop


def _devices(mesh, device):
    if mesh is not None:
        return list(mesh.devices.flat)
    return [device if device is not None else jax.devices()[0]]


def plan_pool(mc, params, page_size: int, utilization: float, buckets, max_pages: int,
              device=None, kv_itemsize: int | None = None, mesh=None, replicas: int = 1,
              kv_shards: int = 1, replica: int = 0, resident: bool = True,
              state_bytes: int = 0) -> MemoryPlan:
    """The pool for `mc` with `params` resident on `device` (default: the first JAX device) or on
    every device of `mesh`, at most `max_pages` pages, each of `kv_itemsize` bytes per value
    (default: the embedding's). `kv_shards`: the devices the pool is split over by kv heads.
    On the CPU the host plan (`host_plan`) of replica `replica` of `replicas`; elsewhere the
    least free device counts. `resident`: False when the weights are not in memory yet (`maxjax
    suggest` plans before loading), so the free memory is already what it was before them.
    `state_bytes`: a hybrid model's request-state pools (graphs/state.py RECURRENT), replicated
    on every device, taken out before the pages are sized."""
    devices = _devices(mesh, device)
    dev = devices[0]
    itemsize = kv_itemsize or np.dtype(params["embed"].dtype).itemsize
    pb = page_bytes(mc, page_size, itemsize)
    largest = max(buckets, key=lambda b: (b.num_tokens, b.num_samples))
    act = activation_bytes(mc, largest, itemsize)
    if dev.platform == "cpu":
        return host_plan(mc, params, pb, utilization, largest, act, max_pages, devices,
                         replicas, replica, kv_shards, resident, state_bytes)
    weights = weight_bytes(params)
    free = min(device_free_bytes(d) for d in devices) + (weights if resident else 0)
    budget = (int(free * utilization) - weights - act - state_bytes) * kv_shards
    fit = max(budget, 0) // pb
    rounded = round_down(fit)
    platform = "cuda" if dev.platform == "gpu" else dev.platform
    return MemoryPlan(min(rounded, max_pages), pb, free, utilization, weights, act, largest.name,
                      rounded >= max_pages, platform, fit=fit, state_bytes=state_bytes)


def host_plan(mc, params, pb: int, utilization: float, largest, act: int, max_pages: int,
              devices, replicas: int = 1, replica: int = 0, kv_shards: int = 1,
              resident: bool = True, state_bytes: int = 0) -> MemoryPlan:
    """The CPU's plan: every device and every replica out of one host MemAvailable (the module
    docstring)."""
    n = len(devices)
    weights = resident_weight_bytes(params, n)
    free = device_free_bytes(devices[0]) + (weights if resident else 0)
    allowance = min(COMPILER_ALLOWANCE, free // ALLOWANCE_SHARE)
    engines = max(1, replicas - replica)
    copies = max(1, n // max(1, kv_shards))
    per_engine = int(free * utilization) // engines - weights - (act + state_bytes) * n - \
        allowance
    fit = max(per_engine, 0) // (pb * copies)
    rounded = round_down(fit)
    return MemoryPlan(min(rounded, max_pages), pb, free, utilization, weights, act, largest.name,
                      rounded >= max_pages, "cpu", True, n, copies, engines, allowance, fit,
                      state_bytes)


def check_host_pages(num_pages: int, plan: MemoryPlan) -> None:
    """A UserError naming --num-kv-pages when `num_pages` pages do not fit the host plan `plan`
    (`host_plan`, planned with no cap), before the pool is allocated."""
    if num_pages <= plan.fit:
        return
    n, e = plan.devices, plan.engines
    need = e * (plan.weight_bytes + (plan.activation_bytes + plan.state_bytes) * n
                + plan.allowance
                + num_pages * plan.page_bytes * plan.pool_copies)
    times = f" x {plan.pool_copies} devices" if plan.pool_copies > 1 else ""
    each = f", x {e} replicas" if e > 1 else ""
    raise UserError(
        f"--num-kv-pages {num_pages} needs {need / GiB:.1f} GiB of host memory (pool "
        f"{num_pages * plan.page_bytes / GiB:.2f} GiB{times}, weights, activations"
        f"{', request state' if plan.state_bytes else ''}{each}, "
        f"compiler allowance), {plan.free_bytes * plan.utilization / GiB:.1f} GiB available "
        f"({plan.free_bytes / GiB:.1f} GiB MemAvailable + weights x --device-memory-utilization "
        f"{plan.utilization:.2f}): lower it (at most {plan.fit} pages fit)")


def layout_plan(cfg, mc, params, page_size: int, buckets, max_pages: int, kv_itemsize: int,
                mesh, resident: bool = True, state_bytes: int = 0) -> MemoryPlan:
    """`plan_pool` for engine/core.py `plan_layout`: the pool split over the mesh when its kv
    heads are (graphs/sharding.py `tensor_parallel_rules`, as graphs/program.py places it, on
    every platform), and which of the --data-parallel-degree replicas this engine is."""
    from maxjax.engine import devices
    from maxjax.graphs.sharding import mesh_degrees, mesh_rules
    kv_shards = mesh_degrees(mesh)[0] if mesh is not None and mesh.size > 1 and \
        mesh_rules(mc, mesh)["kv_heads"] else 1
    replica = devices.replica_index(cfg.devices, cfg.data_parallel_degree, mesh)
    return plan_pool(mc, params, page_size, cfg.device_memory_utilization, buckets, max_pages,
                     kv_itemsize=kv_itemsize, mesh=mesh, replicas=cfg.data_parallel_degree,
                     kv_shards=kv_shards, replica=replica, resident=resident,
                     state_bytes=state_bytes)


def check_layout_pages(cfg, mc, params, page_size: int, buckets, kv_itemsize: int, mesh,
                       resident: bool = True, state_bytes: int = 0) -> None:
    """--num-kv-pages on the local CPU: a UserError before the pool is allocated when it does not
    fit the host plan. A later replica's pages were pinned (or checked, for all the replicas) by
    the first one, whose memory is already in use: not checked again."""
    if cfg.num_kv_pages < 2:
        return
    plan = layout_plan(cfg, mc, params, page_size, buckets, cfg.num_kv_pages, kv_itemsize, mesh,
                       resident, state_bytes)
    if plan.host and plan.engines == max(1, cfg.data_parallel_degree):
        check_host_pages(cfg.num_kv_pages, plan)
