"""`--use-experimental-kernels`: hand-written CPU kernels for the quantized linears, XLA FFI
custom calls (graphs/kernels/quant_linear.cc). XLA:CPU's own int8 dot (YNNPACK) reads int8
weights at a fraction of the float32 matrix-vector product's bandwidth at the few rows a decode
step has, and the graph's 4-bit path rounds the blocks to int8 first (BENCHMARKS.md, Quantized
weights). These compute with two int8 activation digits per row and int32 sums on AVX-512 VNNI:
int8 weights exactly as graphs/quant.py does, GGUF 4-bit blocks in their own arithmetic (each
block's sum scaled by its scale, plus its low end times the block's input sum).

`pack_params` lays a single-device quantized model's matrices out for them (a `QuantizedWeight`
whose `q` is 4-D; the tied embedding table stays for the row lookup and gains a packed
`lm_head`); `graphs/quant.linear` sends such a weight here. The kernels are built once per source
and jaxlib with g++ into $MAXJAX_KERNEL_DIR (default ~/.cache/maxjax/kernels) and need
AVX-512F/BW/VNNI.
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
TARGET, TARGET4 = "maxjax_int8_linear", "maxjax_int4_linear"
# each source under graphs/kernels, and the FFI targets it defines: built into one library
SOURCES = {"quant_linear.cc": (TARGET, TARGET4),
           "paged_attention.cc": ("maxjax_paged_attention", "maxjax_write_kv")}
TARGETS = tuple(t for targets in SOURCES.values() for t in targets)
# the names artifacts record (model fingerprint `kernels`)
INT8_LINEAR, INT4_LINEAR = "int8_linear", "int4_linear"
TILE, GROUP, BLOCK = 64, 4, 32   # output columns a tile, inputs a byte group, inputs a 4-bit block
CPU_FLAGS = {"avx512f": "avx512f", "avx512bw": "avx512bw", "avx512_vnni": "avx512vnni"}  # -> g++


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
        cmd = [compiler, "-O3", *[f"-m{f}" for f in CPU_FLAGS.values()], "-mfma", "-std=c++17",
               "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", *sources, "-o", tmp,
               "-lpthread"]
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


def packed_linear(x, w, live=None):
    """x [..., in] @ a weight `pack_weight` packed: float32. `live`: the rows of x (flattened)
    to compute, a leading count; the others come out 0."""
    lead, d_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d_in).astype(jnp.float32)
    out = w.q.shape[0] * TILE
    live = jnp.asarray(x2.shape[0] if live is None else live, jnp.int32).reshape(1)
    result = jax.ShapeDtypeStruct((x2.shape[0], out), jnp.float32)
    if w.bits == 8:
        y = jax.ffi.ffi_call(TARGET, result)(x2, w.q, w.scale, live)
    else:
        y = jax.ffi.ffi_call(TARGET4, result)(x2, w.q, w.scale, w.offset, live)
    return y.reshape(*lead, out)


def is_packed(w) -> bool:
    from maxjax.graphs.quant import QuantizedWeight
    return isinstance(w, QuantizedWeight) and w.q.ndim == 4


def pack_weight(w, transposed: bool = False):
    """A QuantizedWeight ([in, out]; [out, in] when `transposed`: bits 8 only) packed for the
    kernels (graphs/kernels/quant_linear.cc), or None when its shape does not tile.
    bits 8: q + 128 as bytes [out/64, in/4, 64, 4].
    bits 4: the GGUF bytes regrouped [out/64, in/8, 64, 4] (block b, group p: the bytes of
    packed rows 16b + 4p .. + 3, whose nibbles are inputs 32b + 4p + j and 32b + 16 + 4p + j);
    scale and `offset` (now the whole low end of the block, offset - 8 * scale) [out/64,
    in/32, 64]; no `requant`."""
    from maxjax.graphs.quant import QuantizedWeight
    put = lambda a: jax.device_put(np.ascontiguousarray(a))      # noqa: E731
    q = np.asarray(jax.device_get(w.q))
    q = q.T if transposed else q
    i, o = (q.shape[0] * 2, q.shape[1]) if w.bits == 4 else q.shape
    if o % TILE or i % BLOCK:
        return None
    if w.bits == 8:
        u = (q.astype(np.int16) + 128).astype(np.uint8)
        return dataclasses.replace(w, q=put(u.reshape(i // GROUP, GROUP, o // TILE, TILE)
                                              .transpose(2, 0, 3, 1)))
    blocks = lambda a: a.reshape(i // BLOCK, o // TILE, TILE).transpose(1, 0, 2)   # noqa: E731
    scale = np.asarray(jax.device_get(w.scale))
    low = -8 * scale if w.offset is None else np.asarray(jax.device_get(w.offset)) - 8 * scale
    packed = q.reshape(i // BLOCK, 4, 4, o // TILE, TILE).transpose(3, 0, 1, 4, 2)
    return QuantizedWeight(put(packed.reshape(o // TILE, i // 8, TILE, 4)), put(blocks(scale)),
                           put(blocks(low)), None, bits=4)


def pack_params(params: dict) -> dict:
    """The params with every quantized matrix packed (those whose shape does not tile stay)."""
    from maxjax.graphs.quant import QuantizedWeight

    def conv(w):
        if isinstance(w, QuantizedWeight) and w.q.ndim == 2:
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
    bits = {w.bits for w in jax.tree.leaves(params, is_leaf=is_packed) if is_packed(w)}
    return [name for b, name in ((8, INT8_LINEAR), (4, INT4_LINEAR)) if b in bits]
