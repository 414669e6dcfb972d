"""Sizing the KV pool from the device's memory (`--device-memory-utilization`), called by
engine/core.py `plan_layout` when `--num-kv-pages` is unset.

    pool = utilization x (free memory + weights) - weights - activations of the largest bucket

"free memory + weights" is what was free before the weights were placed: on a GPU the
allocator's `bytes_limit - bytes_in_use` (the weights are resident, so counted in use), on the CPU
the host's MemAvailable (the weights are already in this process). Activations are an estimate
of the largest step's live buffers (`activation_bytes`). The pool is capped at what every row at
max length could use, and rounded down to 3 significant bits so that the free memory's drift
between starts does not change it (the pool shapes every graph, and so the compile cache key).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

GiB = float(1 << 30)


@dataclass
class MemoryPlan:
    num_pages: int
    page_bytes: int
    free_bytes: int          # free device memory before the weights (see the module docstring)
    utilization: float
    weight_bytes: int
    activation_bytes: int
    largest_bucket: str
    capped: bool             # True: the pool is every row at max length (memory allows more)
    platform: str

    def report(self) -> str:
        pool = self.num_pages * self.page_bytes
        how = "every row at max length" if self.capped else (
            f"{self.free_bytes / GiB:.1f} GiB free x {self.utilization:.2f} - weights "
            f"{self.weight_bytes / GiB:.2f} GiB - activations of {self.largest_bucket} "
            f"~{self.activation_bytes / GiB:.2f} GiB")
        return f"KV pool {pool / GiB:.2f} GiB on {self.platform} ({how})"


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


def page_bytes(mc, page_size: int, itemsize: int) -> int:
    """Bytes of one page of K and V over every layer."""
    return 2 * mc.num_layers * page_size * mc.num_kv_heads * mc.head_dim * itemsize


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


def plan_pool(mc, params, page_size: int, utilization: float, buckets, max_pages: int,
              device=None, kv_itemsize: int | None = None, mesh=None, replicas: int = 1,
              kv_shards: int = 1) -> MemoryPlan:
    """The pool for `mc` with `params` resident on `device` (default: the first JAX device) or on
    every device of `mesh` (then the least free one counts), at most `max_pages` pages, each of
    `kv_itemsize` bytes per value (default: the embedding's). On the CPU the `replicas` engines
    share the host's memory; `kv_shards`: the devices the pool is split over by kv heads."""
    devices = list(mesh.devices.flat) if mesh is not None else [
        device if device is not None else jax.devices()[0]]
    dev = devices[0]
    itemsize = kv_itemsize or np.dtype(params["embed"].dtype).itemsize
    pb = page_bytes(mc, page_size, itemsize)
    largest = max(buckets, key=lambda b: (b.num_tokens, b.num_samples))
    weights, act = weight_bytes(params), activation_bytes(mc, largest, itemsize)
    free = min(device_free_bytes(d) for d in devices)
    if dev.platform == "cpu":
        free //= replicas
    free += weights
    budget = (int(free * utilization) - weights - act) * kv_shards
    fit = round_down(max(budget, 0) // pb)
    platform = "cuda" if dev.platform == "gpu" else dev.platform
    return MemoryPlan(min(fit, max_pages), pb, free, utilization, weights, act, largest.name,
                      fit >= max_pages, platform)
