"""The CPU attention backend of `--use-experimental-kernels`: paged attention as maxjax's own
XLA FFI kernel (graphs/kernels/paged_attention.cc, built and registered by graphs/cpu_kernels.py,
for the process's instruction set, `cpu_kernels.isa()`: AVX-512F or AVX2 + FMA + F16C).

Its metadata is one array, the request row of each token slot (-1: padding); the kernel reads
the positions and the page table from the step itself, groups each row's consecutive tokens into
tiles that share every K/V page load, and handles GQA, sliding windows, softcapping and
float32 / bfloat16 / float16 pools. `choose_backend` (graphs/attention.py) picks it on the CPU
when the flag is given, the kernels build, and `supports_head_dim` holds; otherwise the
query-block algorithm runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import cpu_kernels
from maxjax.graphs.attention import AttentionBackend

TARGET = "maxjax_paged_attention"     # base names: cpu_kernels.target adds the ISA
WRITE_TARGET = "maxjax_write_kv"
ZERO_TARGET = "maxjax_zero_pool"
HEAD_DIMS = (16, 32, 64, 96, 128, 256)      # the kernel's instantiations


@jax.tree_util.register_dataclass
@dataclass
class TokenRows:
    token_row: jax.Array      # int32[T] request row of each token slot; -1: padding
    backend = "cpu_paged_kernel"   # the backend whose `attend` reads these (not a field)


def supports_head_dim(head_dim: int) -> bool:
    return head_dim in HEAD_DIMS


def check_head_dim(head_dim: int) -> str | None:
    """Why the kernel cannot run here for this head size (None: it can): the kernels do not
    build (the int8 side refuses the flag then, naming why), or no instantiation for it."""
    why = cpu_kernels.unavailable()
    if why is None and not supports_head_dim(head_dim):
        why = f"the CPU attention kernel has no head size {head_dim} (it has {HEAD_DIMS})"
    return why


def token_row_specs(num_tokens: int, num_rows: int) -> TokenRows:
    return TokenRows(jax.ShapeDtypeStruct((num_tokens,), np.int32))


def build_token_rows(rows: Sequence, num_tokens: int, num_rows: int) -> TokenRows:
    token_row = np.full(num_tokens, -1, np.int32)
    t = 0
    for r, row in enumerate(rows):
        token_row[t:t + len(row.token_ids)] = r
        t += len(row.token_ids)
    return TokenRows(token_row)


def paged_attention(q, k_pool, v_pool, layer: int, page_table, token_row, positions,
                    window: int, scale: float, softcap=None, isa: str | None = None):
    """q [T, H, hd] over its rows' pages; pools [L, N, KV, page, hd]; page_table [R, P].
    `isa`: whose kernel (default: the process's, read while tracing)."""
    out = jax.ffi.ffi_call(cpu_kernels.target(TARGET, isa), jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_pool, v_pool, page_table, token_row, positions,
        layer=np.int64(layer), window=np.int64(window or 0), scale=np.float32(scale),
        softcap=np.float32(softcap or 0.0))
    return out.astype(q.dtype)


def write_kv(pool, layer: int, slots, new, page_size: int, isa: str | None = None):
    """pool [L, N, KV, page, hd] with new [T, KV, hd] at the flat slots, in place: the kernel
    writes 16-bit pools without XLA:CPU's float32 round trip of the whole pool."""
    return jax.ffi.ffi_call(cpu_kernels.target(WRITE_TARGET, isa), jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})(
        pool, slots, new.astype(jnp.float32), layer=np.int64(layer))


def zero_pool(specs, isa: str | None = None):
    """The (k, v) pools of ShapeDtypeStructs `specs`, zero, their memory not written: XLA:CPU
    fills a 5.6 GiB pool at ~0.2-0.5 GB/s and touches every page of it, the kernel hands the
    pages back to the OS, which zero-fills each on its first write (paged_attention.cc
    ZeroPool). One call for both, so the two are never merged into one buffer."""
    return tuple(jax.ffi.ffi_call(cpu_kernels.target(ZERO_TARGET, isa),
                                  [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in specs],
                                  has_side_effect=True)())


def kernel_attention(q, k_pool, v_pool, layer: int, step, window: int, scale: float,
                     softcap=None):
    """The backend's `attend`."""
    return paged_attention(q, k_pool, v_pool, layer, step.page_table, step.attn.token_row,
                           step.positions, window, scale, softcap)


CPU_PAGED_KERNEL = AttentionBackend(
    "cpu_paged_kernel", token_row_specs, build_token_rows, kernel_attention, write_kv, zero_pool,
    platforms=("cpu",), needs_cpu_kernels=True, priority=1, check_head_dim=check_head_dim,
    # it widens bfloat16 K/V as it reads them: half the bytes a long or many-row step reads,
    # twice the pages in the same memory, as llama.cpp's default f16 cache (BENCHMARKS.md)
    quantized_kv_format="bfloat16",
    custom_calls=tuple(f"{t}_{isa}" for isa in cpu_kernels.ISAS
                       for t in (TARGET, WRITE_TARGET, ZERO_TARGET)))
