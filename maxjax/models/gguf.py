"""GGUF files: metadata -> a transformers-style config.json dict, lazily dequantized tensors under
their HF names and layout, and the tokenizer and chat template the file carries.

Called by maxjax/models/loader.py `load_model` for a file path. The header is parsed here with `struct`
on an mmap (gguf's GGUFReader builds one numpy view per array element, ~5 s for a 49k-token vocab);
the block formats and their dequantization come from the `gguf` package, applied to whole tensors
at once. Tensors come out exactly as transformers' GGUF loader produces them: llama's Q/K rows
un-permuted, Gemma's RMSNorm weights with llama.cpp's +1 removed.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import struct

import numpy as np

from maxjax.errors import UserError
from maxjax.models import registry

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: 0-7 and 10-12 fixed-size scalars, 8 string, 9 array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
_CHUNK_BLOCKS = 1 << 15     # dequantize this many blocks per numpy pass: bounds the temporaries

# GGUF tensor names per HF decoder-layer suffix (llama.cpp's convert_hf_to_gguf naming); an
# architecture names those of its family that differ (Architecture.gguf_layer_names).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


class GGUFFile:
    """The parsed header of a GGUF file plus an mmap of it: `metadata` (key -> python value; arrays
    of numbers as numpy arrays, of strings as lists) and `tensors` (name -> TensorInfo)."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size < 24:
                    head = f.read(4)
                    if head != MAGIC:
                        raise UserError(f"{path}: not a GGUF file")
                    raise UserError(f"{path}: truncated GGUF file ({self.size} bytes)")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise UserError(f"{path}: cannot read: {e.strerror}") from e
        if self._mm[:4] != MAGIC:
            raise UserError(f"{path}: not a GGUF file (bad magic {bytes(self._mm[:4])!r})")
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: truncated or corrupt GGUF header ({e})") from None

    def _parse(self):
        mm = self._mm
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version not in VERSIONS:
            raise UserError(f"{self.path}: unsupported GGUF version {version} (supported: 2, 3)")
        self._off = 24
        self.metadata = {}
        for _ in range(n_kv):
            key = self._str()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        self.tensors = {}
        raw = []
        for _ in range(n_tensors):
            name = self._str()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            raw.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._off // align) * align
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        for name, dims, qtype, offset in raw:
            try:
                qt = GGMLQuantizationType(qtype)
            except ValueError:
                raise UserError(f"{self.path}: tensor {name} has unknown ggml type id {qtype}") from None
            block, type_size = GGML_QUANT_SIZES[qt]
            n = math.prod(dims)
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > self.size:
                raise UserError(f"{self.path}: truncated GGUF file (tensor {name} ends at byte "
                                f"{start + nbytes}, the file has {self.size})")
            # GGUF lists dims innermost first; numpy wants them outermost first.
            self.tensors[name] = (qt, tuple(reversed(dims)), start, nbytes)

    def _unpack(self, fmt: str):
        vals = struct.unpack_from(fmt, self._mm, self._off)
        self._off += struct.calcsize(fmt)
        return vals

    def _str(self) -> str:
        (n,) = struct.unpack_from("<Q", self._mm, self._off)
        start = self._off + 8
        if start + n > self.size:
            raise ValueError("string runs past the end of the file")
        self._off = start + n
        return self._mm[start:start + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype])[0]
        if vtype == 8:
            return self._str()
        if vtype == 9:
            etype, n = self._unpack("<IQ")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                if self._off + n * dt.itemsize > self.size:
                    raise ValueError("array runs past the end of the file")
                arr = np.frombuffer(self._mm, dtype=dt, count=n, offset=self._off).copy()
                self._off += n * dt.itemsize
                return arr
            if etype == 8:
                return [self._str() for _ in range(n)]
            return [self._value(etype) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype}")

    def raw(self, name: str) -> tuple:
        qt, shape, start, nbytes = self.tensors[name]
        return qt, shape, np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=start)

    def close(self):
        # Arrays returned by raw() may still view the mmap; let the GC unmap it.
        self._mm = None


def dequantize(qt, shape: tuple, data: np.ndarray) -> np.ndarray:
    """Raw little-endian tensor bytes of ggml type `qt` -> float32 array of `shape`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
    if qt.name not in SUPPORTED_TYPES:
        raise UserError(f"unsupported GGUF tensor type {qt.name} (supported: {', '.join(SUPPORTED_TYPES)})")
    if qt == T.F32:
        return data.view(np.float32).reshape(shape)
    if qt == T.F16:
        return data.view(np.float16).astype(np.float32).reshape(shape)
    if qt == T.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    block, type_size = GGML_QUANT_SIZES[qt]
    blocks = data.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block), np.float32)
    fast = _FAST.get(qt.name)
    if fast is None:
        from gguf.quants import _type_traits
        fast = _type_traits[qt].dequantize_blocks
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[i:i + _CHUNK_BLOCKS] = fast(blocks[i:i + _CHUNK_BLOCKS])
    return out.reshape(shape)


# The formats SmolLM2 and most GGUFs are made of, with fewer temporaries than gguf's generic
# versions (same arithmetic: d * q [+ m] in float32; tests compare both bit for bit).
def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return _half(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    q = np.empty((qs.shape[0], 2 * qs.shape[1]), np.float32)
    half = qs.shape[1]
    q[:, :half] = qs & np.uint8(0x0F)
    q[:, half:] = qs >> np.uint8(4)
    return q


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:])
    q -= np.float32(8)
    q *= _half(blocks, 0)
    return q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:])
    q *= _half(blocks, 0)
    q += _half(blocks, 2)
    return q


_FAST = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation (convert_hf_to_gguf LlamaModel.permute): within
    each head it stores the even rotary rows first, then the odd; HF keeps the two halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def layer_names(arch) -> dict[str, str]:
    """HF decoder-layer suffix -> GGUF suffix for `arch`'s family."""
    names = LAYER_NAMES | dict(arch.gguf_layer_names)
    return {k: v for k, v in names.items() if v is not None}


class GGUFTensorReader:
    """`reader(hf_name)` -> float32 numpy array in HF naming and layout, dequantized on demand."""

    converted: dict = {}     # Architecture.gguf_tensors (set per reader; never mutated)

    def __init__(self, gf: GGUFFile, gguf_arch: str, hf: dict):
        arch = registry.for_gguf_arch(gguf_arch)
        self.gf = gf
        self.permute = arch.gguf_permuted_qk
        self.norm_plus_one = arch.gguf_norm_plus_one
        self.layer_names = layer_names(arch)
        self.converted = dict(arch.gguf_tensors)
        self.hf = hf
        self.n_heads = hf["num_attention_heads"]
        self.n_kv_heads = hf["num_key_value_heads"]

    def gguf_name(self, hf_name: str) -> str | None:
        if hf_name in _TOP_NAMES:
            return _TOP_NAMES[hf_name]
        m = _LAYER_RE.fullmatch(hf_name)
        if m and m.group(2) in self.converted:
            sources = self.converted[m.group(2)][0]
            return next((f"blk.{m.group(1)}.{s}" for s in sources
                         if f"blk.{m.group(1)}.{s}" in self.gf.tensors),
                        f"blk.{m.group(1)}.{sources[0]}")
        if m and m.group(2) in self.layer_names:
            return f"blk.{m.group(1)}.{self.layer_names[m.group(2)]}"
        return None

    def _converted(self, hf_name: str):
        """An Architecture.gguf_tensors tensor made from its layer's GGUF tensors; None for
        another name."""
        m = _LAYER_RE.fullmatch(hf_name)
        if not m or m.group(2) not in self.converted:
            return None
        prefix = f"blk.{m.group(1)}."

        def read(suffix):
            name = prefix + suffix
            return dequantize(*self.gf.raw(name)) if name in self.gf.tensors else None
        if not any(prefix + s in self.gf.tensors for s in self.converted[m.group(2)][0]):
            raise UserError(f"{self.gf.path}: GGUF has no tensor for {hf_name!r} (looked for "
                            f"{self.gguf_name(hf_name)})")
        return np.asarray(self.converted[m.group(2)][1](read, self.hf), np.float32)

    def names(self) -> list[str]:
        inverse = {v: k for k, v in _TOP_NAMES.items()}
        layer_inverse = {v: k for k, v in self.layer_names.items()}
        out = []
        for name in self.gf.tensors:
            if name in inverse:
                out.append(inverse[name])
            elif (m := re.fullmatch(r"blk\.(\d+)\.(.+)", name)) and m.group(2) in layer_inverse:
                out.append(f"model.layers.{m.group(1)}.{layer_inverse[m.group(2)]}")
        blocks = {m.group(1) for name in self.gf.tensors
                  if (m := re.fullmatch(r"blk\.(\d+)\..+", name))}
        out += [f"model.layers.{i}.{hf}" for i in sorted(blocks, key=int)
                for hf, (sources, _) in self.converted.items()
                if any(f"blk.{i}.{s}" in self.gf.tensors for s in sources)]
        return out

    def __call__(self, hf_name: str) -> np.ndarray:
        converted = self._converted(hf_name)
        if converted is not None:
            return converted
        name = self.gguf_name(hf_name)
        if name is None or name not in self.gf.tensors:
            raise UserError(f"{self.gf.path}: GGUF has no tensor for {hf_name!r}"
                            + (f" (looked for {name})" if name else ""))
        w = dequantize(*self.gf.raw(name))
        if self.permute and (".attn_q." in name or ".attn_k." in name):
            w = unpermute_qk(w, self.n_heads if ".attn_q." in name else self.n_kv_heads)
        if self.norm_plus_one and name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        return w

    def q4(self, hf_name: str):
        """A 4-bit (Q4_0 / Q4_1 / Q4_K) tensor as `quantize.decode_q4` gives it, in HF layout;
        None for a tensor of another type."""
        from maxjax.models import quantize
        name = self._raw_name(hf_name)
        qt, shape, data = self.gf.raw(name) if name in self.gf.tensors else (None, None, None)
        if qt is None or qt.name not in quantize.Q4_TYPES.values():
            return None
        parts = quantize.decode_q4(qt.name, shape, data)
        if self.permute and (".attn_q." in name or ".attn_k." in name):
            heads = self.n_heads if ".attn_q." in name else self.n_kv_heads
            parts = tuple(None if p is None else unpermute_qk(p, heads) for p in parts)
        return parts

    def q4_blocks(self, hf_name: str):
        """A Q4_0 / Q4_1 tensor as its type's name and raw blocks [rows, cols / 32, block bytes]
        in HF row order (quantize.q4_block_bytes, packed as they are for the CPU kernels); None for
        a tensor of another type."""
        name = self.gguf_name(hf_name)
        qt, shape, data = self.gf.raw(name) if name in self.gf.tensors else (None, None, None)
        if qt is None or qt.name not in ("Q4_0", "Q4_1"):
            return None
        rows, cols = shape
        blocks = data.reshape(rows, cols // 32, -1)
        if self.permute and (".attn_q." in name or ".attn_k." in name):
            blocks = unpermute_qk(blocks, self.n_heads if ".attn_q." in name else self.n_kv_heads)
        return qt.name, blocks

    def _raw_name(self, hf_name: str) -> str | None:
        """The GGUF tensor whose blocks are `hf_name`'s as they are (None: a converted one)."""
        m = _LAYER_RE.fullmatch(hf_name)
        return None if m and m.group(2) in self.converted else self.gguf_name(hf_name)

    def matrix_types(self) -> list[str]:
        """The GGUF type of every 2-D tensor (what `quantize.gguf_encoding` reads)."""
        return [qt.name for qt, shape, *_ in self.gf.tensors.values() if len(shape) == 2]

    def close(self):
        self.gf.close()


# --- config -----------------------------------------------------------------------------------

def _llama3_scaling(freqs: np.ndarray, theta: float, head_dim: int, md: dict, prefix: str):
    """llama.cpp stores Llama-3 rope scaling as per-frequency divisors (rope_freqs.weight), not as
    parameters: find the standard parameters that reproduce them."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    factors = [float(md[prefix + "rope.scaling.factor"])] if prefix + "rope.scaling.factor" in md \
        else [8.0, 32.0, 16.0, 4.0, 2.0]
    orig = int(md.get(prefix + "rope.scaling.original_context_length", 8192))
    for factor in factors:
        for low, high in ((1.0, 4.0), (1.0, 2.0)):
            smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
            want = np.where(wavelen < orig / high, 1.0,
                            np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
            if np.allclose(want, freqs.astype(np.float64), rtol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": orig}
    raise UserError("GGUF rope_freqs.weight does not match Llama-3 rope scaling with standard "
                    "parameters; this rope scaling is not supported")


def hf_config(gf: GGUFFile, gguf_arch: str, arch_name: str) -> dict:
    """A transformers-style config.json dict from GGUF metadata (mirrors transformers' GGUF
    config mapping, plus the fields our architectures read that transformers takes as defaults)."""
    md = gf.metadata
    p = gguf_arch + "."
    arch = registry.get_architecture(arch_name)

    def get(key, default=None):
        v = md.get(p + key, default)
        return v.item() if isinstance(v, np.generic) else v

    def need(key):
        if p + key not in md:
            raise UserError(f"{gf.path}: GGUF metadata lacks {p + key}")
        return get(key)

    heads = int(need("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, np.ndarray):    # per-layer lists: take the widest
        kv_heads = int(kv_heads.max())
    hidden = int(need("embedding_length"))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None and "token_embd.weight" in gf.tensors:
        vocab = gf.tensors["token_embd.weight"][1][0]
    theta = float(get("rope.freq_base", 10000.0))
    hf = {
        "architectures": [arch_name],
        "model_type": gguf_arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "attention_out_bias": "blk.0.attn_output.bias" in gf.tensors,
        "torch_dtype": "float32",
    }
    for key, field in (("bos_token_id", "bos_token_id"), ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in md:
            hf[field] = int(md[f"tokenizer.ggml.{key}"])
    eos = [int(md[f"tokenizer.ggml.{k}"]) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if f"tokenizer.ggml.{k}" in md]
    eos = list(dict.fromkeys(eos))
    if eos:
        hf["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise UserError(f"{gf.path}: unsupported GGUF rope scaling {scaling_type!r} (supported: linear)")
    if "rope_freqs.weight" in gf.tensors:
        freqs = dequantize(*gf.raw("rope_freqs.weight"))
        hf["rope_scaling"] = _llama3_scaling(freqs, theta, int(head_dim), md, p)
    if arch.gguf_config is not None:
        try:
            arch.gguf_config(hf, get, gf.tensors)
        except ValueError as e:
            raise UserError(f"{gf.path}: {e}") from None
    return hf


def load_tokenizer(gf: GGUFFile, gguf_arch: str, cls_name: str | None = None):
    """transformers' tokenizer for the GGUF's `tokenizer.ggml.*` metadata, built the way
    `TokenizersBackend.from_pretrained(dir, gguf_file=...)` builds it (transformers'
    get_gguf_tokenizer + convert_gguf_tokenizer) but from the metadata parsed here:
    AutoTokenizer re-reads the file twice, once through gguf's slow reader (~8 s for SmolLM2).
    `cls_name`: the tokenizer class (Architecture.gguf_tokenizer; None: AutoTokenizer's)."""
    import transformers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    md = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in gf.metadata.items()
          if k.startswith("tokenizer.")}
    grouped = {group: {name: md[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in md}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)   # llama.cpp's default for sentencepiece vocabs
    for name, key in _SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    if cls_name is None:    # AutoTokenizer's choice; its module imports torch (~3 s), so only here
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
        cls_name = TOKENIZER_MAPPING_NAMES.get(gguf_arch)
    cls = getattr(transformers, cls_name, None) if isinstance(cls_name, str) else None
    cls = cls or transformers.TokenizersBackend
    try:
        backend, extra = convert_gguf_tokenizer(gguf_arch, tokenizer)
        return cls(tokenizer_object=backend, **config, **extra)
    except Exception as e:
        raise UserError(f"{gf.path}: cannot build the tokenizer from the GGUF metadata: "
                        f"{type(e).__name__}: {e}") from e


def open_gguf(path: str, tokenizer: bool = True):
    """(hf_config, reader, tokenizer, chat_template) for a GGUF file; see the module docstring.
    `tokenizer` False: a callable that builds the tokenizer in its place (maxjax/models/loader.py
    runs it on a thread while the weights convert)."""
    gf = GGUFFile(path)
    gguf_arch = gf.metadata.get("general.architecture")
    if not isinstance(gguf_arch, str):
        raise UserError(f"{path}: GGUF metadata lacks general.architecture")
    arch = registry.for_gguf_arch(gguf_arch)
    for name, (qt, *_rest) in gf.tensors.items():
        if qt.name not in SUPPORTED_TYPES:
            raise UserError(f"{path}: tensor {name} uses GGUF type {qt.name}, which is not supported "
                            f"(supported: {', '.join(SUPPORTED_TYPES)})")
    hf = hf_config(gf, gguf_arch, arch.name)
    reader = GGUFTensorReader(gf, gguf_arch, hf)
    def make():
        return load_tokenizer(gf, gguf_arch, arch.gguf_tokenizer) \
            if "tokenizer.ggml.tokens" in gf.metadata else None
    template = gf.metadata.get("tokenizer.chat_template")
    return hf, reader, make() if tokenizer else make, template if isinstance(template, str) else None
