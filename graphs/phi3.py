"""Phi3ForCausalLM (Phi-3, Phi-4, Phi-4-mini): Llama with fused checkpoint projections
(self_attn.qkv_proj = q|k|v, mlp.gate_up_proj = gate|up), cut at load time into the decoder's
q/k/v and gate/up names (the decoder fuses them again its own way, so quantization and tensor
parallelism see nothing new), rope on the first partial_rotary_factor of each head
(Phi-4-mini), and an optional sliding window on every layer (transformers' modeling_phi3).
LongRoPE (rope_scaling su / longrope with short_factor and long_factor: the 128k variants and
Phi-4-mini) is refused: transformers switches the whole sequence to the long factors once it
passes original_max_position_embeddings, which a paged cache of short-factor keys cannot follow.
"""
from __future__ import annotations

import re

from maxjax.graphs import decoder
from maxjax.graphs.arch import Architecture, base_config

# fused checkpoint tensor -> the decoder's names for its row blocks, in order
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
_PART_OF = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}
_LAYER_RE = re.compile(r"(model\.layers\.\d+\.)(.+)")


def _rope(hf: dict) -> dict:
    return hf.get("rope_scaling") or hf.get("rope_parameters") or {}


def config_from_hf(hf: dict):
    kind = _rope(hf).get("rope_type", _rope(hf).get("type", "default"))
    if kind != "default":
        raise ValueError(f"Phi3 rope scaling {kind!r} (LongRoPE short_factor/long_factor) is not "
                         "supported; supported: none (rope_scaling null)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    factor = float(_rope(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary = int(head_dim * factor)
    window = int(hf.get("sliding_window") or 0)
    return base_config({k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
                       | {"rope_theta": _rope(hf).get("rope_theta", hf.get("rope_theta", 10000.0))},
                       rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                       rotary_dim=rotary if rotary < head_dim else None,
                       layer_windows=(window,) * hf["num_hidden_layers"],
                       attention_bias=False, attention_out_bias=False)


class SplitFused:
    """`reader(name)` that answers the decoder's q/k/v and gate/up names with row blocks (output
    channels) of Phi-3's fused tensors, and passes every other name through. `get` gives an
    array or (a 4-bit reader's `raw`) a tuple of row-aligned arrays, or None."""

    def __init__(self, get, cfg):
        self.get = get
        self.sizes = {"self_attn.qkv_proj.weight": (cfg.q_size, cfg.kv_size, cfg.kv_size),
                      "mlp.gate_up_proj.weight": (cfg.intermediate_size,) * 2}
        self._last = (None, None)     # q, k and v come from one tensor: read it once

    def __call__(self, name: str):
        m = _LAYER_RE.fullmatch(name)
        if not m or m.group(2) not in _PART_OF:
            return self.get(name)
        fused, i = _PART_OF[m.group(2)]
        full = m.group(1) + fused
        if self._last[0] != full:
            self._last = (full, self.get(full))
        w = self._last[1]
        start = sum(self.sizes[fused][:i])
        cut = slice(start, start + self.sizes[fused][i])
        if w is None or not isinstance(w, tuple):
            return None if w is None else w[cut]
        return tuple(None if p is None else p[cut] for p in w)


def params_from_hf(cfg, get, dtype, progress=None, quantizer=None):
    if quantizer is not None:
        raw = quantizer.raw and SplitFused(quantizer.raw, cfg)
        quantizer = quantizer.reading(SplitFused(quantizer.get, cfg), raw)
    return decoder.params_from_hf(cfg, SplitFused(get, cfg), dtype, progress, quantizer)


def gguf_config(hf: dict, get, tensors) -> None:
    # convert_hf_to_gguf's Phi3MiniModel: rope.dimension_count is the rotary part of a head
    # (partial_rotary_factor), LongRoPE comes as rope_factors_long/short tensors.
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise ValueError("Phi3 LongRoPE (rope_factors_long/short) is not supported")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    rotary = int(get("rope.dimension_count") or head_dim)
    hf["head_dim"] = head_dim
    hf["partial_rotary_factor"] = rotary / head_dim
    hf["sliding_window"] = int(get("attention.sliding_window", 0)) or None


# llama.cpp keeps the fused tensors, under its own names; the decoder's unfused ones are absent.
GGUF_LAYER_NAMES = dict.fromkeys(("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                  "self_attn.v_proj.bias", "self_attn.o_proj.bias",
                                  "self_attn.q_norm.weight",
                                  "self_attn.k_norm.weight", *_PART_OF)) | {
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}

ARCHITECTURE = Architecture("Phi3ForCausalLM", config_from_hf, params_from_hf=params_from_hf,
                            gguf_archs=("phi3",), gguf_config=gguf_config,
                            gguf_layer_names=GGUF_LAYER_NAMES,
                            description="Phi-3, Phi-4 (fused qkv/gate_up, partial rotary; "
                                        "no LongRoPE)")
