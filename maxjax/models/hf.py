"""HF checkpoint directories: config.json + *.safetensors (single or sharded with an index)."""
from __future__ import annotations

import json
import os
from contextlib import ExitStack

import numpy as np

from maxjax.errors import UserError


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UserError(f"{path}: not a model directory (no config.json)")
    try:
        with open(cfg_path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{cfg_path}: unreadable config.json: {e}") from e
    if "text_config" in hf and "architectures" in hf:   # multimodal wrapper: take the text model
        text = dict(hf["text_config"])
        text.setdefault("architectures", hf["architectures"])
        text["multimodal_config"] = hf      # what an image encoder reads (graphs/vision.py)
        hf = text
    if not hf.get("architectures"):
        raise UserError(f"{cfg_path}: has no 'architectures' entry")
    _add_generation_eos(path, hf)
    return hf


def _add_generation_eos(path: str, hf: dict) -> None:
    """generation_config.json's eos_token_id ends generation too, as in transformers' generate
    and vLLM (instruct checkpoints often name their end-of-turn token only there)."""
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return
    try:
        with open(gen_path) as f:
            extra = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"{gen_path}: unreadable generation_config.json: {e}") from e
    ids = []
    for v in (hf.get("eos_token_id"), extra):
        for i in (v if isinstance(v, list) else [] if v is None else [v]):
            if not isinstance(i, int) or isinstance(i, bool):
                raise UserError(f"{path}: eos_token_id {i!r} is not a token id")
            ids.append(i)
    if ids:
        ids = list(dict.fromkeys(ids))
        hf["eos_token_id"] = ids[0] if len(ids) == 1 else ids


def safetensors_files(path: str) -> list[str]:
    if os.path.isfile(path):        # --weight-path FILE
        return [path]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):      # transformers reads it before an index beside it
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted({os.path.join(path, v) for v in weight_map.values()})
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors weights found")
    return files


class SafetensorsReader:
    """`reader(name)` -> float32 numpy array; opened lazily, one handle per shard."""

    def __init__(self, path: str):
        from safetensors import safe_open
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for file in safetensors_files(path):
            try:
                handle = self._stack.enter_context(safe_open(file, framework="numpy"))
            except Exception as e:
                raise UserError(f"{file}: unreadable safetensors file: {e}") from e
            for name in handle.keys():
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def __call__(self, name: str) -> np.ndarray:
        # Checkpoints from multimodal wrappers prefix the text model.
        for candidate in (name, "model.language_model." + name.removeprefix("model."),
                          "language_model." + name):
            if candidate in self._where:
                return np.asarray(self._where[candidate].get_tensor(candidate), dtype=np.float32)
        raise UserError(f"checkpoint has no tensor {name!r}")

    def close(self):
        self._stack.close()
