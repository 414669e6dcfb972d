"""XLA:CPU options maxjax sets before JAX starts its CPU backend (import maxjax first).

Measured on the 2-core dev CPU with the unrolled SmolLM2 step (BENCHMARKS.md): XNNPACK runs the
matmuls as library calls and LLVM optimization level 1 (of 3) compiles each step graph ~2.5x
faster at the same step time. The user's own XLA_FLAGS win; MAXJAX_XLA_DEFAULTS=0 turns these off.
Skipped when a GPU plugin is installed: the level would apply to GPU kernels too.
"""
from __future__ import annotations

import importlib.util
import os

CPU_DEFAULTS = ("--xla_cpu_use_xnnpack=true", "--xla_backend_optimization_level=1")
GPU_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")


def apply_defaults() -> None:
    if os.environ.get("MAXJAX_XLA_DEFAULTS", "1") == "0":
        return
    if any(importlib.util.find_spec(p) for p in GPU_PLUGINS):
        return
    current = os.environ.get("XLA_FLAGS", "")
    given = {f.split("=")[0] for f in current.split()}
    extra = [f for f in CPU_DEFAULTS if f.split("=")[0] not in given]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
