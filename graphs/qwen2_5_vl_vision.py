"""Qwen2.5-VL's vision encoder on padded, static-shape patches: transformers 5.24's
Qwen2_5_VisionTransformerPretrainedModel (patch embed, axial 2-D rope, window and full attention
blocks, RMSNorm, gated MLP, Qwen2_5_VLPatchMerger). The text side's M-RoPE is graphs/mrope.py.

Attention is masked by segment ids instead of split by cu_seqlens: a patch sees the patches of
its own frame of its own image (full layers) or of its own window there (window layers), and
padding sees only padding. A segment mask does not depend on the order of the patches, so they
stay in the processor's order (already merge-block-major) and transformers' window permutation
and its reverse cancel out: merged tokens come out in the order transformers returns them."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import layers as L

NORM_EPS = 1e-6            # transformers hard-codes it for the vision RMSNorms
QUERY_CHUNK = 512          # attention scores held at once: heads x chunk x num_patches


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple
    in_channels: int
    out_hidden_size: int
    hidden_act: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    video_token_id: int
    rope_theta: float = 10000.0
    tokens_per_second: int = 4
    mrope_section: tuple = (16, 24, 24)     # the text side's, for graphs/mrope.py

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def window_merged(self) -> int:
        """A window's side in merged tokens (transformers' vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _mrope_section(hf: dict) -> tuple:
    text = hf.get("text_config") or hf
    for d in (text, hf):
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "mrope_section" in rope:
            return tuple(int(s) for s in rope["mrope_section"])
    return (16, 24, 24)


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """From the whole config.json of a Qwen2_5_VLForConditionalGeneration; absent keys take
    Qwen2_5_VLVisionConfig's and Qwen2_5_VLConfig's defaults."""
    v = hf.get("vision_config") or {}
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=int(v.get("depth", 32)), hidden_size=int(v.get("hidden_size", 3584)),
        intermediate_size=int(v.get("intermediate_size", 3420)),
        num_heads=int(v.get("num_heads", 16)), patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        out_hidden_size=int(v.get("out_hidden_size", 3584)),
        hidden_act=v.get("hidden_act", "silu"),
        image_token_id=int(hf.get("image_token_id", 151655)),
        vision_start_token_id=int(hf.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(hf.get("vision_end_token_id", 151653)),
        video_token_id=int(hf.get("video_token_id", 151656)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tokens_per_second=int(v.get("tokens_per_second", 4)),
        mrope_section=_mrope_section(hf))


def vision_param_shapes(vcfg: VisionConfig) -> dict:
    D, I = vcfg.hidden_size, vcfg.intermediate_size
    M = D * vcfg.merge_unit
    block = {"norm1": (D,), "norm2": (D,), "wqkv": (D, 3 * D), "bqkv": (3 * D,),
             "wo": (D, D), "bo": (D,), "w_gate_up": (D, 2 * I), "b_gate_up": (2 * I,),
             "w_down": (I, D), "b_down": (D,)}
    return {"patch_embed": (vcfg.patch_dim, D),
            "blocks": [dict(block) for _ in range(vcfg.depth)],
            "merger": {"norm": (D,), "w1": (M, M), "b1": (M,),
                       "w2": (M, vcfg.out_hidden_size), "b2": (vcfg.out_hidden_size,)}}


_BLOCK_NAMES = {"norm1": ["norm1.weight"], "norm2": ["norm2.weight"],
                "wqkv": ["attn.qkv.weight"], "bqkv": ["attn.qkv.bias"],
                "wo": ["attn.proj.weight"], "bo": ["attn.proj.bias"],
                "w_gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                "b_gate_up": ["mlp.gate_proj.bias", "mlp.up_proj.bias"],
                "w_down": ["mlp.down_proj.weight"], "b_down": ["mlp.down_proj.bias"]}
_MERGER_NAMES = {"norm": "ln_q.weight", "w1": "mlp.0.weight", "b1": "mlp.0.bias",
                 "w2": "mlp.2.weight", "b2": "mlp.2.bias"}


def _checkpoint_prefix(get) -> str:
    """Transformers 5.24 saves the encoder as hub checkpoints do, "visual.*", though its
    state_dict() says "model.visual.*"; either is accepted."""
    for prefix in ("visual.", "model.visual."):
        try:
            get(prefix + "patch_embed.proj.weight")
            return prefix
        except Exception:       # each loader raises its own error for a missing name
            continue
    raise ValueError("no vision encoder in the checkpoint (no visual.patch_embed.proj.weight)")


def vision_params_from_hf(vcfg: VisionConfig, get, dtype, prefix: str | None = None) -> dict:
    """`get(name)` -> np.ndarray; `prefix` of the encoder's names: found when not given (see
    _checkpoint_prefix). Linear weights become [in, out]; gate and up are fused."""
    prefix = _checkpoint_prefix(get) if prefix is None else prefix

    def load(name):
        x = np.asarray(get(prefix + name), np.float32)
        return x.T if x.ndim == 2 else x

    def put(x):
        return jax.device_put(x.astype(jnp.dtype(dtype)))

    conv = np.asarray(get(prefix + "patch_embed.proj.weight"), np.float32)
    blocks = [{key: put(np.concatenate([load(f"blocks.{i}.{n}") for n in names], axis=-1))
               for key, names in _BLOCK_NAMES.items()} for i in range(vcfg.depth)]
    params = {"patch_embed": put(conv.reshape(conv.shape[0], -1).T), "blocks": blocks,
              "merger": {k: put(load("merger." + n)) for k, n in _MERGER_NAMES.items()}}
    got = jax.tree.map(lambda a: tuple(a.shape), params)
    if got != vision_param_shapes(vcfg):
        raise ValueError(f"vision checkpoint shapes do not match the config: {got}")
    return params


@jax.tree_util.register_dataclass
@dataclass
class PatchInputs:
    """One bucket of patches, in the processor's order, padding after.
    patches [N, patch_dim] f32; pos_hw [N, 2] i32: each patch's (row, column) in its image's
    patch grid, for the 2-D rope; full_seg / window_seg [N] i32: the attention segment of
    each patch in full / window layers (one per frame of an image / per window of a frame),
    -1 for padding."""
    patches: jax.Array
    pos_hw: jax.Array
    full_seg: jax.Array
    window_seg: jax.Array


def num_image_tokens(vcfg: VisionConfig, grid_thw) -> int:
    t, h, w = (int(x) for x in np.asarray(grid_thw).reshape(3))
    return t * h * w // vcfg.merge_unit


def _block_major_hw(h: int, w: int, m: int) -> np.ndarray:
    """(row, col) of each patch of an h x w grid in the processor's order: m x m merge blocks
    in raster order, raster order inside a block (transformers' get_vision_position_ids)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    order = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([order(rows), order(cols)], axis=-1)


def _window_ids(vcfg: VisionConfig, hw: np.ndarray, w: int) -> tuple[np.ndarray, int]:
    """Each patch's window inside its frame, and the number of windows (get_vision_window_index:
    windows of window_merged x window_merged merged tokens from the top left)."""
    side, m = vcfg.window_merged, vcfg.spatial_merge_size
    across = -(-(w // m) // side)
    win_r, win_c = hw[:, 0] // m // side, hw[:, 1] // m // side
    return win_r * across + win_c, int(win_r.max() + 1) * across


def patch_inputs(vcfg: VisionConfig, pixel_values: np.ndarray, grid_thw: np.ndarray,
                 num_patches: int) -> PatchInputs:
    """The image processor's outputs for one or more images, padded to `num_patches` (a multiple
    of spatial_merge_size**2)."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    pixels = np.asarray(pixel_values, np.float32)
    m, n = vcfg.spatial_merge_size, int(grid.prod(-1).sum())
    if pixels.shape != (n, vcfg.patch_dim):
        raise ValueError(f"pixel_values {pixels.shape} do not match grid_thw ({n} patches of "
                         f"{vcfg.patch_dim})")
    if num_patches % vcfg.merge_unit or n > num_patches:
        raise ValueError(f"{n} patches do not fit a bucket of {num_patches} (a multiple of "
                         f"{vcfg.merge_unit} is needed)")
    if (grid[:, 1:] % m).any() or vcfg.window_merged < 1:
        raise ValueError(f"grid {grid.tolist()} or window_size {vcfg.window_size} does not fit "
                         f"merge size {m} and patch size {vcfg.patch_size}")
    pos, full, win = [], [], []
    frames = windows = 0
    for t, h, w in grid.tolist():
        hw = _block_major_hw(h, w, m)
        local, count = _window_ids(vcfg, hw, w)
        for _ in range(t):
            pos.append(hw)
            full.append(np.full(h * w, frames))
            win.append(local + windows)
            frames, windows = frames + 1, windows + count
    pad = num_patches - n

    def column(parts, fill, dims=()):
        body = np.concatenate(parts) if parts else np.zeros((0, *dims), np.int32)
        return np.concatenate([body, np.full((pad, *dims), fill)]).astype(np.int32)

    return PatchInputs(patches=np.concatenate([pixels, np.zeros((pad, vcfg.patch_dim), np.float32)]),
                       pos_hw=column(pos, 0, (2,)), full_seg=column(full, -1),
                       window_seg=column(win, -1))


def patch_input_specs(vcfg: VisionConfig, num_patches: int) -> PatchInputs:
    seg = jax.ShapeDtypeStruct((num_patches,), jnp.int32)
    return PatchInputs(patches=jax.ShapeDtypeStruct((num_patches, vcfg.patch_dim), jnp.float32),
                       pos_hw=jax.ShapeDtypeStruct((num_patches, 2), jnp.int32),
                       full_seg=seg, window_seg=seg)


def _vision_cos_sin(vcfg: VisionConfig, pos_hw):
    """Qwen2_5_VLVisionRotaryEmbedding: head_dim/4 frequencies, the row's angles then the
    column's, the whole repeated twice (L.apply_rope's rotate-half layout)."""
    inv = L.rope_inv_freq(vcfg.head_dim // 2, vcfg.rope_theta, None)
    freqs = (pos_hw.astype(jnp.float32)[:, :, None] * inv).reshape(pos_hw.shape[0], -1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _segment_attention(q, k, v, seg):
    """q, k, v [N, H, hd]; each query attends to the keys of its own segment. Queries go in
    chunks so the scores stay heads x chunk x N."""
    N, H, hd = q.shape
    chunk = math.gcd(N, QUERY_CHUNK)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def one(args):
        qc, sc = args
        s = jnp.einsum("qhd,khd->hqk", qc.astype(jnp.float32), kf) * hd ** -0.5
        s = jnp.where((sc[:, None] == seg[None, :])[None], s, -jnp.inf)
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), vf)

    out = jax.lax.map(one, (q.reshape(N // chunk, chunk, H, hd), seg.reshape(N // chunk, chunk)))
    return out.reshape(N, H * hd).astype(q.dtype)


def _block(vcfg: VisionConfig, p, x, cos, sin, seg):
    N, H, hd = x.shape[0], vcfg.num_heads, vcfg.head_dim
    h = L.rms_norm(x, p["norm1"], NORM_EPS)
    q, k, v = jnp.split((h @ p["wqkv"] + p["bqkv"]).reshape(N, 3, H, hd), 3, axis=1)
    q, k = L.apply_rope(q[:, 0], cos, sin), L.apply_rope(k[:, 0], cos, sin)
    x = x + _segment_attention(q, k, v[:, 0], seg) @ p["wo"] + p["bo"]
    h = L.rms_norm(x, p["norm2"], NORM_EPS)
    gate, up = jnp.split(h @ p["w_gate_up"] + p["b_gate_up"], 2, axis=-1)
    return x + L.glu(gate, up, vcfg.hidden_act) @ p["w_down"] + p["b_down"]


def _merge(vcfg: VisionConfig, p, x):
    """Qwen2_5_VLPatchMerger: RMSNorm, each merge block's patches side by side, MLP (exact GELU)."""
    x = L.rms_norm(x, p["norm"], NORM_EPS).reshape(x.shape[0] // vcfg.merge_unit, -1)
    return jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False) @ p["w2"] + p["b2"]


def encode_patches(vcfg: VisionConfig, params: dict, inputs: PatchInputs) -> jax.Array:
    """[num_patches // merge**2, out_hidden_size]: the images' merged tokens in transformers'
    order, then zero rows for the padding. Jittable with `vcfg` static."""
    x = inputs.patches.astype(params["patch_embed"].dtype) @ params["patch_embed"]
    cos, sin = _vision_cos_sin(vcfg, inputs.pos_hw)
    for i, p in enumerate(params["blocks"]):
        seg = inputs.full_seg if i in vcfg.fullatt_block_indexes else inputs.window_seg
        x = _block(vcfg, p, x, cos, sin, seg)
    merged = _merge(vcfg, params["merger"], x)
    real = inputs.full_seg[::vcfg.merge_unit] >= 0
    return jnp.where(real[:, None], merged, 0).astype(merged.dtype)
