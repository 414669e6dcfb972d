"""Weight encodings (`--quantization-encoding`) and the host-side conversion into the graph's
QuantizedWeight formats (graphs/quant.py).

  float32 | bfloat16 | float16   float weights (a GGUF is dequantized)
  int8                           int8 per output channel, from any source (a GGUF dequantized, then
                                 rounded at max|w| / 127 of each channel)
  q4_0 | q4_1 | q4_k             a GGUF's 4-bit blocks as they are (nibbles and block scales); a
                                 fused projection with a part of another type, and the
                                 embedding table, are int8 per channel
A quantized GGUF serves as int8 unless told otherwise (float32 when its matrices are all float):
measured on XLA:CPU (BENCHMARKS.md, Quantized weights), the 4-bit blocks unpacked in the graph
made a SmolLM2 decode step 4.8x slower than float32 at 1 row, int8 1.4x faster.
Called by graphs/decoder.py `params_from_hf` through `Quantizer`; maxjax/models/loader.py picks
the encoding.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from maxjax.errors import UserError

FLOAT_ENCODINGS = ("float32", "bfloat16", "float16")
Q4_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k": "Q4_K"}     # encoding -> GGUF type
QUANTIZED_ENCODINGS = ("int8", *Q4_TYPES)
ENCODINGS = FLOAT_ENCODINGS + QUANTIZED_ENCODINGS
BLOCK = 32


def is_quantized(encoding: str) -> bool:
    return encoding in QUANTIZED_ENCODINGS


def is_4bit(encoding: str) -> bool:
    return encoding in Q4_TYPES


def native_4bit(types: list[str]) -> str | None:
    """The 4-bit encoding most of a GGUF's matrices (their GGUF `types`) have, if any."""
    q4 = Counter(t for t in types if t in Q4_TYPES.values())
    return q4.most_common(1)[0][0].lower() if q4 else None


def gguf_encoding(types: list[str], kernels: bool = False) -> str:
    """The encoding a GGUF serves in by default, from the types of its 2-D tensors: a quantized
    one int8, or where the CPU kernels run (`kernels`: maxjax/engine/build.resolve_kernels) its
    own 4-bit blocks, which their kernel reads faster at a few rows and more exactly
    (BENCHMARKS.md, CPU kernels)."""
    if all(t in ("F32", "F16", "BF16") for t in types):
        return "float32"
    return (kernels and native_4bit(types)) or "int8"


def check_name(encoding: str) -> None:
    if encoding not in ENCODINGS:
        raise UserError(f"unsupported --quantization-encoding {encoding!r} "
                        f"(supported: {', '.join(ENCODINGS)})")


def check_encoding(encoding: str, source_types: list[str] | None, arch=None) -> None:
    """UserError unless `encoding` can be served from a source whose 2-D tensors have
    `source_types` (None: a float checkpoint), by `arch` (graphs/arch.py) when given."""
    check_name(encoding)
    if encoding == "float16" and arch is not None and arch.float16_overflows:
        raise UserError(f"--quantization-encoding float16: {arch.name} overflows float16 (its "
                        f"activations pass 65504: NaN logits, as in transformers; vLLM refuses "
                        f"it too): use bfloat16 or float32")
    if encoding in Q4_TYPES and Q4_TYPES[encoding] not in (source_types or ()):
        have = native_4bit(source_types) if source_types else None
        options = ", ".join(([have] if have else []) + list(FLOAT_ENCODINGS) + ["int8"])
        raise UserError(f"--quantization-encoding {encoding}: the checkpoint holds no "
                        f"{Q4_TYPES[encoding]} weights (it serves as: {options})")


def supported_encodings(source_types: list[str] | None, arch=None) -> list[str]:
    """The encodings `check_encoding` accepts for a source of these 2-D tensor types."""
    ok = []
    for encoding in ENCODINGS:
        try:
            check_encoding(encoding, source_types, arch)
        except UserError:
            continue
        ok.append(encoding)
    return ok


def abstract_params(specs: dict, encoding: str, types_of=None) -> dict:
    """The ShapeDtypeStructs of the params pytree that graphs/decoder.py `params_from_hf` (with a
    `Quantizer` for a quantized encoding) makes from a checkpoint, from the architecture's
    `param_specs` (nothing read): float weights all in the encoding; quantized ones float32 but
    for the 2-D tensors, each a QuantizedWeight like `Quantizer.matrix` / `table` makes it.
    `types_of(layer, key)`: the GGUF types of the tensors fused into that layer's matrix (None:
    not a GGUF), which decide whether a 4-bit encoding keeps its blocks."""
    import jax

    from maxjax.graphs.moe import FLOAT_MATRICES
    from maxjax.graphs.quant import QuantizedWeight
    sds = jax.ShapeDtypeStruct
    if not is_quantized(encoding):
        from maxjax.graphs.sharding import abstract
        return abstract(specs, jax.numpy.dtype(encoding))

    def int8(shape, out_axis):
        return QuantizedWeight(sds(shape, np.int8), sds((shape[out_axis],), np.float32))

    def matrix(spec, i, key):
        types = (types_of(i, key) if types_of else None) or ["?"]
        if encoding not in Q4_TYPES or not all(t in Q4_TYPES.values() for t in types):
            return int8(spec.shape, -1)
        d_in, d_out = spec.shape
        blocks = sds((d_in // BLOCK, d_out), np.float32)
        offset = None if all(t == "Q4_0" for t in types) else blocks
        return QuantizedWeight(sds((d_in // 2, d_out), np.uint8), blocks, offset,
                               sds((d_out,), np.float32), bits=4)

    def leaf(spec, i=None, key=None):
        if len(spec.shape) == 3:        # stacked experts (graphs/moe.py): int8 only
            e, d_in, d_out = spec.shape
            return QuantizedWeight(sds(spec.shape, np.int8), sds((e, d_out), np.float32))
        if len(spec.shape) != 2 or key in FLOAT_MATRICES:
            return sds(spec.shape, np.float32)
        return int8(spec.shape, spec.out_axis % 2) if i is None else matrix(spec, i, key)
    out = {k: leaf(v) for k, v in specs.items() if k != "layers"}
    out["layers"] = [{k: leaf(v, i, k) for k, v in layer.items()}
                     for i, layer in enumerate(specs["layers"])]
    return {k: out[k] for k in specs}


# --- int8 per channel -------------------------------------------------------------------------

def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float w [rows, cols] -> (int8 q, float32 scale [rows]) with w ~ scale[:, None] * q."""
    w = np.asarray(w, np.float32)
    amax = np.maximum(w.max(axis=1), -w.min(axis=1))
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = w / scale[:, None]
    np.rint(q, out=q)
    return np.clip(q, -127, 127, out=q).astype(np.int8), scale


# --- GGUF 4-bit blocks ------------------------------------------------------------------------

def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _q4_0(blocks):
    qs = blocks[:, 2:]
    nib = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return nib[:, None, :], _half(blocks, 0), None


def _q4_1(blocks):
    qs = blocks[:, 4:]
    nib = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    d, m = _half(blocks, 0), _half(blocks, 2)
    return nib[:, None, :], d, m + np.float32(8) * d


def q4_block_bytes(type_name: str, blocks: np.ndarray):
    """A Q4_0 / Q4_1 tensor's raw blocks [rows, cols/32, block bytes], undecoded: (bytes
    [rows, cols/32, 16], byte j holding inputs j (low nibble) and j + 16 (high); scale and low
    [rows, cols/32]) with w = scale * nibble + low."""
    rows, nb, size = blocks.shape
    flat = blocks.reshape(-1, size)
    scale = _half(flat, 0)
    low = _half(flat, 2) if type_name == "Q4_1" else np.float32(-8) * scale
    return blocks[..., size - 16:], scale.reshape(rows, nb), low.reshape(rows, nb)


def _q4_k(blocks):
    """Q4_K super-blocks of 256 = 8 sub-blocks of 32, each w = d * sc * q - dmin * m with 6-bit
    sc and m (gguf.quants.Q4_K's layout)."""
    from gguf.quants import Q4_K
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    nib = (qs & 0x0F).reshape(n, 8, 32)
    scale = d * sc.astype(np.float32)
    return nib, scale, np.float32(8) * scale - dmin * mn.astype(np.float32)


_DECODE = {"Q4_0": (_q4_0, 18), "Q4_1": (_q4_1, 20), "Q4_K": (_q4_k, 144)}


def decode_q4(type_name: str, shape: tuple, data: np.ndarray):
    """A GGUF 4-bit tensor [rows, cols] -> (nibbles uint8 [rows, cols], scale float32
    [rows, cols/32], offset float32 [rows, cols/32] or None): w = scale * (nibble - 8) + offset
    in each block of 32 columns."""
    rows, cols = shape
    decode, size = _DECODE[type_name]
    nib, scale, offset = decode(data.reshape(-1, size))
    nb = cols // BLOCK
    out = (nib.reshape(rows, cols).astype(np.uint8), scale.reshape(rows, nb).astype(np.float32),
           None if offset is None else offset.reshape(rows, nb).astype(np.float32))
    return out


def dequantize_q4(nib, scale, offset) -> np.ndarray:
    """The float32 weights [rows, cols] of decode_q4's output (the graph's formula)."""
    rows, cols = nib.shape
    w = (nib.reshape(rows, -1, BLOCK).astype(np.float32) - 8) * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return w.reshape(rows, cols)


def q4_row_amax(nib, scale, offset) -> np.ndarray:
    """max |w| of each row of dequantize_q4's output, from each block's smallest and largest
    nibble: w is monotonic in the nibble within a block, its rounding too, so this is exact."""
    rows, cols = nib.shape
    blocks = nib.reshape(rows, -1, BLOCK)
    ends = [(blocks.min(-1).astype(np.float32) - 8) * scale,
            (blocks.max(-1).astype(np.float32) - 8) * scale]
    if offset is not None:
        ends = [e + offset for e in ends]
    return np.maximum(np.abs(ends[0]), np.abs(ends[1])).max(axis=1)


def pack_q4(nib_in_out: np.ndarray) -> np.ndarray:
    """Nibbles [in, out] -> uint8 [in/2, out]: in each block of 32 inputs, packed row j holds
    input j (low nibble) and input j + 16 (high nibble)."""
    d_in, out = nib_in_out.shape
    b = nib_in_out.reshape(d_in // BLOCK, 2, BLOCK // 2, out)
    return (b[:, 0] | (b[:, 1] << 4)).reshape(d_in // 2, out).astype(np.uint8)


class Quantizer:
    """Turns the HF-named tensors of one checkpoint into QuantizedWeights in `encoding`.
    `get(name)` gives float32 arrays; `raw(name)` (a GGUF reader) gives a 4-bit tensor's
    decode_q4 output in HF layout, None for another type; `blocks(name)`, given where the CPU
    kernels run, a Q4_0 / Q4_1 tensor's raw blocks (GGUFTensorReader.q4_blocks), which `matrix`
    packs for them directly."""

    def __init__(self, encoding: str, get, raw=None, blocks=None):
        self.encoding, self.get, self.raw, self.blocks = encoding, get, raw, blocks

    def matrix(self, names: list[str]):
        """The fused [in, out] projection of HF weights `names` ([out, in] each, fused on out)."""
        from maxjax.graphs.quant import QuantizedWeight
        import jax
        packed = self._kernel_packed(names)
        if packed is not None:
            return packed
        parts = self._q4_parts(names)
        if parts is None:
            q, scale = int8_rows(np.concatenate([np.asarray(self.get(n), np.float32)
                                                 for n in names]))
            return QuantizedWeight(jax.device_put(np.ascontiguousarray(q.T)),
                                   jax.device_put(scale))
        nib = np.concatenate([p[0] for p in parts])
        scale = np.concatenate([p[1] for p in parts])
        offsets = [p[2] for p in parts]
        offset = None if all(o is None for o in offsets) else np.concatenate(
            [np.zeros_like(p[1]) if o is None else o for p, o in zip(parts, offsets)])
        amax = q4_row_amax(nib, scale, offset)
        requant = np.where(amax > 0, np.float32(127) / amax, np.float32(1)).astype(np.float32)
        put = jax.device_put
        return QuantizedWeight(put(pack_q4(np.ascontiguousarray(nib.T))), put(scale.T.copy()),
                               None if offset is None else put(offset.T.copy()), put(requant),
                               bits=4)

    def reading(self, get, raw=None) -> Quantizer:
        """This encoding over other tensor sources (an architecture that renames or splits
        them: graphs/phi3.py); no raw blocks for the CPU kernels."""
        return Quantizer(self.encoding, get, raw)

    def expert_stack(self, stack: np.ndarray):
        """Stacked expert weights [E, in, out] as int8 per expert and output channel: q
        [E, in, out], scale [E, out] (graphs/moe.py `stacked_experts`)."""
        from maxjax.graphs.quant import QuantizedWeight
        import jax
        qs, scales = zip(*(int8_rows(w.T) for w in stack))
        return QuantizedWeight(jax.device_put(np.ascontiguousarray(np.stack([q.T for q in qs]))),
                               jax.device_put(np.stack(scales)))

    def table(self, name: str):
        """An embedding table [vocab, hidden] as int8 rows (also the tied LM head)."""
        from maxjax.graphs.quant import QuantizedWeight
        import jax
        q, scale = int8_rows(self.get(name))
        return QuantizedWeight(jax.device_put(q), jax.device_put(scale))

    def _kernel_packed(self, names):
        """The matrix packed for the CPU kernels straight from its GGUF blocks (one Q4_0 / Q4_1
        type across `names`); None otherwise."""
        if self.blocks is None or self.encoding not in Q4_TYPES:
            return None
        parts = [self.blocks(n) for n in names]
        if any(p is None for p in parts) or len({kind for kind, _ in parts}) != 1:
            return None
        from maxjax.graphs import cpu_kernels
        return cpu_kernels.pack_q4_bytes(*q4_block_bytes(parts[0][0],
                                                         np.concatenate([b for _, b in parts])))

    def _q4_parts(self, names):
        if self.encoding not in Q4_TYPES or self.raw is None:
            return None
        parts = [self.raw(n) for n in names]
        if any(p is None for p in parts):
            return None
        return parts
