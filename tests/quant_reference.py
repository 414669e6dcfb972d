"""A NumPy reference of the quantized arithmetic (graphs/quant.py) and of a whole Llama forward
built on it: full causal attention recomputed over the sequence, no pages, no JAX. Written from
the formulas in the graphs/quant.py docstring, not from its code."""
from __future__ import annotations

import jax
import numpy as np


def host(w) -> dict:
    """A QuantizedWeight's arrays as numpy (or a float array's)."""
    if hasattr(w, "bits"):
        return {"bits": w.bits, **{k: None if getattr(w, k) is None else np.asarray(getattr(w, k))
                                   for k in ("q", "scale", "offset", "requant")}}
    return {"float": np.asarray(w, np.float32)}


def weight_int8(w: dict):
    """(int8 weight, per-channel scale) the int8 dot uses."""
    if w["bits"] == 8:
        return w["q"].astype(np.int64), w["scale"]
    half, out = w["q"].shape
    packed = w["q"].reshape(-1, 16, out)
    nib = np.concatenate([packed & 15, packed >> 4], axis=1).astype(np.float32) - 8
    wf = nib * w["scale"][:, None, :]
    if w["offset"] is not None:
        wf = wf + w["offset"][:, None, :]
    q = np.clip(np.rint(wf.reshape(-1, out) * w["requant"]), -127, 127)
    return q.astype(np.int64), np.float32(1) / w["requant"]


def linear(x, w: dict, transposed=False):
    """Activations in two int8 digits per row: x ~ s1 * x1 + s2 * x2, x2 quantizing x - s1 * x1."""
    x = np.asarray(x, np.float32)
    if "float" in w:
        return x @ (w["float"].T if transposed else w["float"])
    q, scale = weight_int8(w)
    q = q.T if transposed else q
    y = np.zeros((x.shape[0], q.shape[1]), np.float32)
    for _ in range(2):
        amax = np.max(np.abs(x), axis=-1, keepdims=True)
        sx = np.where(amax > 0, amax / np.float32(127), np.float32(1))
        xq = np.clip(np.rint(x / sx), -127, 127)
        y += (xq.astype(np.int64) @ q).astype(np.float32) * sx
        x = x - xq.astype(np.float32) * sx
    return y * scale


def embed(table: dict, ids):
    if "float" in table:
        return table["float"][ids]
    return table["q"][ids].astype(np.float32) * table["scale"][ids][:, None]


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    f = positions[:, None].astype(np.float32) * inv[None]
    cos, sin = np.cos(np.concatenate([f, f], -1)), np.sin(np.concatenate([f, f], -1))
    rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def forward(cfg, params, tokens) -> np.ndarray:
    """float32 logits [len(tokens), vocab] of a plain Llama (no biases, norms, scaling)."""
    T, nh, kvh, hd = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = jax.tree.map(host, params, is_leaf=lambda a: hasattr(a, "bits") or hasattr(a, "shape"))
    pos = np.arange(T)
    h = embed(p["embed"], np.asarray(tokens))
    mask = np.tril(np.ones((T, T), bool))
    for lay in p["layers"]:
        x = rms_norm(h, lay["attn_norm"]["float"], cfg.rms_norm_eps)
        qkv = linear(x, lay["wqkv"])
        q = rope(qkv[:, :nh * hd].reshape(T, nh, hd), pos, cfg.rope_theta)
        k = rope(qkv[:, nh * hd:(nh + kvh) * hd].reshape(T, kvh, hd), pos, cfg.rope_theta)
        v = qkv[:, (nh + kvh) * hd:].reshape(T, kvh, hd)
        k, v = np.repeat(k, nh // kvh, axis=1), np.repeat(v, nh // kvh, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = np.where(mask[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        h = h + linear(np.einsum("hts,shd->thd", a, v).reshape(T, nh * hd), lay["wo"])
        x = rms_norm(h, lay["mlp_norm"]["float"], cfg.rms_norm_eps)
        gate, up = np.split(linear(x, lay["w_gate_up"]), 2, axis=-1)
        h = h + linear(gate / (1 + np.exp(-gate)) * up, lay["w_down"])
    h = rms_norm(h, p["final_norm"]["float"], cfg.rms_norm_eps)
    return linear(h, p.get("lm_head", p["embed"]), transposed=True)


def greedy(cfg, params, prompt, new_tokens: int):
    """(logits [new_tokens, vocab] after the prompt and each generated token but the last,
    greedy tokens), recomputing the whole sequence each step."""
    seq, logits = list(prompt), []
    for _ in range(new_tokens):
        row = forward(cfg, params, seq)[-1]
        logits.append(row)
        seq.append(int(np.argmax(row)))
    return np.stack(logits), seq[len(prompt):]
