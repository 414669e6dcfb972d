"""The GPU attention kernel (graphs/pallas_attention.py) in Pallas interpret mode on the CPU, against
torch's scaled_dot_product_attention over each row's contiguous K/V, on random ragged batches of
prefill chunks and decodes with GQA and sliding windows. Tolerance: 2e-5 absolute in float32
(outputs are O(1)); 2e-2 with bfloat16 queries and pools. Tiny shapes: interpret mode is slow."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxjax.graphs import attention
from maxjax.graphs.pallas_attention import (PAGED_KERNEL, KernelBlocks, check_page_size,
                                            kernel_blocks, paged_attention)
from maxjax.graphs.step import RowSlice, build_step_inputs

LAYERS, LAYER, HEAD_DIM = 2, 1, 16


def ragged_batch(rng, page_size: int, num_tokens: int, num_rows: int, max_pages: int,
                 decode_only: bool = False):
    """Random rows (decodes of one token, prefill chunks after a cached prefix, fresh prompts)
    on a shuffled pool; returns (rows, number of pool pages)."""
    num_pages = num_rows * max_pages + 1
    free = list(rng.permutation(np.arange(1, num_pages)))    # page 0 is the scratch page
    rows, tokens = [], 0
    while len(rows) < num_rows and tokens < num_tokens:
        n = 1 if decode_only or rng.random() < 0.4 else int(rng.integers(2, 12))
        n = min(n, num_tokens - tokens)
        start = int(rng.integers(0, max_pages * page_size - n + 1))
        held = -(-(start + n) // page_size)
        rows.append(RowSlice([1] * n, start, [int(free.pop()) for _ in range(held)]))
        tokens += n
    return rows, num_pages


def reference(q, k_pool, v_pool, rows, window: int, scale: float):
    """torch SDPA per row over its pages laid end to end; [T, H, hd] with zeros after the rows."""
    T, H, hd = q.shape
    KV, page = k_pool.shape[2], k_pool.shape[3]
    out = np.zeros((T, H, hd), np.float32)
    t = 0
    for row in rows:
        n, ctx = len(row.token_ids), row.start_pos + len(row.token_ids)
        pages = np.asarray(row.pages)
        k = np.asarray(k_pool[LAYER, pages], np.float32).transpose(1, 0, 2, 3).reshape(KV, -1, hd)
        v = np.asarray(v_pool[LAYER, pages], np.float32).transpose(1, 0, 2, 3).reshape(KV, -1, hd)
        qpos = np.arange(row.start_pos, ctx)[:, None]
        kpos = np.arange(k.shape[1])[None, :]
        mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        qr = torch.from_numpy(np.array(q[t:t + n], np.float32).transpose(1, 0, 2))  # [H, n, hd]
        o = torch.nn.functional.scaled_dot_product_attention(
            qr, torch.from_numpy(k), torch.from_numpy(v), attn_mask=torch.from_numpy(mask),
            scale=scale, enable_gqa=True)
        out[t:t + n] = o.numpy().transpose(1, 0, 2)
        t += n
    return out, t


CASES = {   # name: (page_size, heads, kv_heads, tokens T, rows R, pages per row, window, dtype)
    "gqa3_page16": (16, 6, 2, 32, 4, 4, 0, jnp.float32),
    "gqa4_page32_window": (32, 8, 2, 32, 4, 3, 37, jnp.float32),
    "mha_decode_only_window": (16, 2, 2, 4, 4, 5, 20, jnp.float32),
    "gqa2_page16_bf16": (16, 4, 2, 32, 4, 3, 0, jnp.bfloat16),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference_attention(case):
    page_size, H, KV, T, R, max_pages, window, dtype = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    rows, num_pages = ragged_batch(rng, page_size, T, R, max_pages, decode_only=T == R)
    shape = (LAYERS, num_pages, KV, page_size, HEAD_DIM)
    k_pool = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((T, H, HEAD_DIM)), dtype)
    step = build_step_inputs(rows, T, R, max_pages, page_size, backend=PAGED_KERNEL)
    assert isinstance(step.attn, KernelBlocks)
    scale = HEAD_DIM ** -0.5
    got = paged_attention(q, k_pool, v_pool, LAYER, jnp.asarray(step.page_table),
                          jax.tree.map(jnp.asarray, step.attn), window, scale, interpret=True)
    want, n = reference(q, k_pool, v_pool, rows, window, scale)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), want[:n], atol=tol, rtol=0)
    # The backend's attend outside CUDA (the query-block algorithm on the kernel's blocks), as
    # the CPU half of a (cuda, cpu) export runs it:
    other = jax.jit(lambda q, k, v, st: attention.attend(q, k, v, LAYER, st, window, scale))(
        q, k_pool, v_pool, jax.tree.map(jnp.asarray, step))
    np.testing.assert_allclose(np.asarray(other[:n], np.float32), want[:n], atol=tol, rtol=0)


def test_kernel_blocks_and_page_sizes():
    assert kernel_blocks(8, 8) == (8, 1)            # decode-only: one token per block
    assert kernel_blocks(4096, 256) == (496, 16)    # (4096 + 256 * 15) / 16
    assert kernel_blocks(2048, 8) == (136, 16)
    assert check_page_size(16) is None and check_page_size(128) is None
    assert "power of two" in check_page_size(24) and "power of two" in check_page_size(8)
    assert attention.backend_for("cuda") is PAGED_KERNEL
    assert attention.backend_for("gpu") is PAGED_KERNEL
    assert attention.backend_for("cpu") is attention.QUERY_BLOCKS


def test_export_holds_the_triton_kernel_for_cuda_only():
    """Exported for (cuda, cpu) on this CPU host: the CUDA lowering is the Pallas Triton call,
    and the same file runs on the CPU (through the query-block algorithm)."""
    from maxjax.graphs.step import step_input_specs
    T, R, P, page_size = 8, 2, 2, 16
    spec = step_input_specs(T, R, P, backend=PAGED_KERNEL)
    tree = jax.tree.structure(spec)
    pool = jax.ShapeDtypeStruct((LAYERS, 5, 1, page_size, HEAD_DIM), jnp.float32)
    q = jax.ShapeDtypeStruct((T, 2, HEAD_DIM), jnp.float32)

    def f(q, k, v, *leaves):
        return attention.attend(q, k, v, LAYER, tree.unflatten(leaves), 0, 0.25)
    from maxjax.aot.graphs import EXPORT_CHECKS
    exp = jax.export.export(jax.jit(f), platforms=["cuda", "cpu"],
                            disabled_checks=EXPORT_CHECKS)(q, pool, pool, *jax.tree.leaves(spec))
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
    cpu_only = jax.export.export(jax.jit(f), platforms=["cpu"])(q, pool, pool,
                                                                 *jax.tree.leaves(spec))
    assert "__gpu$xla.gpu.triton" not in cpu_only.mlir_module()
    rows = [RowSlice([1] * 3, 14, [1, 2]), RowSlice([1], 5, [3])]
    step = build_step_inputs(rows, T, R, P, page_size, backend=PAGED_KERNEL)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal(pool.shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(pool.shape), jnp.float32)
    qa = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got = jax.export.deserialize(exp.serialize()).call(qa, k, v, *jax.tree.leaves(step))
    want, n = reference(qa, k, v, rows, 0, 0.25)
    np.testing.assert_allclose(np.asarray(got[:n]), want[:n], atol=2e-5, rtol=0)
