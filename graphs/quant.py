"""Quantized weights in the graph: what `layers.linear` does with a `QuantizedWeight`.

Two formats, both read as integers by an int8 x int8 -> int32 dot, the one fast quantized kernel
of XLA:CPU (YNNPACK, for dots of >= 2 rows; DESIGN.md):
  bits=8  int8 per output channel: q int8 [in, out], w = scale[out] * q.
  bits=4  GGUF 4-bit blocks of 32 inputs (Q4_0, Q4_1, Q4_K): q uint8 [in/2, out], two nibbles a
          byte (in each block of 32 inputs, packed row j holds input j in its low nibble and
          input j+16 in its high one, as GGUF does); w = scale[b] * (nibble - 8) + offset[b]
          for block b (offset None: Q4_0). In the graph the block weights are unpacked and
          rounded to int8 at one scale per output channel (`requant` = 127 / max|w| of the
          channel, fixed at load), then take the int8 dot: a dot per 32-input block (the
          GGUF arithmetic) wrote a [blocks, rows, out] int32 partial that made it 4-8x slower
          than float32, and dequantizing to float32 before the dot is not fused into it
          (BENCHMARKS.md, Quantized weights).
Activations are quantized per row inside the graph, in two int8 digits: x ~ s1 * x1 + s2 * x2
with x1 = round(x / s1), s1 = max|x| / 127, and x2 the same of the remainder x - s1 * x1. Both
digits go through one dot (rows stacked), so the weight is read once: a single digit (plain
per-row W8A8) cost SmolLM2 +5% perplexity over 2,048 tokens, two cost <1% (BENCHMARKS.md). The
stacking also gives a one-row step two rows: XLA:CPU turns a one-row dot into a matrix-vector
product that skips the int8 kernel (and converts the int8 weight to float32 in full).

On a mesh a quantized weight shards as its float version does (`param_specs`): q keeps the float
weight's logical axes, per-channel scales take its output axis, 4-bit block scales and offsets
both axes, so a row-parallel split of the input axis falls between whole 32-input blocks (when
the blocks do not divide by the devices, maxjax/engine/devices.py refuses).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from maxjax.graphs.quantized_weight import QuantizedWeight
from maxjax.graphs.sharding import ArraySpec


BLOCK = 32
DIGITS = 2      # activation digits; read at trace time (tools/bench_quant.py measures 1 too)


def specs(spec: ArraySpec, w: QuantizedWeight) -> QuantizedWeight:
    """The ArraySpecs of w's arrays, from the spec of the float weight it stands for."""
    if w.shape != spec.shape:
        raise ValueError(f"quantized weight of shape {w.shape} for a parameter of {spec.shape}")
    if len(spec.shape) == 3:        # stacked experts: a scale per expert and output channel
        return QuantizedWeight(spec, ArraySpec((spec.shape[0], spec.shape[2]),
                                               (spec.axes[0], spec.axes[2])))
    out = spec.out_axis % 2
    channels = ArraySpec((spec.shape[out],), (spec.axes[out],))
    if w.bits == 8:
        return QuantizedWeight(spec, channels)
    if out != 1:
        raise ValueError(f"4-bit weights are [in, out] matrices, not a table of axes {spec.axes}")
    d_in, d_out = spec.shape
    blocks = ArraySpec((d_in // BLOCK, d_out), spec.axes)
    return QuantizedWeight(ArraySpec((d_in // 2, d_out), spec.axes), blocks,
                           None if w.offset is None else blocks,
                           None if w.requant is None else channels, bits=4)


def param_specs(float_specs, params):
    """`float_specs` (an architecture's param_specs) with each QuantizedWeight of `params` (real
    or abstract arrays) in its place given `specs`: the one declaration, quantized or not."""
    return jax.tree.map(lambda s, p: specs(s, p) if isinstance(p, QuantizedWeight) else s,
                        float_specs, params, is_leaf=lambda x: isinstance(x, ArraySpec))


def quantize_rows(x):
    """x [..., in] float -> (int8 xq, float32 scale [..., 1]) with x ~ xq * scale."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    sx = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(xf / sx), -127, 127).astype(jnp.int8), sx


def unpack_int4(q):
    """Packed uint8 [in/2, out] -> the centered nibbles int8 [in/32, 32, out], in input order."""
    half, out = q.shape
    q = q.reshape(half * 2 // BLOCK, BLOCK // 2, out)
    lo = (q & 0x0F).astype(jnp.int8) - 8
    hi = (q >> 4).astype(jnp.int8) - 8
    return jnp.concatenate([lo, hi], axis=1)


def int8_weight(w: QuantizedWeight):
    """(int8 [in, out], per-channel float32 scale [out]) of either format."""
    if w.bits == 8:
        return w.q, w.scale
    nib = unpack_int4(w.q).astype(jnp.float32)
    wf = nib * w.scale[:, None, :]
    if w.offset is not None:
        wf = wf + w.offset[:, None, :]
    q = jnp.clip(jnp.round(wf * w.requant), -127, 127).astype(jnp.int8)
    return q.reshape(-1, q.shape[-1]), 1.0 / w.requant


def linear(x, w: QuantizedWeight, transposed: bool = False, out_dtype=None, live=None):
    """x [..., in] @ w ([out, in] stored when `transposed`: the int8 embedding table as LM head;
    a 4-D `q`: packed for the CPU kernel of graphs/cpu_kernels.py, already in [in, out] order,
    which computes only the first `live` rows)."""
    if w.q.ndim == 4:
        from maxjax.graphs import cpu_kernels
        return cpu_kernels.packed_linear(x, w, live).astype(out_dtype or x.dtype)
    lead, d_in = x.shape[:-1], x.shape[-1]
    rest = x.reshape(-1, d_in).astype(jnp.float32)
    rows = rest.shape[0]
    digits, scales = [], []
    for _ in range(DIGITS):
        xq, sx = quantize_rows(rest)
        digits.append(xq)
        scales.append(sx)
        rest = rest - xq.astype(jnp.float32) * sx
    if rows * DIGITS == 1:
        digits.append(jnp.zeros_like(digits[0]))
    q, scale = int8_weight(w)
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    acc = jax.lax.dot_general(jnp.concatenate(digits), q, (contract, ((), ())),
                              preferred_element_type=jnp.int32).astype(jnp.float32)
    y = sum(acc[i * rows:(i + 1) * rows] * sx for i, sx in enumerate(scales)) * scale
    return y.reshape(*lead, -1).astype(out_dtype or x.dtype)


def embed(table, ids):
    """Rows `ids` of an embedding table (a float array, or int8 per-row QuantizedWeight [V, D])."""
    if isinstance(table, QuantizedWeight):
        return table.q[ids].astype(jnp.float32) * table.scale[ids][:, None]
    return table[ids]
