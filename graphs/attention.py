"""Attention over KV pages, behind one seam: a backend is the per-bucket metadata it needs (specs
for tracing, numpy arrays built on the host for each step) plus its `attend` function.

Each backend carries its own facts (the platforms it fits, whether it needs the CPU kernels, the
head and page sizes it takes, its custom calls, its priority) and is listed once in `REGISTRY`;
`choose_backend` picks one from those facts. The step carries its metadata as `StepInputs.attn`,
and `attend` dispatches on the backend that metadata names, so the decoder never names a kernel.
The CPU runs the query-block algorithm below (written for XLA:CPU), or with
--use-experimental-kernels the FFI kernel of graphs/cpu_attention.py; CUDA runs the Pallas kernel
of graphs/pallas_attention.py over the same kind of blocks.

Query blocks: each block holds up to B consecutive tokens of one row, so a row's K/V pages are
read once per block instead of once per token. (blocks, B) is a function of the bucket
(`attention_blocks`); decode-only buckets get B = 1.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30
# Query tokens per chunk of attention blocks: best of 4-32 on the CPU (tools/bench_attention.py).
_CHUNK_QUERIES = 8


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    metadata_specs: Callable[[int, int], Any]                 # (T, R) -> ShapeDtypeStructs
    build_metadata: Callable[[Sequence, int, int], Any]       # (rows, T, R) -> numpy pytree
    # (q, k_pool, v_pool, layer, step, window, scale, softcap[, sinks]) -> [T, H, hd]; sinks
    # only to a backend that `takes_sinks`
    attend: Callable
    write_kv: Callable | None = None    # (pool, layer, slots, new, page) -> pool; None: XLA scatter
    zero_pool: Callable | None = None   # (k, v ShapeDtypeStructs) -> zero pools; None: jnp.zeros
    # its facts, read by `choose_backend`:
    platforms: tuple[str, ...] = ()     # the platforms it may be chosen for; (): any
    needs_cpu_kernels: bool = False     # runs graphs/cpu_kernels.py (--use-experimental-kernels)
    priority: int = 0                   # the highest that fits a platform is that platform's
    # why it cannot take a KV page size (None: it can): an error, the page size is the user's flag
    check_page_size: Callable[[int], str | None] = lambda page_size: None
    # why it cannot run a model of this head size here (None: it can): the next backend runs it
    check_head_dim: Callable[[int], str | None] = lambda head_dim: None
    custom_calls: tuple[str, ...] = ()  # the custom-call targets its graphs may hold
    takes_sinks: bool = False   # runs attention sinks (a per-head logit in the denominator)
    # reads the step's `visible_end` (graphs/step.py): image tokens that see their whole image
    takes_image_blocks: bool = False
    # the KV pool's dtype by default under quantized weights (None: the activations' dtype)
    quantized_kv_format: str | None = None

    def fits(self, platform: str, kernels: bool, sinks: bool = False,
             image_blocks: bool = False) -> bool:
        return (not self.platforms or platform in self.platforms) and \
            (kernels or not self.needs_cpu_kernels) and (self.takes_sinks or not sinks) and \
            (self.takes_image_blocks or not image_blocks)


@jax.tree_util.register_dataclass
@dataclass
class QueryBlocks:
    block_tokens: jax.Array   # int32[NB, B] token slot of each query of each attention block
    block_pos: jax.Array      # int32[NB, B] position of each block query; -1: padding
    block_row: jax.Array      # int32[NB] request row each block belongs to
    token_block: jax.Array    # int32[T]  flat (block * B + query) index of each token slot
    backend = "query_blocks"  # the backend whose `attend` reads these (not a field)


@functools.cache
def attention_blocks(num_tokens: int, num_rows: int) -> tuple[int, int]:
    """(number of blocks, block size B) for a bucket: enough blocks for any mix of up to
    `num_rows` rows and `num_tokens` tokens, B chosen by a cost measured on the CPU
    (BENCHMARKS.md, step graph): a block costs about one page gather plus B/8 of one in matmuls."""
    best = None
    b = 1
    while b <= num_tokens:
        blocks = min(num_tokens, -(-(num_tokens + num_rows * (b - 1)) // b))
        cost = blocks * (8 + b)
        if best is None or cost < best[0]:
            best = (cost, blocks, b)
        b *= 2
    return best[1], best[2]


def query_block_specs(num_tokens: int, num_rows: int) -> QueryBlocks:
    nb, b = attention_blocks(num_tokens, num_rows)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
    return QueryBlocks(s(nb, b), s(nb, b), s(nb), s(num_tokens))


def build_query_blocks(rows: Sequence, num_tokens: int, num_rows: int) -> QueryBlocks:
    return build_blocks(rows, num_tokens, *attention_blocks(num_tokens, num_rows), QueryBlocks)


def build_blocks(rows: Sequence, num_tokens: int, nb: int, b: int, cls=QueryBlocks):
    """Rows (RowSlice-like: token_ids, start_pos) in token-slot order, cut into `nb` blocks of
    up to `b` tokens, padding blocks after."""
    block_tokens = np.zeros((nb, b), np.int32)
    block_pos = np.full((nb, b), -1, np.int32)
    block_row = np.zeros(nb, np.int32)
    token_block = np.zeros(num_tokens, np.int32)
    blk = t = 0
    for r, row in enumerate(rows):
        k = len(row.token_ids)
        for i in range(0, k, b):
            n = min(b, k - i)
            block_tokens[blk, :n] = np.arange(t + i, t + i + n)
            block_pos[blk, :n] = np.arange(row.start_pos + i, row.start_pos + i + n)
            block_row[blk] = r
            token_block[t + i:t + i + n] = blk * b + np.arange(n)
            blk += 1
        t += k
    return cls(block_tokens, block_pos, block_row, token_block)


def query_block_attention(q, k_pool, v_pool, layer: int, step, window: int, scale: float,
                          softcap=None, sinks=None):
    """Causal attention of each token over its request's KV pages, one page at a time.

    q [T, H, hd]; pools [L, N, KV, page, hd], already holding this step's keys. Queries are
    regrouped into the step's attention blocks, so each page is gathered once per block and both
    products are batched matmuls of (B x group) queries against a contiguous [page, hd] block,
    with no transposes of K or V. Blocks are visited in chunks of a few (`_CHUNK_QUERIES`): each
    chunk loops only over the pages its own queries can see (from the first page inside `window`,
    the layer's sliding window, 0: none), and chunks holding only padding are skipped. An online
    softmax over pages keeps memory at O(T x page). `sinks` [H] (gpt-oss, transformers'
    eager_attention_forward): a logit per head that joins the softmax's denominator with no
    value, as the online softmax's starting max (and its term 1 in the sum).
    """
    meta: QueryBlocks = step.attn
    T, H, hd = q.shape
    KV, page_size = k_pool.shape[2], k_pool.shape[3]
    G = H // KV
    NB, B = meta.block_tokens.shape
    M = B * G
    C = min(NB, max(2, _CHUNK_QUERIES // B))
    n_chunks = -(-NB // C)
    pad = n_chunks * C - NB
    qb = (q.astype(jnp.float32) * scale)[meta.block_tokens]            # [NB, B, H, hd]
    qb = qb.reshape(NB, B, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(NB, KV, M, hd)
    qb = jnp.pad(qb, ((0, pad), (0, 0), (0, 0), (0, 0)))
    pages = jnp.pad(step.page_table[meta.block_row], ((0, pad), (0, 0)))   # [NB + pad, P]
    pos = jnp.pad(meta.block_pos, ((0, pad), (0, 0)), constant_values=-1)   # -1: padding
    if getattr(step, "visible_end", None) is None:     # (test doubles of a step lack it)
        ends = pos
    else:      # the last position each query sees: beyond its own within an image
        ends = jnp.where(pos >= 0, jnp.pad(step.visible_end[meta.block_tokens],
                                           ((0, pad), (0, 0))), -1)
    chunk_pos = pos.reshape(n_chunks, C * B)
    last = ends.reshape(n_chunks, C * B).max(-1)
    first = jnp.where(chunk_pos >= 0, chunk_pos, jnp.iinfo(jnp.int32).max).min(-1)
    offsets = jnp.arange(page_size, dtype=jnp.int32)
    if sinks is None:
        m0, l0 = jnp.full((C, KV, M), NEG_INF, jnp.float32), jnp.zeros((C, KV, M), jnp.float32)
    else:     # M runs over (B, G): each query's head is its KV head's g-th
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(KV, 1, G), (C, KV, B, G))
        m0, l0 = m0.reshape(C, KV, M), jnp.ones((C, KV, M), jnp.float32)

    def chunk(c, out):
        qc = jax.lax.dynamic_slice_in_dim(qb, c * C, C)
        pc = jax.lax.dynamic_slice_in_dim(pages, c * C, C)
        qpos = jax.lax.dynamic_slice_in_dim(pos, c * C, C)[:, None, :, None, None]
        qend = jax.lax.dynamic_slice_in_dim(ends, c * C, C)[:, None, :, None, None]

        def body(j, carry):
            m, l, acc = carry
            ids = pc[:, j]
            k = k_pool[layer, ids].astype(jnp.float32)                  # [C, KV, page, hd]
            v = v_pool[layer, ids].astype(jnp.float32)
            s = jnp.einsum("nkmd,nkpd->nkmp", qc, k)
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            kpos = j * page_size + offsets
            visible = kpos <= qend
            if window:
                visible &= kpos > qpos - window
            s = jnp.where(visible, s.reshape(C, KV, B, G, page_size), -jnp.inf)
            s = s.reshape(C, KV, M, page_size)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + jnp.einsum("nkmp,nkpd->nkmd", p, v)
            return m_new, l, acc

        init = (m0, l0, jnp.zeros((C, KV, M, hd), jnp.float32))
        start = jnp.maximum(first[c] - window + 1, 0) // page_size if window else 0
        stop = jnp.minimum(last[c] // page_size + 1, pages.shape[1])
        _, l, acc = jax.lax.fori_loop(start, stop, body, init)
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]                 # padding queries: l == 0
        return jax.lax.dynamic_update_slice_in_dim(out, acc, c * C, 0)

    # Blocks of real tokens come first, so the chunks holding any are a prefix.
    if n_chunks == 1:
        out = chunk(0, jnp.zeros_like(qb))
    else:
        out = jax.lax.fori_loop(0, jnp.sum(last >= 0), chunk, jnp.zeros_like(qb))
    out = out[:NB].reshape(NB, KV, B, G, hd).transpose(0, 2, 1, 3, 4).reshape(NB * B, H, hd)
    return out[meta.token_block].astype(q.dtype)


QUERY_BLOCKS = AttentionBackend("query_blocks", query_block_specs, build_query_blocks,
                                query_block_attention, takes_sinks=True,
                                takes_image_blocks=True)

# Every backend: name -> "module:attribute" of its AttentionBackend, imported when first asked
# for (the Pallas one pulls in jax.experimental.pallas).
REGISTRY = {"query_blocks": f"{__name__}:QUERY_BLOCKS",
            "pallas_paged": "maxjax.graphs.pallas_attention:PAGED_KERNEL",
            "cpu_paged_kernel": "maxjax.graphs.cpu_attention:CPU_PAGED_KERNEL"}
BACKENDS = {QUERY_BLOCKS.name: QUERY_BLOCKS}     # the ones imported so far


def backend_named(name: str) -> AttentionBackend:
    """A backend by its name (as an engine layout and artifact manifests record it)."""
    if name not in BACKENDS:
        if name not in REGISTRY:
            raise ValueError(f"unknown attention backend {name!r}")
        module, _, attr = REGISTRY[name].partition(":")
        BACKENDS[name] = getattr(importlib.import_module(module), attr)
    return BACKENDS[name]


def _fitting(platform: str, kernels: bool, sinks: bool = False,
             image_blocks: bool = False) -> list[AttentionBackend]:
    """The backends that fit `platform` (and the CPU kernels, where `kernels`; attention sinks,
    where `sinks`; images attended both ways, where `image_blocks`), best first."""
    fit = [b for b in map(backend_named, REGISTRY)
           if b.fits(platform, kernels, sinks, image_blocks)]
    return sorted(fit, key=lambda b: -b.priority)


def backend_for(platform: str | None = None) -> AttentionBackend:
    """The attention backend for a platform ("cpu", "cuda", ...; None: JAX's default)."""
    return _fitting(platform or jax.default_backend(), False)[0]


def choose_backend(platform: str, head_dim: int, page_size: int,
                   kernels: bool = False, sinks: bool = False,
                   image_blocks: bool = False) -> AttentionBackend:
    """The backend for a model of `head_dim` on `platform` with KV pages of `page_size`:
    the best that fits and runs the head size. `kernels`: --use-experimental-kernels; `sinks`:
    the model has attention sinks; `image_blocks`: its image tokens attend to their whole image
    (`visible_end`). A ValueError (the reason) for a page size the platform's
    best backend refuses."""
    for backend in _fitting(platform, kernels, sinks, image_blocks):
        why = backend.check_page_size(page_size)
        if why:
            raise ValueError(why)
        if backend.check_head_dim(head_dim) is None:
            return backend
    raise ValueError(f"no attention backend runs head size {head_dim} on {platform}")


def custom_calls() -> tuple[str, ...]:
    """Every backend's custom-call targets (what jax.export must allow: maxjax/aot/graphs.py)."""
    return tuple(c for name in REGISTRY for c in backend_named(name).custom_calls)


def write_kv(pool, layer: int, step, new, page_size: int):
    """pool with this step's K (or V) `new` [T, KV, hd] written at the step's slots, as the
    backend whose metadata the step holds writes it."""
    from maxjax.graphs import layers
    write = backend_named(step.attn.backend).write_kv or layers.write_kv
    return write(pool, layer, step.slot_mapping, new, page_size)


def attend(q, k_pool, v_pool, layer: int, step, window: int, scale: float, softcap=None,
           sinks=None):
    """q [T, H, hd] attends over its rows' pages with the backend whose metadata the step holds;
    `sinks` [H]: attention sinks (a backend that `takes_sinks`: `choose_backend`)."""
    backend = backend_named(step.attn.backend)
    if sinks is None:
        return backend.attend(q, k_pool, v_pool, layer, step, window, scale, softcap)
    if not backend.takes_sinks:
        raise ValueError(f"attention backend {backend.name} cannot run attention sinks")
    return backend.attend(q, k_pool, v_pool, layer, step, window, scale, softcap, sinks)
