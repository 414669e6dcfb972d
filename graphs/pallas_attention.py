"""The GPU attention backend: a Pallas kernel over KV pages for ragged steps of prefill chunks and
decodes (GQA, sliding window, softcap), written for Pallas' Triton lowering.

jax ships a paged-attention kernel for GPUs (`pallas/ops/gpu/paged_attention.py`), but for one
query per sequence only (decode), and its ragged one (`ops/tpu/ragged_paged_attention`) is
Mosaic-TPU only; tokamax's GPU attention is not paged. So this is our own, in the same idioms as
jax's GPU kernel: full-array refs for the pools and the page table, one page per loop iteration,
an online softmax in float32.

The step's tokens are grouped into query blocks (graphs/attention.py's QueryBlocks, with a block
size of this backend's choosing): one program per (block, KV head) holds the block's B queries
times the G query heads sharing that KV head, M = B x G' rows (G padded to a power of two, and M
to at least 16, as Triton's dots and blocks want), and reads each page of its row once.
Page sizes and head sizes must be powers of two of at least 16 (`check_page_size`; a model
with another head size runs the query-block algorithm on the GPU too: `check_head_dim`).

The exported graph is platform-dependent: the kernel on CUDA, the query-block algorithm on the
same metadata elsewhere, so one export for (cuda, cpu) runs on both. In tests the kernel itself
runs in Pallas interpret mode on the CPU (`paged_attention(..., interpret=True)`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir
import jax.extend

from maxjax.graphs.attention import (AttentionBackend, QueryBlocks, build_blocks,
                                     query_block_attention)

# The custom call a Pallas kernel lowers to on CUDA: jax.export does not guarantee it stable
# across jax versions, so an artifact holding one is tied to the jax that wrote it
# (maxjax/aot/manifest.py check_versions).
TRITON_CALL = "__gpu$xla.gpu.triton"
# Query tokens per block when a bucket has prefill chunks (T > R): M = 16 x G' rows per program.
BLOCK_QUERIES = 16
MIN_ROWS = 16           # Triton's dot wants every dimension >= 16


@jax.tree_util.register_dataclass
@dataclass
class KernelBlocks(QueryBlocks):
    """QueryBlocks with the kernel's block size, read by the kernel backend's `attend`."""
    backend = "pallas_paged"


def kernel_blocks(num_tokens: int, num_rows: int) -> tuple[int, int]:
    """(blocks, B): one token per block for decode-only buckets, else BLOCK_QUERIES."""
    b = 1 if num_tokens <= num_rows else min(BLOCK_QUERIES, num_tokens)
    return min(num_tokens, -(-(num_tokens + num_rows * (b - 1)) // b)), b


def kernel_block_specs(num_tokens: int, num_rows: int) -> KernelBlocks:
    nb, b = kernel_blocks(num_tokens, num_rows)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)   # noqa: E731
    return KernelBlocks(s(nb, b), s(nb, b), s(nb), s(num_tokens))


def build_kernel_blocks(rows, num_tokens: int, num_rows: int) -> KernelBlocks:
    return build_blocks(rows, num_tokens, *kernel_blocks(num_tokens, num_rows), KernelBlocks)


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and not n & (n - 1)


def check_page_size(page_size: int) -> str | None:
    """Why the kernel cannot use this page size (None: it can)."""
    if not _pow2_at_least_16(page_size):
        return f"the GPU attention kernel needs a power of two >= 16, got {page_size}"
    return None


def check_head_dim(head_dim: int) -> str | None:
    """Triton blocks are powers of two: other head sizes take the XLA attention."""
    if not _pow2_at_least_16(head_dim):
        return f"the GPU attention kernel needs a power of two >= 16, got head size {head_dim}"
    return None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(lo_ref, hi_ref, pages_ref, q_ref, qpos_ref, k_ref, v_ref, o_ref, *, layer: int,
            page_size: int, window: int, softcap):
    from jax.experimental import pallas as pl
    blk, head = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]                                      # [M, hd], already scaled
    # float32 dots in Triton default to TF32; float32 means float32 here
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    qpos = qpos_ref[...]                                # [M]; -1: padding
    offsets = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)

    def body(j, carry):
        m, l, acc = carry
        page = pages_ref[blk, j]
        k = k_ref[layer, page, head, :, :]              # [page, hd]
        v = v_ref[layer, page, head, :, :]
        s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                precision=prec, preferred_element_type=jnp.float32)  # [M, page]
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        kpos = j * page_size + offsets
        visible = kpos <= qpos[:, None]
        if window:
            visible &= kpos > qpos[:, None] - window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=prec, preferred_element_type=jnp.float32)  # [M, hd]
        return m_new, l, acc * corr[:, None] + pv

    M, hd = q.shape
    init = (jnp.full((M,), -1e30, jnp.float32), jnp.zeros((M,), jnp.float32),
            jnp.zeros((M, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(lo_ref[0], hi_ref[0], body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _compiler_params():
    try:
        from jax.experimental.pallas import triton as plgpu
        return plgpu.CompilerParams(num_warps=4, num_stages=2)
    except (ImportError, AttributeError):     # a jax without the Triton backend: defaults
        return None


def paged_attention(q, k_pool, v_pool, layer: int, page_table, meta: QueryBlocks, window: int,
                    scale: float, softcap=None, interpret: bool = False):
    """q [T, H, hd] over its rows' pages; pools [L, N, KV, page, hd]; page_table [R, P]."""
    from jax.experimental import pallas as pl     # here: a CPU start need not import it (30 ms)
    T, H, hd = q.shape
    KV, page_size = k_pool.shape[2], k_pool.shape[3]
    G = H // KV
    NB, B = meta.block_tokens.shape
    Gp = max(_pow2(G), -(-MIN_ROWS // B))
    M = B * Gp
    qb = (q * jnp.asarray(scale, q.dtype))[meta.block_tokens]          # [NB, B, H, hd]
    qb = jnp.pad(qb.reshape(NB, B, KV, G, hd), ((0, 0),) * 3 + ((0, Gp - G), (0, 0)))
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(NB, KV, M, hd)
    qpos = jnp.repeat(meta.block_pos, Gp, axis=1)                       # [NB, M]
    pos = meta.block_pos
    last = pos.max(axis=1)
    first = jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max).min(axis=1)
    hi = jnp.where(last >= 0, last // page_size + 1, 0).astype(jnp.int32)
    lo = (jnp.maximum(first - window + 1, 0) // page_size if window
          else jnp.zeros_like(hi)).astype(jnp.int32)
    lo = jnp.minimum(lo, hi)
    pages = page_table[meta.block_row]                                  # [NB, P]
    kernel = functools.partial(_kernel, layer=layer, page_size=page_size, window=window,
                               softcap=softcap)
    full = lambda a: pl.BlockSpec(a.shape, lambda i, h: (0,) * a.ndim)   # noqa: E731
    out = pl.pallas_call(
        kernel, grid=(NB, KV),
        in_specs=[pl.BlockSpec((1,), lambda i, h: (i,)), pl.BlockSpec((1,), lambda i, h: (i,)),
                  full(pages), pl.BlockSpec((None, None, M, hd), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((None, M), lambda i, h: (i, 0)), full(k_pool), full(v_pool)],
        out_specs=pl.BlockSpec((None, None, M, hd), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((NB, KV, M, hd), q.dtype),
        interpret=interpret, compiler_params=None if interpret else _compiler_params(),
        name="maxjax_paged_attention",
    )(lo, hi, pages, qb, qpos, k_pool, v_pool)
    out = out.reshape(NB, KV, B, Gp, hd)[:, :, :, :G].transpose(0, 2, 1, 3, 4)
    return out.reshape(NB * B, H, hd)[meta.token_block]


# One primitive with a lowering per platform: on CUDA the kernel, elsewhere the query-block
# algorithm. (`lax.platform_dependent` lowers every branch for every platform of a multi-platform
# export, and a Pallas call cannot lower for the CPU outside interpret mode.)
_paged_p = jax.extend.core.Primitive("maxjax_paged_attention")


@dataclass
class _Step:            # what query_block_attention reads of a step
    page_table: jax.Array
    attn: QueryBlocks


def _on_gpu(q, k_pool, v_pool, page_table, *meta, layer, window, scale, softcap):
    return paged_attention(q, k_pool, v_pool, layer, page_table, KernelBlocks(*meta), window,
                           scale, softcap)


def _elsewhere(q, k_pool, v_pool, page_table, *meta, layer, window, scale, softcap):
    return query_block_attention(q, k_pool, v_pool, layer, _Step(page_table, KernelBlocks(*meta)),
                                 window, scale, softcap)


_paged_p.def_abstract_eval(lambda q, *_, **__: q)      # the output is shaped like q
_paged_p.def_impl(lambda *args, **params: jax.jit(      # eager calls: compiled, so lowered
    lambda *a: _paged_p.bind(*a, **params))(*args))     # for this platform like any other
mlir.register_lowering(_paged_p, mlir.lower_fun(_on_gpu, multiple_results=False),
                       platform="cuda")
mlir.register_lowering(_paged_p, mlir.lower_fun(_elsewhere, multiple_results=False))


def kernel_attention(q, k_pool, v_pool, layer: int, step, window: int, scale: float,
                     softcap=None):
    """The backend's `attend`: the kernel where the graph runs on CUDA, the query-block
    algorithm over the same blocks on any other platform of the export."""
    m = step.attn
    return _paged_p.bind(q, k_pool, v_pool, step.page_table, m.block_tokens, m.block_pos,
                         m.block_row, m.token_block, layer=layer, window=window,
                         scale=float(scale), softcap=softcap)


PAGED_KERNEL = AttentionBackend("pallas_paged", kernel_block_specs, build_kernel_blocks,
                                kernel_attention, platforms=("cuda", "gpu"), priority=1,
                                check_page_size=check_page_size, check_head_dim=check_head_dim,
                                custom_calls=(TRITON_CALL,))
