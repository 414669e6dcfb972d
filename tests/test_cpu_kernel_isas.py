"""The CPU kernels' instruction sets (graphs/cpu_kernels.py): MAXJAX_CPU_ISA forces one (avx512,
avx2, none; anything else is a UserError), else the best this CPU has; a CPU lacking an ISA's
flags makes it unavailable naming them. Each ISA's library exports its own target names, so both
load here and their results compare: the linears' integer sums equal exactly (weights -128 and
127 against activations +-127: no saturation on AVX2's vpmaddubsw path), their outputs bit for
bit on random inputs, the attention's to float32 rounding; a tiny int8 engine forced to avx2
gives avx512's greedy tokens. Each ISA's extension (AMX-INT8 tiles for avx512's int8 calls of 8
rows and more, AVX-VNNI for avx2), where the CPU has it, gives the ISA's own bits; the
exactness test runs through them, and MAXJAX_CPU_AMX=0 / MAXJAX_CPU_AVX_VNNI=0 turn them off.
The reference tests of each kernel run for every ISA in tests/test_cpu_kernels.py and
tests/test_cpu_attention.py."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.errors import UserError
from maxjax.graphs import cpu_attention, cpu_kernels, quant
from maxjax.models.quantize import pack_q4

ENV = cpu_kernels.ISA_ENV
RUNNABLE = [isa for isa in cpu_kernels.ISAS if cpu_kernels.unavailable(isa) is None]
# whether each ISA's extension runs here (on: the default where the CPU has it)
EXTENDED = {i: i in RUNNABLE and cpu_kernels.set_extension(True, i) for i in cpu_kernels.ISAS}
needs_every_isa = pytest.mark.skipif(
    len(RUNNABLE) < len(cpu_kernels.ISAS),
    reason=f"needs every kernel ISA: {[cpu_kernels.unavailable(i) for i in cpu_kernels.ISAS]}")


def test_the_environment_forces_the_isa(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    best = next((i for i in cpu_kernels.ISAS if not cpu_kernels._missing(i)), None)
    assert cpu_kernels.isa() == best
    for name in cpu_kernels.ISAS:
        monkeypatch.setenv(ENV, name)
        assert cpu_kernels.isa() == name
        if name in RUNNABLE:
            assert cpu_kernels.target("maxjax_int8_linear") == f"maxjax_int8_linear_{name}"
    monkeypatch.setenv(ENV, "none")
    assert cpu_kernels.isa() is None and cpu_kernels.unavailable() == "MAXJAX_CPU_ISA=none"
    with pytest.raises(UserError, match="cannot run: MAXJAX_CPU_ISA=none"):
        cpu_kernels.target("maxjax_write_kv")
    monkeypatch.setenv(ENV, "avx1024")
    for call in (cpu_kernels.isa, cpu_kernels.unavailable):
        with pytest.raises(UserError, match="MAXJAX_CPU_ISA='avx1024': expected one of "
                                            "avx512, avx2, none"):
            call()


def test_a_cpu_without_the_flags(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags",
                        lambda: frozenset({"avx2", "fma", "f16c", "avx512f"}))
    assert cpu_kernels.isa() == "avx2"
    assert cpu_kernels.unavailable("avx512") == "this CPU lacks avx512bw, avx512_vnni"
    monkeypatch.setenv(ENV, "avx512")          # forced: named, and unavailable naming why
    assert cpu_kernels.isa() == "avx512"
    assert cpu_kernels.unavailable() == "this CPU lacks avx512bw, avx512_vnni"
    monkeypatch.delenv(ENV)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    assert cpu_kernels.isa() is None
    assert cpu_kernels.unavailable() == "this CPU lacks avx2, fma, f16c"


def test_every_isas_targets_are_allowed_at_export():
    from maxjax.aot import graphs
    allowed = {c.is_custom_call() for c in graphs.EXPORT_CHECKS}
    for name in cpu_kernels.ISAS:
        for base in ("maxjax_int8_linear", "maxjax_int4_linear", "maxjax_paged_attention",
                     "maxjax_write_kv"):
            assert f"{base}_{name}" in cpu_kernels.TARGETS and f"{base}_{name}" in allowed


def linear(x, w, isa):
    return np.asarray(jax.jit(lambda x, w: cpu_kernels.packed_linear(x, w, isa=isa))(x, w))


def int8_weight(q):
    return cpu_kernels.pack_weight(quant.QuantizedWeight(jnp.asarray(q), jnp.ones(q.shape[1])))


def int4_weight(nib):
    i, o = nib.shape
    return cpu_kernels.pack_weight(quant.QuantizedWeight(
        jnp.asarray(pack_q4(nib)), jnp.ones((i // 32, o)), None, jnp.ones(o), bits=4))


@pytest.mark.skipif(not RUNNABLE, reason=f"CPU kernels: {cpu_kernels.unavailable()}")
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("rows", [1, 2, 3, 16])
def test_integer_sums_are_exact(isa, rows):
    """Activations of integers with |x| = 127 somewhere in each row quantize to themselves
    (scale 1, a zero second digit) and unit weight scales leave the int32 sums as they are:
    the outputs are x @ w exactly, extremes included (every product 127 * 128 or 15 * 127)."""
    rng = np.random.default_rng(rows)
    i, o = 256, 192
    x = rng.integers(-127, 128, (rows, i)).astype(np.float32)
    x[:, 0] = 127
    x[0] = 127
    if rows > 1:
        x[1] = -127
    q = rng.integers(-128, 128, (i, o)).astype(np.int8)
    q[:, :64] = -128
    q[:, 64:70] = 127
    q[::2, 70:72] = -128                       # -128 and 127 pairs in one 4-byte group
    want = x.astype(np.int64) @ q.astype(np.int64)
    np.testing.assert_array_equal(linear(jnp.asarray(x), int8_weight(q), isa), want)
    nib = rng.integers(0, 16, (i, o)).astype(np.uint8)
    nib[:, :64] = 15
    want4 = x.astype(np.int64) @ (nib.astype(np.int64) - 8)     # offset None: low = -8
    np.testing.assert_array_equal(linear(jnp.asarray(x), int4_weight(nib), isa), want4)


@needs_every_isa
@pytest.mark.parametrize("rows", [1, 2, 5, 40])
def test_isas_agree_bit_for_bit(rows):
    """The same digits, int32 sums and float32 order: the same bits (int8 and 4-bit)."""
    rng = np.random.default_rng(10 + rows)
    i, o = 384, 320
    x = jnp.asarray(rng.standard_normal((rows, i)).astype(np.float32))
    q = rng.integers(-128, 128, (i, o)).astype(np.int8)
    w8 = cpu_kernels.pack_weight(quant.QuantizedWeight(
        jnp.asarray(q), jnp.asarray(rng.uniform(1e-3, 2e-2, o).astype(np.float32))))
    nib = rng.integers(0, 16, (i, o)).astype(np.uint8)
    w4 = cpu_kernels.pack_weight(quant.QuantizedWeight(
        jnp.asarray(pack_q4(nib)), jnp.asarray(rng.uniform(1e-3, 2e-2, (i // 32, o)), jnp.float32),
        jnp.asarray(rng.uniform(-0.1, 0.1, (i // 32, o)), jnp.float32), jnp.ones(o), bits=4))
    for w in (w8, w4):
        got = {isa: linear(x, w, isa) for isa in RUNNABLE}
        assert np.abs(got["avx512"]).max() > 0
        np.testing.assert_array_equal(got["avx2"], got["avx512"])


@pytest.mark.parametrize("isa", [i for i in cpu_kernels.ISAS if EXTENDED[i]] or
                         [pytest.param(None, marks=pytest.mark.skip(
                             reason="no extension here (AMX-INT8, AVX-VNNI)"))])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 23, 40, 256])
def test_an_extension_gives_its_isas_bits(isa, rows):
    """AMX tiles take an int8 call's first multiple of 8 rows (weights of 576 inputs: 64 a tile
    row; of 96 not; 4-bit blocks never), AVX-VNNI every call of the avx2 kernels: the same bits
    as the ISA without them."""
    rng = np.random.default_rng(20 + rows)
    for i in (576, 96):
        x = jnp.asarray(rng.standard_normal((rows, i)).astype(np.float32))
        q = rng.integers(-128, 128, (i, 192)).astype(np.int8)
        w8 = cpu_kernels.pack_weight(quant.QuantizedWeight(
            jnp.asarray(q), jnp.asarray(rng.uniform(1e-3, 2e-2, 192).astype(np.float32))))
        nib = rng.integers(0, 16, (i, 192)).astype(np.uint8)
        w4 = cpu_kernels.pack_weight(quant.QuantizedWeight(
            jnp.asarray(pack_q4(nib)), jnp.asarray(rng.uniform(1e-3, 2e-2, (i // 32, 192)),
                                                   jnp.float32),
            jnp.asarray(rng.uniform(-0.1, 0.1, (i // 32, 192)), jnp.float32), jnp.ones(192),
            bits=4))
        for w in (w8, w4):
            try:
                assert cpu_kernels.set_extension(False, isa) is False
                plain = linear(x, w, isa)
            finally:
                assert cpu_kernels.set_extension(True, isa) is True
            extended = linear(x, w, isa)
            assert np.abs(extended).max() > 0
            np.testing.assert_array_equal(extended, plain)


@pytest.mark.skipif(not any(EXTENDED.values()), reason="no extension here (AMX-INT8, AVX-VNNI)")
def test_the_environment_turns_an_extension_off():
    code = ("from maxjax.graphs import cpu_kernels as k; "
            "assert k.unavailable() is None; print(k.extension())")
    for isa in (i for i in cpu_kernels.ISAS if EXTENDED[i]):
        name, variable = cpu_kernels.EXTENSIONS[isa]
        for value, want in (("0", "None"), ("1", name)):
            env = {**os.environ, variable: value, cpu_kernels.ISA_ENV: isa}
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                               text=True, timeout=300)
            assert r.stdout.strip() == want, r.stderr[-2000:]


@needs_every_isa
def test_attention_isas_agree():
    """One mixed bfloat16 step through both ISAs' attention: equal to float32 rounding (the
    sums go in another order; the K/V writes are bit for bit)."""
    from maxjax.graphs.step import RowSlice
    rng = np.random.default_rng(7)
    page, KV, hd, H, T = 16, 2, 64, 6, 24
    rows = [RowSlice([1] * 17, 30, [3, 1, 4]), RowSlice([1], 5, [2]),
            RowSlice([1] * 6, 0, [5])]
    pool = jnp.asarray(rng.standard_normal((2, 6, KV, page, hd)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((T, H, hd)), jnp.float32)
    table = np.zeros((4, 3), np.int32)
    token_row = np.full(T, -1, np.int32)
    positions = np.zeros(T, np.int32)
    t = 0
    for r, row in enumerate(rows):
        table[r, :len(row.pages)] = row.pages
        n = len(row.token_ids)
        token_row[t:t + n], positions[t:t + n] = r, np.arange(row.start_pos, row.start_pos + n)
        t += n
    slots = jnp.asarray(rng.permutation(np.arange(16, 96))[:T].astype(np.int32))
    new = jnp.asarray(rng.standard_normal((T, KV, hd)), jnp.float32)
    out, written = {}, {}
    for isa in RUNNABLE:
        out[isa] = np.asarray(jax.jit(lambda q, k, v: cpu_attention.paged_attention(
            q, k, v, 1, table, token_row, positions, 0, hd ** -0.5, isa=isa))(q, pool, pool))
        written[isa] = np.asarray(jax.jit(lambda p: cpu_attention.write_kv(
            p, 1, slots, new, page, isa=isa))(pool)).view(np.uint16)
    assert np.abs(out["avx512"][:t]).max() > 0 and not out["avx512"][t:].any()
    np.testing.assert_allclose(out["avx2"], out["avx512"], rtol=0, atol=2e-6)
    np.testing.assert_array_equal(written["avx2"], written["avx512"])


@needs_every_isa
def test_avx2_engine_gives_avx512_tokens(tmp_path, monkeypatch):
    """A tiny int8 model served with the kernels forced to avx2, then to avx512: the graphs
    call only that ISA's kernels (linears and attention), and the greedy tokens are equal."""
    from maxjax.engine.types import SamplingParams
    from maxjax.llm import LLM
    from maxjax.models.loader import load_model
    from tiny_llama import write_tiny_llama
    tiny = load_model(write_tiny_llama(str(tmp_path / "hf")), "int8", progress=False)
    engine = dict(max_batch_size=2, max_batch_input_tokens=8, max_length=32, num_kv_pages=12,
                  kv_cache_page_size=8, compile_cache=False)
    prompts = [[5, 17, 99, 3, 250, 41, 8, 11, 12, 13], [300, 2, 2, 77]]
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    target, asked = cpu_kernels.target, []
    monkeypatch.setattr(cpu_kernels, "target",
                        lambda name, isa=None: asked.append(target(name, isa)) or asked[-1])
    tokens = {}
    for isa in ("avx2", "avx512"):
        monkeypatch.setenv(ENV, isa)
        asked.clear()
        llm = LLM(tiny, use_experimental_kernels=True, **engine)
        assert llm.core.layout.attention == cpu_attention.CPU_PAGED_KERNEL.name
        tokens[isa] = [o.token_ids for o in llm.generate(prompts, greedy)]
        assert {"maxjax_int8_linear_" + isa, "maxjax_paged_attention_" + isa} <= set(asked)
        assert all(t.endswith("_" + isa) for t in asked), asked
    assert tokens["avx2"] == tokens["avx512"]
