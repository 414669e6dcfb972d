"""`--use-experimental-kernels`: a hand-written CPU kernel for the int8 linear, an XLA FFI custom
call (graphs/kernels/int8_linear.cc). XLA:CPU's own int8 dot (YNNPACK) reads int8 weights at a
fraction of the float32 matrix-vector product's bandwidth at the few rows a decode step has
(BENCHMARKS.md, Quantized weights); this one streams weights packed [out/64, in, 64] and keeps
the activations in float32 (weight-only int8, so no activation digits are rounded).

`pack_params` lays a single-device int8 model's matrices out for it (a `QuantizedWeight` whose `q`
is 3-D; the tied embedding table stays for the row lookup and gains a packed `lm_head`);
`graphs/quant.linear` sends such a weight here. The kernel is built once per source and jaxlib
with g++ into $MAXJAX_KERNEL_DIR (default ~/.cache/maxjax/kernels) and needs AVX-512F/BW.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("maxjax.kernels")
KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
TARGET = "maxjax_int8_linear"
# each source under graphs/kernels, and the FFI targets it defines: built into one library
SOURCES = {"int8_linear.cc": (TARGET,),
           "paged_attention.cc": ("maxjax_paged_attention", "maxjax_write_kv")}
TARGETS = tuple(t for targets in SOURCES.values() for t in targets)
INT8_LINEAR = "int8_linear"      # the name artifacts record (model fingerprint `kernels`)
TILE = 64
CPU_FLAGS = ("avx512f", "avx512bw")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def unavailable() -> str | None:
    """None once the kernels are built and registered with XLA; else why they cannot be."""
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return "no C++ compiler (g++, or $CXX) to build it"
    import jaxlib
    sources = [os.path.join(KERNEL_DIR, name) for name in SOURCES]
    key = hashlib.sha256(jaxlib.__version__.encode())
    for path in sources:
        with open(path, "rb") as f:
            key.update(f.read())
    root = os.environ.get("MAXJAX_KERNEL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "maxjax", "kernels")
    lib = os.path.join(root, f"maxjax-kernels-{key.hexdigest()[:16]}.so")
    if not os.path.isfile(lib):
        os.makedirs(root, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        cmd = [compiler, "-O3", *[f"-m{f}" for f in CPU_FLAGS], "-mfma", "-std=c++17", "-shared",
               "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", *sources, "-o", tmp, "-lpthread"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            os.unlink(tmp)
            return f"building it failed: {done.stderr.strip().splitlines()[-1:]}"
        os.replace(tmp, lib)
        log.info("built the CPU kernels into %s", lib)
    handle = ctypes.cdll.LoadLibrary(lib)
    for target in TARGETS:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, target)),
                                    platform="cpu")
    return None


def int8_linear(x, w):
    """x [..., in] @ the packed int8 weight `w` (q [out/64, in, 64], scale [out]): float32."""
    lead, d_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d_in).astype(jnp.float32)
    out = w.q.shape[0] * w.q.shape[2]
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], out), jnp.float32))(
        x2, w.q, w.scale)
    return y.reshape(*lead, out)


def is_packed(w) -> bool:
    from maxjax.graphs.quant import QuantizedWeight
    return isinstance(w, QuantizedWeight) and w.q.ndim == 3


def pack_weight(w, transposed: bool = False):
    """A bits-8 QuantizedWeight ([in, out]; [out, in] when `transposed`) packed for the kernel,
    or None when its output width is not a multiple of the tile."""
    q = np.asarray(jax.device_get(w.q))
    q = q.T if transposed else q
    i, o = q.shape
    if o % TILE:
        return None
    packed = np.ascontiguousarray(q.reshape(i, o // TILE, TILE).transpose(1, 0, 2))
    return dataclasses.replace(w, q=jax.device_put(packed))


def pack_params(params: dict) -> dict:
    """The params with every bits-8 matrix packed (those whose width does not tile stay)."""
    from maxjax.graphs.quant import QuantizedWeight

    def conv(w):
        if isinstance(w, QuantizedWeight) and w.bits == 8 and w.q.ndim == 2:
            return pack_weight(w) or w
        return w
    out = {**params, "layers": [{k: conv(v) for k, v in layer.items()}
                                for layer in params["layers"]]}
    head = params.get("lm_head", params["embed"])      # the LM head reads the table [V, D]
    if isinstance(head, QuantizedWeight) and head.bits == 8 and head.q.ndim == 2:
        packed = pack_weight(head, transposed=True)
        if packed is not None:
            out["lm_head"] = packed
    return out


def kernels_of(params) -> list[str]:
    """The kernels a params pytree is laid out for (what artifacts record)."""
    leaves = jax.tree.leaves(params, is_leaf=is_packed)
    return [INT8_LINEAR] if any(is_packed(w) for w in leaves) else []
