"""Gemma 3's image encoder as pure functions: pixels to the text model's soft image tokens.

Follows transformers' Gemma3Model.get_image_features: the SigLIP vision tower (SiglipVisionModel:
patch conv plus learned position embeddings, pre-LayerNorm encoder layers with biased attention
and a gelu-tanh MLP, post_layernorm; its pooling head is unused, Gemma 3 takes last_hidden_state),
then Gemma3MultiModalProjector: average-pool the patch grid down to mm_tokens_per_image,
Gemma RMSNorm ((1 + w) scaling), matmul with mm_input_projection_weight. Also the prompt expansion
of Gemma3Processor. Parameters: one pytree, `layers` a list of per-layer dicts (unrolled, as
graphs/decoder.py), q|k|v fused, linear weights [in, out], the patch conv a [C*p*p, hidden] matrix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs.layers import activation, linear, rms_norm

# Defaults of transformers' SiglipVisionConfig, Gemma3TextConfig and Gemma3Config: config.json
# leaves out the fields equal to them.
_SIGLIP_DEFAULTS = dict(image_size=224, patch_size=16, num_channels=3, hidden_size=768,
                        intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
_TEXT_HIDDEN_DEFAULT = 2304
_GEMMA3_DEFAULTS = dict(mm_tokens_per_image=256, image_token_index=262_144,
                        boi_token_index=255_999, eoi_token_index=256_000)

# Where checkpoints keep the tower: transformers 5 in memory / as saved, and the original
# (hub, transformers 4) layout with the SiglipVisionModel's `vision_model` level.
_TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.vision_tower.vision_model.",
                   "vision_tower.vision_model.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")

# params["layers"][i] key -> the encoder layer's tensors, concatenated on the output axis
_LAYER_NAMES = {
    "ln1_w": ("layer_norm1.weight",), "ln1_b": ("layer_norm1.bias",),
    "qkv_w": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_b": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "o_w": ("self_attn.out_proj.weight",), "o_b": ("self_attn.out_proj.bias",),
    "ln2_w": ("layer_norm2.weight",), "ln2_b": ("layer_norm2.bias",),
    "fc1_w": ("mlp.fc1.weight",), "fc1_b": ("mlp.fc1.bias",),
    "fc2_w": ("mlp.fc2.weight",), "fc2_b": ("mlp.fc2.bias",),
}


@dataclass(frozen=True)
class VisionConfig:
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    mm_tokens_per_image: int
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.mm_tokens_per_image ** 0.5))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """The encoder's config from a Gemma3ForConditionalGeneration config.json dict; fields it
    leaves out take transformers' defaults. ValueError for a config without a vision tower or
    one this encoder cannot run."""
    vc = hf.get("vision_config")
    if not isinstance(vc, dict):
        raise ValueError("Gemma 3 image input needs a Gemma3ForConditionalGeneration config with "
                         "a vision_config; this config has none (a text-only checkpoint?)")
    if vc.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"Gemma 3 vision tower {vc['model_type']!r} is not supported "
                         "(supported: siglip_vision_model)")
    v = {**_SIGLIP_DEFAULTS, **{k: vc[k] for k in _SIGLIP_DEFAULTS if vc.get(k) is not None}}
    top = {k: hf[k] for k in _GEMMA3_DEFAULTS if hf.get(k) is not None}
    for alias, key in (("image_token_id", "image_token_index"), ("boi_token_id", "boi_token_index"),
                       ("eoi_token_id", "eoi_token_index")):
        if hf.get(alias) is not None:
            top[key] = hf[alias]
    top = {**_GEMMA3_DEFAULTS, **top}
    cfg = VisionConfig(
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
        num_channels=int(v["num_channels"]), hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]), num_layers=int(v["num_hidden_layers"]),
        num_heads=int(v["num_attention_heads"]), layer_norm_eps=float(v["layer_norm_eps"]),
        hidden_act=str(v["hidden_act"]), mm_tokens_per_image=int(top["mm_tokens_per_image"]),
        text_hidden_size=int((hf.get("text_config") or {}).get("hidden_size",
                                                               _TEXT_HIDDEN_DEFAULT)),
        image_token_id=int(top["image_token_index"]), boi_token_id=int(top["boi_token_index"]),
        eoi_token_id=int(top["eoi_token_index"]))
    _check(cfg)
    return cfg


def _check(cfg: VisionConfig) -> None:
    activation(cfg.hidden_act)      # raises ValueError for one it does not know
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"vision hidden_size {cfg.hidden_size} is not a multiple of "
                         f"num_attention_heads {cfg.num_heads}")
    if cfg.image_size % cfg.patch_size:
        raise ValueError(f"vision image_size {cfg.image_size} is not a multiple of "
                         f"patch_size {cfg.patch_size}")
    side = cfg.tokens_per_side
    if side * side != cfg.mm_tokens_per_image or cfg.patches_per_side % side:
        raise ValueError(f"mm_tokens_per_image {cfg.mm_tokens_per_image} must be the square of "
                         f"a divisor of the {cfg.patches_per_side} patches per side")


def vision_param_shapes(vcfg: VisionConfig) -> dict:
    d, f, c, p = vcfg.hidden_size, vcfg.intermediate_size, vcfg.num_channels, vcfg.patch_size
    layer = {"ln1_w": (d,), "ln1_b": (d,), "qkv_w": (d, 3 * d), "qkv_b": (3 * d,),
             "o_w": (d, d), "o_b": (d,), "ln2_w": (d,), "ln2_b": (d,),
             "fc1_w": (d, f), "fc1_b": (f,), "fc2_w": (f, d), "fc2_b": (d,)}
    return {"patch_w": (c * p * p, d), "patch_b": (d,),
            "pos_embed": (vcfg.patches_per_side ** 2, d),
            "layers": [dict(layer) for _ in range(vcfg.num_layers)],
            "post_ln_w": (d,), "post_ln_b": (d,),
            "mm_norm": (d,), "mm_proj": (d, vcfg.text_hidden_size)}


def _find_prefix(get: Callable[[str], np.ndarray], prefixes: tuple, probe: str) -> str:
    errors = []
    for prefix in prefixes:
        try:
            get(prefix + probe)
            return prefix
        except Exception as e:     # each reader has its own "no such tensor" error
            errors.append(e)
    raise ValueError(f"checkpoint has no {probe!r} under any of {', '.join(prefixes)} "
                     "(not a Gemma 3 checkpoint with a vision tower?)") from errors[-1]


def vision_params_from_hf(vcfg: VisionConfig, get: Callable[[str], np.ndarray], dtype) -> dict:
    """The parameter pytree from a Gemma3ForConditionalGeneration checkpoint: `get(name)` returns
    the tensor as a numpy array; names in any layout of _TOWER_PREFIXES / _PROJECTOR_PREFIXES."""
    tower = _find_prefix(get, _TOWER_PREFIXES, "embeddings.patch_embedding.weight")
    proj = _find_prefix(get, _PROJECTOR_PREFIXES, "mm_input_projection_weight")

    def put(x):   # on the host and device_put, as graphs/decoder.py
        return jax.device_put(np.asarray(x, np.float32).astype(jnp.dtype(dtype)))

    def fused(prefix, names):
        parts = [np.asarray(get(prefix + n), np.float32) for n in names]
        return put(np.concatenate([x.T if x.ndim == 2 else x for x in parts], axis=-1))

    conv = np.asarray(get(tower + "embeddings.patch_embedding.weight"), np.float32)
    layers = [{key: fused(f"{tower}encoder.layers.{i}.", names)
               for key, names in _LAYER_NAMES.items()} for i in range(vcfg.num_layers)]
    params = {"patch_w": put(conv.reshape(conv.shape[0], -1).T),
              "patch_b": put(get(tower + "embeddings.patch_embedding.bias")),
              "pos_embed": put(get(tower + "embeddings.position_embedding.weight")),
              "layers": layers,
              "post_ln_w": put(get(tower + "post_layernorm.weight")),
              "post_ln_b": put(get(tower + "post_layernorm.bias")),
              "mm_norm": put(get(proj + "mm_soft_emb_norm.weight")),
              "mm_proj": put(get(proj + "mm_input_projection_weight"))}   # already [in, out]
    _check_shapes(vision_param_shapes(vcfg), params)
    return params


def _check_shapes(shapes: dict, params: dict) -> None:
    want = jax.tree_util.tree_leaves_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    for (path, shape), array in zip(want, jax.tree.leaves(params)):
        if tuple(array.shape) != shape:
            raise ValueError(f"vision checkpoint tensor {jax.tree_util.keystr(path)} has shape "
                             f"{tuple(array.shape)}, the config says {shape}")


def _layer_norm(x, w, b, eps: float):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _patchify(vcfg: VisionConfig, pixels):
    """[B, C, S, S] -> [B, g*g, C*p*p], patches row-major and each flattened (C, p, p) like the
    conv's weight."""
    b, c, g, p = pixels.shape[0], vcfg.num_channels, vcfg.patches_per_side, vcfg.patch_size
    x = pixels.reshape(b, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, g * g, c * p * p)


_QUERY_CHUNK = 256    # queries per block of a long image's attention


def _attention(q, k, v, scale: float):
    """Full attention over an image's patches, [B, n, heads, hd], softmax in float32 as
    transformers' eager attention. A long image (Gemma 3's 4096 patches) runs in blocks of
    queries: 1.6x faster on XLA:CPU than one [heads, n, n] softmax (BENCHMARKS.md, images)."""
    b, n, heads, hd = q.shape
    if n < 4 * _QUERY_CHUNK or n % _QUERY_CHUNK:
        return jax.nn.dot_product_attention(q, k, v, scale=scale)
    kt = k.astype(jnp.float32).transpose(0, 2, 3, 1)                    # [B, H, hd, n]
    vt = v.astype(jnp.float32).transpose(0, 2, 1, 3)                    # [B, H, n, hd]
    qc = (q.astype(jnp.float32) * scale).reshape(b, n // _QUERY_CHUNK, _QUERY_CHUNK, heads, hd)
    qc = qc.transpose(1, 0, 3, 2, 4)                                    # [nc, B, H, C, hd]
    out = jax.lax.map(lambda qb: jnp.matmul(jax.nn.softmax(jnp.matmul(qb, kt), axis=-1), vt),
                      qc)                                               # [nc, B, H, C, hd]
    return out.transpose(1, 0, 3, 2, 4).reshape(b, n, heads, hd).astype(q.dtype)


def _encoder_layer(vcfg: VisionConfig, h, p):
    b, n, d = h.shape
    heads, eps = vcfg.num_heads, vcfg.layer_norm_eps
    x = _layer_norm(h, p["ln1_w"], p["ln1_b"], eps)
    qkv = linear(x, p["qkv_w"]) + p["qkv_b"]
    q, k, v = (t.reshape(b, n, heads, d // heads) for t in jnp.split(qkv, 3, axis=-1))
    attn = _attention(q, k, v, (d // heads) ** -0.5)
    h = h + linear(attn.reshape(b, n, d), p["o_w"]) + p["o_b"]
    x = _layer_norm(h, p["ln2_w"], p["ln2_b"], eps)
    x = activation(vcfg.hidden_act)(linear(x, p["fc1_w"]) + p["fc1_b"])
    return h + linear(x, p["fc2_w"]) + p["fc2_b"]


def _project(vcfg: VisionConfig, params: dict, h):
    """Gemma3MultiModalProjector: [B, g*g, D] -> [B, mm_tokens_per_image, text_hidden]."""
    b, _, d = h.shape
    t, g = vcfg.tokens_per_side, vcfg.patches_per_side
    k = g // t
    pooled = h.astype(jnp.float32).reshape(b, t, k, t, k, d).mean(axis=(2, 4))
    pooled = pooled.reshape(b, t * t, d).astype(h.dtype)
    normed = rms_norm(pooled, params["mm_norm"], vcfg.layer_norm_eps, plus_one=True)
    return linear(normed, params["mm_proj"])


def encode_images(vcfg: VisionConfig, params: dict, pixel_values) -> jax.Array:
    """pixel_values f32[B, C, S, S] as Gemma3ImageProcessor returns them -> the soft tokens
    [B, mm_tokens_per_image, text_hidden] in the params' dtype. Jit with vcfg static."""
    dtype = params["patch_w"].dtype
    h = linear(_patchify(vcfg, pixel_values.astype(dtype)), params["patch_w"]) + params["patch_b"]
    h = h + params["pos_embed"]
    for p in params["layers"]:
        h = _encoder_layer(vcfg, h, p)
    h = _layer_norm(h, params["post_ln_w"], params["post_ln_b"], vcfg.layer_norm_eps)
    return _project(vcfg, params, h)


def expand_image_prompt(text: str, num_images: int, vcfg: VisionConfig, boi_token: str,
                        image_token: str, eoi_token: str) -> str:
    """The prompt as Gemma3Processor expands it (no pan-and-scan): each boi token becomes
    "\\n\\n" + boi + image_token * mm_tokens_per_image + eoi + "\\n\\n"; an empty text is one boi
    token per image, space-separated. ValueError when the boi count is not num_images."""
    if not text:
        text = " ".join([boi_token] * num_images)
    found = text.count(boi_token)
    if found != num_images:
        raise ValueError(f"the prompt has {found} {boi_token} tokens for {num_images} images")
    full = f"\n\n{boi_token}{image_token * vcfg.mm_tokens_per_image}{eoi_token}\n\n"
    return text.replace(boi_token, full)
