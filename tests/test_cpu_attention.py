"""The CPU paged-attention kernel of --use-experimental-kernels (graphs/cpu_attention.py) against a
NumPy reference (float64 softmax over each row's pages laid end to end) and against the
query-block algorithm it replaces, on random ragged steps: decodes, prefill chunks longer than a
tile, mixed buckets with padding tokens, GQA and MHA, sliding windows, softcapping, bfloat16 /
float16 pools, for every instruction set this CPU runs (MAXJAX_CPU_ISA: avx512, avx2). Every
pool slot no row may read holds NaN, so a read of one shows. Its K/V write gives the bits of
XLA's scatter. Then an engine on
tests/tiny_llama.py with the flag: the layout picks the kernel, greedy tokens equal the query-block
engine's, nothing compiles while serving, and its artifacts serve again and are refused, naming
the flag, by a run without it. Skipped where no ISA's kernels can be built."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.graphs import attention, cpu_kernels
from maxjax.graphs.cpu_attention import CPU_PAGED_KERNEL, TokenRows, supports_head_dim
from maxjax.graphs.step import RowSlice, build_step_inputs
from kernel_checks import kernels_engine_round_trip

RUNNABLE = [isa for isa in cpu_kernels.ISAS if cpu_kernels.unavailable(isa) is None]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not RUNNABLE, reason=f"CPU kernels: {cpu_kernels.unavailable()}")]
LAYERS, LAYER = 2, 1


@pytest.fixture(params=RUNNABLE)
def kernel_isa(request, monkeypatch):
    """Each ISA this CPU runs, as the process's (MAXJAX_CPU_ISA) while the test traces."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, request.param)
    return request.param


def calls_only(jitted, args, isa):
    """jitted's graph calls `isa`'s kernels and no other ISA's."""
    hlo = jitted.lower(*args).as_text()
    called = [t for t in cpu_kernels.TARGETS if t in hlo]
    assert called and all(t.endswith("_" + isa) for t in called), called


def ragged_rows(rng, page_size, num_tokens, num_rows, max_pages, kind):
    """Random rows of `kind` (decode: one token each; prefill: long chunks; mixed), at random
    starts on shuffled pages; may leave token slots as padding."""
    free = list(rng.permutation(np.arange(1, num_rows * max_pages + 1)))   # page 0: scratch
    rows, tokens = [], 0
    while len(rows) < num_rows and tokens < num_tokens:
        n = 1 if kind == "decode" or (kind == "mixed" and rng.random() < 0.5) \
            else int(rng.integers(2, 40))
        n = min(n, num_tokens - tokens)
        start = int(rng.integers(0, max_pages * page_size - n + 1))
        held = -(-(start + n) // page_size)
        rows.append(RowSlice([1] * n, start, [int(free.pop()) for _ in range(held)]))
        tokens += n
    return rows, num_rows * max_pages + 1


def random_pools(rng, rows, shape, dtype):
    """K and V pools of random values where rows hold context, NaN in every other slot."""
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    L, _, KV, page, hd = shape
    for row in rows:
        for pos in range(row.start_pos + len(row.token_ids)):
            pg = row.pages[pos // page]
            k[:, pg, :, pos % page] = rng.standard_normal((L, KV, hd))
            v[:, pg, :, pos % page] = rng.standard_normal((L, KV, hd))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def reference(q, k_pool, v_pool, rows, window, scale, softcap):
    """[T, H, hd] in float64, zeros for padding token slots."""
    q, k_pool, v_pool = (np.asarray(a, np.float64) for a in (q, k_pool, v_pool))
    T, H, hd = q.shape
    KV, page = k_pool.shape[2], k_pool.shape[3]
    out = np.zeros((T, H, hd))
    t = 0
    for row in rows:
        n, ctx = len(row.token_ids), row.start_pos + len(row.token_ids)
        pages = np.asarray(row.pages)
        k = k_pool[LAYER, pages].transpose(1, 0, 2, 3).reshape(KV, -1, hd)[:, :ctx]
        v = v_pool[LAYER, pages].transpose(1, 0, 2, 3).reshape(KV, -1, hd)[:, :ctx]
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)     # [H, ctx, hd]
        s = np.einsum("thd,hkd->htk", q[t:t + n] * scale, k)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        qpos = np.arange(row.start_pos, ctx)[:, None]
        kpos = np.arange(ctx)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[t:t + n] = np.einsum("htk,hkd->thd", p, v)
        t += n
    return out


CASES = {   # name: (kind, page, H, KV, head_dim, T, R, pages per row, window, softcap, pool dtype)
    "decode_gqa3": ("decode", 16, 9, 3, 64, 8, 8, 5, 0, None, jnp.float32),
    "prefill_gqa2_page8": ("prefill", 8, 4, 2, 16, 96, 3, 12, 0, None, jnp.float32),
    "mixed_padding_window": ("mixed", 16, 6, 2, 32, 64, 8, 6, 21, None, jnp.float32),
    "mixed_mha_softcap_hd256": ("mixed", 32, 2, 2, 256, 48, 4, 3, 0, 5.0, jnp.float32),
    "prefill_window_page32": ("prefill", 32, 8, 1, 128, 64, 2, 4, 40, None, jnp.float32),
    "mixed_bf16_pool": ("mixed", 16, 6, 3, 64, 32, 6, 4, 0, None, jnp.bfloat16),
    "mixed_f16_pool_window": ("mixed", 16, 4, 2, 32, 32, 6, 4, 9, None, jnp.float16),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_numpy_and_query_blocks(case, kernel_isa):
    kind, page, H, KV, hd, T, R, max_pages, window, softcap, dtype = CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    rows, num_pages = ragged_rows(rng, page, T, R, max_pages, kind)
    k_pool, v_pool = random_pools(rng, rows, (LAYERS, num_pages, KV, page, hd), dtype)
    q = jnp.asarray(rng.standard_normal((T, H, hd)), jnp.float32)
    scale = hd ** -0.5
    n = sum(len(r.token_ids) for r in rows)
    want = reference(q, k_pool, v_pool, rows, window, scale, softcap)

    run = attend_with(rows, q, T, R, max_pages, page, window, scale, softcap, kernel_isa)
    got = run(CPU_PAGED_KERNEL, k_pool, v_pool)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert not got[n:].any()                     # padding slots: zeros
    # the query-block algorithm multiplies masked slots by 0, so it needs them finite
    blocks = run(attention.QUERY_BLOCKS, jnp.nan_to_num(k_pool), jnp.nan_to_num(v_pool))
    np.testing.assert_allclose(got[:n], blocks[:n], atol=2e-5, rtol=0)


def attend_with(rows, q, T, R, max_pages, page, window, scale, softcap, isa):
    """(backend, k_pool, v_pool) -> the step's attention output through `backend`."""
    def run(backend, k, v):
        step = jax.tree.map(jnp.asarray, build_step_inputs(rows, T, R, max_pages, page,
                                                           backend=backend))
        jitted = jax.jit(lambda q, k, v, st: attention.attend(
            q, k, v, LAYER, st, window, scale, softcap))
        if backend is CPU_PAGED_KERNEL:
            calls_only(jitted, (q, k, v, step), isa)
        return np.asarray(jitted(q, k, v, step))
    return run


@pytest.mark.parametrize("window", [0, 700])
def test_a_long_row_beside_a_short_one(window, kernel_isa):
    """A decode of a 3,000-key row (enough work to share over the threads) beside a short one,
    with and without a sliding window."""
    page, H, KV, hd, max_pages = 16, 9, 3, 64, 200
    rows = [RowSlice([1], 2999, list(range(1, 189))), RowSlice([1], 40, [258, 259, 260])]
    rng = np.random.default_rng(window)
    k_pool, v_pool = random_pools(rng, rows, (LAYERS, 261, KV, page, hd), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, H, hd)), jnp.float32)
    want = reference(q, k_pool, v_pool, rows, window, hd ** -0.5, None)
    got = attend_with(rows, q, 2, 2, max_pages, page, window, hd ** -0.5, None,
                      kernel_isa)(CPU_PAGED_KERNEL, k_pool, v_pool)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_write_kv_equals_xla_scatter(dtype, kernel_isa):
    """The kernel's in-place K/V write gives the bits of graphs/layers.py's scatter (XLA's own
    rounding to 16 bits), slot 0 of the scratch page included."""
    from maxjax.graphs import cpu_attention, layers
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((LAYERS, 9, 3, 8, 32)).astype(np.float32)
    slots = jnp.asarray(np.r_[rng.permutation(np.arange(8, 72))[:11], 0, 0].astype(np.int32))
    new = jnp.asarray(rng.standard_normal((13, 3, 32)) * 50, jnp.float32)
    want = jax.jit(lambda p: layers.write_kv(p, LAYER, slots, new, 8))(jnp.asarray(pool, dtype))
    write = jax.jit(lambda p: cpu_attention.write_kv(p, LAYER, slots, new, 8), donate_argnums=0)
    calls_only(write, (jnp.asarray(pool, dtype),), kernel_isa)
    got = write(jnp.asarray(pool, dtype))
    assert got.dtype == dtype
    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_metadata():
    rows = [RowSlice([1, 2, 3], 4, [1]), RowSlice([7], 9, [2, 3])]
    meta = CPU_PAGED_KERNEL.build_metadata(rows, 8, 4)
    assert isinstance(meta, TokenRows) and meta.backend == CPU_PAGED_KERNEL.name
    assert meta.token_row.tolist() == [0, 0, 0, 1, -1, -1, -1, -1]
    assert CPU_PAGED_KERNEL.metadata_specs(8, 4).token_row.shape == (8,)
    assert attention.backend_named("cpu_paged_kernel") is CPU_PAGED_KERNEL
    assert supports_head_dim(64) and not supports_head_dim(80)


# ---- the engine ---------------------------------------------------------------------------------
PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [300, 2, 2, 77],
           [9, 8, 7]]
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=8, max_length=64, num_kv_pages=40,
              kv_cache_page_size=8, compile_cache=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from maxjax.models.loader import load_model
    from tiny_llama import write_tiny_llama
    return load_model(write_tiny_llama(str(tmp_path_factory.mktemp("a") / "hf")), "float32",
                      progress=False)


@pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                    reason=f"CPU kernels: {cpu_kernels.unavailable()}")
def test_engine_equals_query_blocks_and_artifacts(tiny, tmp_path):
    from maxjax.engine.types import SamplingParams
    from maxjax.llm import LLM
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    xla = LLM(tiny, use_experimental_kernels=False, **ENGINE)       # the reference: XLA's path
    want = [o.token_ids for o in xla.generate(PROMPTS, greedy)]
    llm = kernels_engine_round_trip(tiny, ENGINE, PROMPTS, greedy, want, tmp_path / "art")
    assert llm.core.layout.attention == CPU_PAGED_KERNEL.name
