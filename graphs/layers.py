"""Layers shared by the architectures: the one `linear`, norms, rotary embedding, MLP, KV writes.
(Attention over KV pages is graphs/attention.py.)"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import quant


@jax.tree_util.register_dataclass
@dataclass
class LowRankDelta:
    """A projection with per-token LoRA deltas: row t gets x @ weight + x @ a[s] @ b[s], s the
    one-hot slot of token t (a zero row: no adapter). The adapters' scale is in b. A fused
    projection's parts share `a` (their ranks side by side) and keep a B each."""
    weight: jax.Array     # as `linear` takes it: [in, out], or [out, in] when transposed
    a: jax.Array          # [in, S, P*r]  every slot's A, stacked (flattens to [in, S*P*r] for free)
    b: tuple              # P x [S, r, out_p]  (each flattens to [S*r, out_p]); outputs concatenated
    slot_onehot: jax.Array  # [T, S]  each token's slot


def linear(x, w, transposed: bool = False, out_dtype=None, live=None):
    """x [..., in] through a projection: every matmul with a weight goes through here.
    w: an array [in, out] ([out, in] when `transposed`, e.g. a tied embedding used as the LM
    head), a QuantizedWeight (graphs/quant.py) or a LowRankDelta around either. `live`: how many
    leading rows of a 2-D x are real tokens (the rest: the bucket's padding), for a kernel that
    skips the others (graphs/cpu_kernels.py); None: all."""
    if isinstance(w, LowRankDelta):
        # The dense one-hot form (every slot's x @ A, masked, then @ B) beat a per-token gather
        # of A and B on CPU (DESIGN.md: 879 vs 1370 us at T=32); as plain matmuls over the
        # flattened stacks, not batched einsums over slots (0.71 vs 0.45 of the base
        # throughput); decode is memory-bound, so a B per fused part and no stored slot 0 halve
        # the stacks it reads (BENCHMARKS.md, Multi-LoRA).
        d_in, S, pr = w.a.shape
        r = pr // len(w.b)
        xa = jnp.matmul(x, w.a.reshape(d_in, S * pr)).reshape(*x.shape[:-1], S, pr)
        xa = xa * w.slot_onehot.astype(x.dtype)[..., None]
        delta = jnp.concatenate(
            [jnp.matmul(xa[..., j * r:(j + 1) * r].reshape(*x.shape[:-1], S * r),
                        b.reshape(S * r, -1), preferred_element_type=out_dtype)
             for j, b in enumerate(w.b)], axis=-1)
        return linear(x, w.weight, transposed, out_dtype, live) + delta.astype(out_dtype or x.dtype)
    if isinstance(w, quant.QuantizedWeight):
        return quant.linear(x, w, transposed, out_dtype, live)
    if transposed:
        return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=out_dtype)
    return jnp.matmul(x, w, preferred_element_type=out_dtype)


def sum_last(x):
    """x summed over its last axis in one fixed pairwise order, whatever the leading shape: XLA
    compiles a reduction per shape and its order (and last bits) varies with the row count, so a
    row's result would depend on which bucket it ran in (BENCHMARKS.md, batch invariance)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


# A step graph calls rms_norm and apply_rope on the same shapes in every layer: jitted, each is
# traced once per shape and called from the graph (XLA inlines the calls; the compiled code is
# the same), which halves the time to export a SmolLM2 step graph (BENCHMARKS.md).
@partial(jax.jit, static_argnames=("eps", "plus_one"))
def rms_norm(x, w, eps: float, plus_one: bool = False):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(sum_last(xf * xf) / xf.shape[-1] + eps)
    scale = (1.0 + w.astype(jnp.float32)) if plus_one else w.astype(jnp.float32)
    return (xf * scale).astype(x.dtype)


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unsupported activation {name!r} (supported: silu, gelu, gelu_pytorch_tanh)")


def glu(gate, up, act: str, clamped: tuple[float, float] | None = None):
    """act(gate) * up; with `clamped` (alpha, limit) gpt-oss's SwiGLU instead (transformers'
    GptOssExperts._apply_gate): gate clamped above at limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    if clamped is None:
        return activation(act)(gate) * up
    alpha, limit = clamped
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def gated_mlp(x, w_gate_up, w_down, act: str, shards: int = 1, live=None):
    gate_up = linear(x, w_gate_up, live=live)
    F = gate_up.shape[-1] // 2
    gate, up = split_fused(gate_up, (F, F), shards)
    return linear(glu(gate, up, act), w_down, live=live)


def split_fused(x, sizes, shards: int = 1):
    """The parts of a fused projection's output x [T, sum(sizes)], laid out as `shards` blocks
    that each hold every part's 1/shards slice in order (`shards` 1: the parts one after the
    other). Per-device blocks keep a column-parallel projection's split local: each device
    holds its own q, k and v heads (gate and up columns), no resharding between."""
    if shards == 1:
        return jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    blocks = x.reshape(*x.shape[:-1], shards, -1)
    parts = jnp.split(blocks, np.cumsum([n // shards for n in sizes])[:-1].tolist(), axis=-1)
    return [p.reshape(*x.shape[:-1], -1) for p in parts]


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None):
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    kind = scaling[0]
    if kind == "linear":
        return inv / scaling[1]
    if kind == "llama3":
        factor, low, high, orig = scaling[1:5]
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        out = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(mid, smoothed, out)
    if kind == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, *scaling[1:6])
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, yarn)")


def _yarn_inv_freq(inv, dim: int, theta: float, factor: float, beta_fast: float,
                   beta_slow: float, orig: int, truncate: bool):
    """YaRN (transformers' _compute_yarn_parameters): interpolated (inv / factor) below the
    dimensions that turn `beta_fast` times over `orig` positions, kept above those that turn
    `beta_slow` times, a linear ramp between."""
    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(scaling: tuple | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    return scaling[6] if scaling is not None and scaling[0] == "yarn" else 1.0


def rope_cos_sin(positions, inv_freq, attention_factor: float = 1.0):
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if attention_factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor


@jax.jit
def apply_rope(x, cos, sin):
    """x [T, heads, head_dim]; HF's rotate-half layout, on the first cos.shape[-1] dims of each
    head (partial rotary: the rest pass through)."""
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot_dim], cos, sin), x[..., rot_dim:]], -1)
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


def write_kv(pool, layer, slots, new, page_size: int):
    """pool [L, N, KV, page, hd]; new [T, KV, hd] written at flat slots (in place when donated)."""
    return pool.at[layer, slots // page_size, :, slots % page_size].set(new.astype(pool.dtype))
