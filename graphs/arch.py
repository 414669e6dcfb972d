"""What an architecture provides, and the HF config fields every decoder shares.

A built-in family is a module of this package exposing `ARCHITECTURE = Architecture(...)`, found
by maxjax/models/registry.py; custom architectures (`--custom-architectures`) expose
`ARCHITECTURES = [Architecture(...)]`. An architecture also carries what llama.cpp's GGUF files
of its family hold differently (read by maxjax/models/gguf.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from maxjax.graphs.config import ModelConfig
from maxjax.graphs import decoder, sharding


@dataclass(frozen=True)
class Architecture:
    name: str                                   # HF config.json architectures[0]
    config_from_hf: Callable[[dict], ModelConfig]
    forward: Callable = decoder.forward         # (cfg, params, kv, step) -> (logits, kv)
    # For prompt logprobs (echo): hidden states of every token, and logits of any of them. An
    # architecture without them serves everything else.
    hidden_states: Callable | None = decoder.hidden_states
    lm_logits: Callable | None = decoder.lm_logits
    param_specs: Callable = decoder.param_specs  # cfg -> pytree of sharding.ArraySpec
    params_from_hf: Callable = decoder.params_from_hf
    gguf_archs: tuple[str, ...] = ()            # GGUF general.architecture values it reads
    description: str = ""
    # The HF config fields its GGUF metadata gives beyond the keys every family shares:
    # (hf, get, tensor_names) -> None, filling hf in place; get(key, default) reads the family's
    # metadata key; a ValueError refuses the file.
    gguf_config: Callable | None = None
    # Decoder-layer tensor names where llama.cpp's differ from the shared ones (gguf.LAYER_NAMES):
    # HF name suffix -> GGUF name suffix; None: the family has no such tensor.
    gguf_layer_names: Mapping[str, str | None] = field(default_factory=dict, hash=False)
    # Decoder-layer tensors llama.cpp stores converted (split, merged, reordered, -exp(A_log)):
    # HF name suffix -> (GGUF suffixes, the first present standing for it; make(read, hf) -> the
    # HF tensor, read(suffix) giving the layer's GGUF tensor in float32, None where absent).
    # They get none of the fixes below, and are read dequantized (no 4-bit blocks as they are).
    gguf_tensors: Mapping[str, tuple] = field(default_factory=dict, hash=False)
    gguf_permuted_qk: bool = False      # Q/K rows permuted (convert_hf_to_gguf LlamaModel.permute)
    gguf_norm_plus_one: bool = False    # RMSNorm weights stored with Gemma's +1 added
    gguf_tokenizer: str | None = None   # transformers' tokenizer class (None: AutoTokenizer's)
    # An image-text model: its image encoder (graphs/vision.py); None: text only.
    vision: Any = None
    float16_overflows: bool = False     # activations beyond float16's range (Gemma 2 and 3)
    # What its layers keep in the paged pool (graphs/state.py KINDS), as its configs' paged_state
    # says; `maxjax list` shows it.
    state: str = "kv"
    # What its state layers keep per request beside the pages (graphs/state.py RECURRENT's
    # name, for a hybrid family whose configs set state_layers); "": none. `maxjax list` shows it.
    request_state: str = ""

    def param_shapes(self, cfg: ModelConfig) -> dict:
        return sharding.shapes(self.param_specs(cfg))


# llama.cpp's names of the norms after attention and after the MLP (Gemma, OLMo 2)
POST_NORM_GGUF_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                        "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
# Gemma's sandwich norms: llama.cpp names the pre-MLP norm ffn_norm.
GEMMA_GGUF_NAMES = POST_NORM_GGUF_NAMES | {"pre_feedforward_layernorm.weight": "ffn_norm.weight"}


def rope_params(hf: dict) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling) from a config.json of transformers 4 or 5 layout."""
    rp = hf.get("rope_parameters") or {}
    if rp and "full_attention" in rp:   # per-layer-type layout (Gemma3 in transformers 5)
        rp = rp["full_attention"]
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
    return theta, scaling_tuple(scaling)


def scaling_tuple(s: dict | None) -> tuple | None:
    if not s:
        return None
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return ("linear", float(s["factor"]))
    if kind == "llama3":
        return ("llama3", float(s["factor"]), float(s["low_freq_factor"]),
                float(s["high_freq_factor"]), int(s["original_max_position_embeddings"]))
    if kind == "yarn":
        return ("yarn", float(s["factor"]), float(s.get("beta_fast") or 32),
                float(s.get("beta_slow") or 1), int(s["original_max_position_embeddings"]),
                bool(s.get("truncate", True)), yarn_attention_factor(s))
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, yarn)")


def yarn_attention_factor(s: dict) -> float:
    """YaRN's scale of cos and sin: `attention_factor`, else from the factor (and DeepSeek's
    mscale / mscale_all_dim), as transformers' _compute_yarn_parameters infers it."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(s["mscale"]) / mscale(s["mscale_all_dim"])
    return mscale()


def eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def base_config(hf: dict, **overrides) -> ModelConfig:
    """transformers' usual block: `attention_bias` on q, k, v and o (an architecture whose
    projections differ says so in `overrides`); MLP biases are refused."""
    if hf.get("mlp_bias"):
        raise ValueError(f"{hf['architectures'][0]} with mlp_bias=true is not supported (the "
                         f"decoder's MLP has no biases)")
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    theta, scaling = rope_params(hf)
    fields = dict(
        architecture=hf["architectures"][0],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bias,
        attention_out_bias=bool(hf.get("attention_out_bias", bias)),
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def layer_windows(layer_types, window) -> tuple[int, ...]:
    """Per-layer sliding windows from HF `layer_types` ("sliding_attention" / "full_attention")."""
    w = int(window or 0)
    return tuple(w if t == "sliding_attention" else 0 for t in layer_types)


def qwen_layer_windows(hf: dict) -> tuple[int, ...]:
    """Qwen2/Qwen3 windows: `layer_types`, or (older configs) transformers' default of a sliding
    window on the layers from `max_window_layers` up when `use_sliding_window` is set."""
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types") or [
        "sliding_attention" if window and i >= hf.get("max_window_layers", n) else "full_attention"
        for i in range(n)]
    return layer_windows(types, window)
