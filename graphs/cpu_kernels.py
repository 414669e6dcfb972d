"""`--use-experimental-kernels`: hand-written CPU kernels for the quantized linears, XLA FFI
custom calls (graphs/kernels/quant_linear.cc). XLA:CPU's own int8 dot (YNNPACK) reads int8
weights at a fraction of the float32 matrix-vector product's bandwidth at the few rows a decode
step has, and the graph's 4-bit path rounds the blocks to int8 first (BENCHMARKS.md, Quantized
weights). These compute with two int8 activation digits per row and int32 sums: int8 weights
exactly as graphs/quant.py does, GGUF 4-bit blocks in their own arithmetic (each block's sum
scaled by its scale, plus its low end times the block's input sum).

`pack_params` lays a single-device quantized model's matrices out for them (a `QuantizedWeight`
whose `q` is 4-D; the tied embedding table stays for the row lookup and gains a packed
`lm_head`); `graphs/quant.linear` sends such a weight here. The layouts do not depend on the
instruction set.

Each kernel source builds for one of `ISAS` (the C++ picks its vector code by the -m flags):
avx512 (AVX-512F/BW/VNNI: vpdpbusd) or avx2 (AVX2 + FMA + F16C: vpmaddubsw, the same integer
sums). Each uses an extension where the CPU has it (`EXTENSIONS`: AMX-INT8 tiles for avx512's
int8 calls of 8 rows and more, AVX-VNNI for avx2), with the same outputs to the bit. `isa()` is
this process's: $MAXJAX_CPU_ISA (avx512, avx2 or none) when set, else the best this CPU has,
read anew each call. Each ISA's library is built once per source and jaxlib with g++ into
$MAXJAX_KERNEL_DIR (default ~/.cache/maxjax/kernels) and its FFI targets carry the ISA (`target`:
maxjax_int8_linear_avx2, ...), so both load in one process and an executable names the one it
needs.
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

from maxjax.errors import UserError

log = logging.getLogger("maxjax.kernels")
KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
TARGET, TARGET4 = "maxjax_int8_linear", "maxjax_int4_linear"
# each source under graphs/kernels, and the FFI targets it defines (before the ISA suffix): built
# into one library per ISA
SOURCES = {"quant_linear.cc": (TARGET, TARGET4),
           "paged_attention.cc": ("maxjax_paged_attention", "maxjax_write_kv", "maxjax_zero_pool")}
ISAS = ("avx512", "avx2")          # best first
ISA_ENV = "MAXJAX_CPU_ISA"
# ISA: (the /proc/cpuinfo flags it needs, g++'s flags for it)
ISA_FLAGS = {"avx512": (("avx512f", "avx512bw", "avx512_vnni"),
                        ("-mavx512f", "-mavx512bw", "-mavx512vnni", "-mfma", "-mamx-tile",
                         "-mamx-int8")),
             "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"))}
# every ISA's target names (jax.export allows these custom calls: maxjax/aot/graphs.py)
TARGETS = tuple(f"{t}_{i}" for i in ISAS for targets in SOURCES.values() for t in targets)
# the names artifacts record (model fingerprint `kernels`)
INT8_LINEAR, INT4_LINEAR = "int8_linear", "int4_linear"
TILE, GROUP, BLOCK = 64, 4, 32   # output columns a tile, inputs a byte group, inputs a 4-bit block


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _missing(name: str) -> list[str]:
    """The CPU flags ISA `name` needs that this CPU lacks."""
    return [f for f in ISA_FLAGS[name][0] if f not in cpu_flags()]


def isa() -> str | None:
    """The ISA this process's kernels use: $MAXJAX_CPU_ISA when set (avx512, avx2, or none:
    None), else the best of `ISAS` this CPU has (None: neither). A forced ISA is returned even
    where the CPU lacks it (`unavailable` then says so). Read anew each call."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced == "none":
            return None
        if forced not in ISAS:
            raise UserError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: expected one of "
                            f"{', '.join((*ISAS, 'none'))}")
        return forced
    return next((name for name in ISAS if not _missing(name)), None)


_process_isa = isa


def unavailable(isa: str | None = None) -> str | None:
    """None once ISA `isa`'s kernels (default: the process's, `isa()`) are built and registered
    with XLA; else one short reason they cannot be."""
    if isa is None:
        isa = _process_isa()
        if isa is None:
            forced = os.environ.get(ISA_ENV, "").strip()
            return f"{ISA_ENV}={forced}" if forced else \
                f"this CPU lacks {', '.join(_missing(ISAS[-1]))}"
    elif isa not in ISAS:
        raise ValueError(f"unknown kernel ISA {isa!r}: one of {', '.join(ISAS)}")
    missing = _missing(isa)
    return f"this CPU lacks {', '.join(missing)}" if missing else _load(isa)


@functools.cache
def _load(isa: str) -> str | None:
    """Builds ISA `isa`'s library (once per source, jaxlib and ISA: the file is kept) and
    registers its targets; None, or why it could not."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return "no C++ compiler (g++, or $CXX) to build it"
    import jaxlib
    flags = [*ISA_FLAGS[isa][1], f"-DMAXJAX_ISA={isa}"]
    sources = [os.path.join(KERNEL_DIR, name) for name in SOURCES]
    key = hashlib.sha256("\0".join([jaxlib.__version__, *flags]).encode())
    for path in sources + _headers():
        with open(path, "rb") as f:
            key.update(f.read())
    root = os.environ.get("MAXJAX_KERNEL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "maxjax", "kernels")
    lib = os.path.join(root, f"maxjax-kernels-{isa}-{key.hexdigest()[:16]}.so")
    if not os.path.isfile(lib):
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            why = _build(compiler, flags, sources, os.path.join(tmp, "lib.so"))
            if why:
                return why
            os.replace(os.path.join(tmp, "lib.so"), lib)
        log.info("built the %s CPU kernels into %s", isa, lib)
    handle = ctypes.cdll.LoadLibrary(lib)
    for name in (t for targets in SOURCES.values() for t in targets):
        full = f"{name}_{isa}"
        jax.ffi.register_ffi_target(full, jax.ffi.pycapsule(getattr(handle, full)),
                                    platform="cpu")
    _switch[isa] = [getattr(handle, f"maxjax_extension_{isa}"), False]
    set_extension(os.environ.get(EXTENSIONS[isa][1], "1").strip().lower()
                  not in ("0", "off", "false", "no"), isa)
    return None


def _headers() -> list[str]:
    """The kernel sources' headers: part of each library's key (manifest.graph_code takes every
    file under graphs/kernels into the graphs' code digest)."""
    return sorted(os.path.join(KERNEL_DIR, n) for n in os.listdir(KERNEL_DIR) if n.endswith(".h"))


# ISA: (the dot-product extension its library uses where the CPU has it, as the log names it,
# the environment variable that turns it off with 0). Either gives the ISA's own outputs to the
# bit: only the speed changes (graphs/kernels/quant_linear_amx.h, quant_linear.cc's AVX2 tiles).
EXTENSIONS = {"avx512": ("AMX tiles for int8 at 8 rows and more", "MAXJAX_CPU_AMX"),
              "avx2": ("AVX-VNNI", "MAXJAX_CPU_AVX_VNNI")}
_switch: dict = {}     # ISA: [its library's maxjax_extension_<isa>, whether the extension runs]


def set_extension(on: bool, isa: str | None = None) -> bool:
    """Turns ISA `isa`'s extension (default: the process's ISA's; `EXTENSIONS`) on, where the CPU
    and the OS allow it, or off; whether it runs now (False before the library is loaded)."""
    entry = _switch.get(isa or _process_isa())
    if entry:
        entry[1] = bool(entry[0](ctypes.c_int(int(on))))
    return bool(entry and entry[1])


def extension(isa: str | None = None) -> str | None:
    """The extension ISA `isa`'s kernels (default: the process's) run, as the log names it."""
    isa = isa or _process_isa()
    if isa is None or unavailable(isa) is not None or not _switch[isa][1]:
        return None
    return EXTENSIONS[isa][0]


def _build(compiler: str, flags: list[str], sources: list[str], out: str) -> str | None:
    """Compile `sources` (a process each, all at once: a first start waits on them) and link
    them into the shared library `out`; None, or why it failed."""
    objects = [f"{out}.{i}.o" for i in range(len(sources))]
    compiles = [subprocess.Popen([compiler, "-O3", *flags, "-std=c++17", "-fPIC", "-w",
                                  f"-I{jax.ffi.include_dir()}", "-c", src, "-o", obj],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for src, obj in zip(sources, objects)]
    done = [(p.communicate()[1], p.returncode) for p in compiles]
    if all(code == 0 for _, code in done):
        link = subprocess.run([compiler, "-shared", *objects, "-o", out, "-lpthread"],
                              capture_output=True, text=True)
        done.append((link.stderr, link.returncode))
    for err, code in done:
        if code:
            lines = err.strip().splitlines()
            first = next((ln for ln in lines if "error" in ln), lines[-1] if lines else
                         f"{compiler} exited with {code}")
            return f"building it failed: {first.strip()}"
    return None


def target(name: str, isa: str | None = None) -> str:
    """The FFI target of kernel `name` (a base name of `SOURCES`) for ISA `isa` (default: the
    process's, `isa()`), registered with XLA first; a UserError naming why it cannot be."""
    why = unavailable(isa)
    if why:
        raise UserError(f"the CPU kernels cannot run: {why}")
    return f"{name}_{isa or _process_isa()}"


def packed_linear(x, w, live=None, isa: str | None = None):
    """x [..., in] @ a weight `pack_weight` packed: float32. `live`: the rows of x (flattened)
    to compute, a leading count; the others come out 0. `isa`: whose kernel (default: the
    process's, read while tracing)."""
    lead, d_in = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d_in).astype(jnp.float32)
    out = w.q.shape[0] * TILE
    live = jnp.asarray(x2.shape[0] if live is None else live, jnp.int32).reshape(1)
    result = jax.ShapeDtypeStruct((x2.shape[0], out), jnp.float32)
    if w.bits == 8:
        y = jax.ffi.ffi_call(target(TARGET, isa), result)(x2, w.q, w.scale, live)
    else:
        y = jax.ffi.ffi_call(target(TARGET4, isa), result)(x2, w.q, w.scale, w.offset, live)
    return y.reshape(*lead, out)


def is_packed(w) -> bool:
    from maxjax.graphs.quantized_weight import QuantizedWeight
    return isinstance(w, QuantizedWeight) and w.q.ndim == 4


def pack_weight(w, transposed: bool = False):
    """A QuantizedWeight ([in, out]; [out, in] when `transposed`: bits 8 only) packed for the
    kernels (graphs/kernels/quant_linear.cc), or None when its shape does not tile.
    bits 8: q + 128 as bytes [out/64, in/4, 64, 4].
    bits 4: the GGUF bytes regrouped [out/64, in/8, 64, 4] (block b, group p: the bytes of
    packed rows 16b + 4p .. + 3, whose nibbles are inputs 32b + 4p + j and 32b + 16 + 4p + j);
    scale and `offset` (now the whole low end of the block, offset - 8 * scale) [out/64,
    in/32, 64]; no `requant`."""
    from maxjax.graphs.quantized_weight import QuantizedWeight
    rows, cols = w.q.shape[::-1] if transposed else w.q.shape
    i, o = (rows * 2, cols) if w.bits == 4 else (rows, cols)
    if o % TILE or i % BLOCK:
        return None
    if isinstance(w.q, jax.ShapeDtypeStruct):     # planning only (maxjax suggest): the shapes
        return _packed_shapes(w, i, o)
    put = lambda a: jax.device_put(np.ascontiguousarray(a))      # noqa: E731
    q = np.asarray(jax.device_get(w.q))
    q = q.T if transposed else q
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


def pack_q4_bytes(qs: np.ndarray, scale: np.ndarray, low: np.ndarray):
    """A 4-bit matrix as GGUF's Q4_0 / Q4_1 blocks hold it (maxjax/models/quantize.q4_block_bytes:
    bytes [out, in/32, 16], byte j of a block holding inputs j and j + 16; scale and low
    [out, in/32], w = scale * nibble + low) packed for the 4-bit kernel without decoding: the
    bytes are the kernel's as they are. The same arrays as pack_weight of the decoded
    QuantizedWeight. None when the shape does not tile."""
    from maxjax.graphs.quantized_weight import QuantizedWeight
    out, nb, _ = qs.shape
    if out % TILE:
        return None
    per_tile = lambda a: a.reshape(out // TILE, TILE, *a.shape[1:]).swapaxes(1, 2)  # noqa: E731
    put = lambda a: jax.device_put(np.ascontiguousarray(a))      # noqa: E731
    return QuantizedWeight(put(per_tile(qs.reshape(out, nb * 4, 4))), put(per_tile(scale)),
                           put(per_tile(low)), None, bits=4)


def _packed_shapes(w, i: int, o: int):
    """pack_weight's result as ShapeDtypeStructs, for a weight of `i` inputs and `o` outputs."""
    from maxjax.graphs.quantized_weight import QuantizedWeight
    sds = jax.ShapeDtypeStruct
    if w.bits == 8:
        return dataclasses.replace(w, q=sds((o // TILE, i // GROUP, TILE, GROUP), np.uint8))
    blocks = sds((o // TILE, i // BLOCK, TILE), np.float32)
    return QuantizedWeight(sds((o // TILE, i // 8, TILE, 4), np.uint8), blocks, blocks, None,
                           bits=4)


def pack_params(params: dict) -> dict:
    """The params with every quantized matrix packed (those whose shape does not tile stay)."""
    from maxjax.graphs.quantized_weight import QuantizedWeight

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
