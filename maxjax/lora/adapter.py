"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the fused,
zero-padded, pre-scaled layout of graphs/lora.py, with every mismatch a RequestError naming the
field (the CLI turns it into a one-line UserError, the server into a 400).

PEFT stores lora_A.weight [r, in] and lora_B.weight [out, r] per module; the delta is
scale * x @ A.T @ B.T with scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The
scale is folded into B here. A module's rank is read from its tensors, so `rank_pattern` works.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from maxjax.errors import RequestError
from maxjax.graphs.lora import TARGETS, module_shapes

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields whose non-default values this engine cannot serve
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none",
                "modules_to_save": None, "alpha_pattern": {}}


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    weights: list[dict]      # per layer, per fused target: (A [in, parts*R], (B [R, out] per part))


def read_adapter(name: str, path: str, cfg, max_rank: int, dtype=np.float32,
                 field: str = "lora_path") -> Adapter:
    conf = read_config(path, field)
    if conf.get("peft_type", "LORA") != "LORA":
        raise RequestError(field, f"{path}: peft_type {conf.get('peft_type')!r}, only LORA is served")
    for key, default in _UNSUPPORTED.items():
        if conf.get(key, default) not in (default, None, [], {}):
            raise RequestError(field, f"{path}: {key}={conf[key]!r} is not supported")
    tensors = _read_tensors(path, field)
    # every slot's stacks go through each step's matmuls (graphs/lora.py): a NaN in one
    # adapter would reach every request, base model included
    bad = next((k for k, t in tensors.items() if not np.isfinite(t).all()), None)
    if bad is not None:
        raise RequestError(field, f"{path}: tensor {bad} holds NaN or infinite values")
    shapes = module_shapes(cfg)
    alpha, rslora = float(conf.get("lora_alpha", conf.get("r", 8))), bool(conf.get("use_rslora"))
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise RequestError(field, f"{path}: tensor {key} is not a LoRA weight of a "
                                      f"layer projection ({', '.join(shapes)})")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise RequestError(field, f"{path}: target module {module!r} is not supported "
                                      f"(supported: {', '.join(shapes)})")
        if layer >= cfg.num_layers:
            raise RequestError(field, f"{path}: layer {layer} does not exist; the base model has "
                                      f"{cfg.num_layers} layers")
        parts.setdefault((layer, module), {})[ab] = t
    if not parts:
        raise RequestError(field, f"{path}: {WEIGHTS} holds no LoRA weights")
    weights = [{k: _zeros(k, cfg, shapes, max_rank, dtype) for k in TARGETS}
               for _ in range(cfg.num_layers)]
    rank = 0
    for (layer, module), ab in parts.items():
        d_in, d_out = shapes[module]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise RequestError(field, f"{path}: layer {layer} {module}: lora_"
                                      f"{'B' if a is not None else 'A'} is missing")
        r = a.shape[0]
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise RequestError(field, f"{path}: layer {layer} {module}: lora_A {list(a.shape)}, "
                                      f"lora_B {list(b.shape)}; the base model needs "
                                      f"[r, {d_in}] and [{d_out}, r] (another base model?)")
        if r > max_rank:
            raise RequestError(field, f"{path}: rank {r} is above --max-lora-rank {max_rank}")
        if not conf.get("rank_pattern") and conf.get("r") not in (None, r):
            raise RequestError(field, f"{path}: layer {layer} {module}: rank {r}, but "
                                      f"{CONFIG} says r={conf['r']} (PEFT refuses it too)")
        rank = max(rank, r)
        scale = alpha / (math.sqrt(r) if rslora else r)
        target = next(k for k, (mods, _) in TARGETS.items() if module in mods)
        j = TARGETS[target][0].index(module)
        A, B = weights[layer][target]
        A[:, j * max_rank:j * max_rank + r] = a.T
        B[j][:r] = b.T * scale
    return Adapter(name, path, rank, weights)


def _zeros(target: str, cfg, shapes, max_rank: int, dtype):
    mods = TARGETS[target][0]
    return (np.zeros((shapes[mods[0]][0], len(mods) * max_rank), dtype),
            tuple(np.zeros((max_rank, shapes[m][1]), dtype) for m in mods))


def read_config(path: str, field: str) -> dict:
    f = os.path.join(path, CONFIG)
    if not os.path.isfile(f):
        raise RequestError(field, f"{path}: no {CONFIG} (a PEFT adapter directory holds "
                                  f"{CONFIG} and {WEIGHTS})")
    try:
        with open(f) as fh:
            conf = json.load(fh)
    except (OSError, ValueError) as e:
        raise RequestError(field, f"{f}: cannot read: {e}") from e
    if not isinstance(conf, dict):
        raise RequestError(field, f"{f}: expected a JSON object")
    return conf


def _read_tensors(path: str, field: str) -> dict[str, np.ndarray]:
    f = os.path.join(path, WEIGHTS)
    if not os.path.isfile(f):
        raise RequestError(field, f"{path}: no {WEIGHTS}")
    from safetensors import safe_open
    try:
        with safe_open(f, "np") as st:
            return {k: np.asarray(st.get_tensor(k), np.float32) for k in st.keys()}
    except Exception as e:     # bf16 tensors: numpy has no bfloat16; read through torch-free ml_dtypes
        try:
            from safetensors.flax import load_file
            return {k: np.asarray(v, np.float32) for k, v in load_file(f).items()}
        except Exception:
            raise RequestError(field, f"{f}: cannot read: {e}") from e
