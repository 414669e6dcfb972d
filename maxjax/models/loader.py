"""Finding and loading a model: the embedded default, a local HF dir or GGUF, or a cached repo id."""
from __future__ import annotations

import concurrent.futures
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp

from maxjax.models import quantize, registry, source
from maxjax.models.sampling_defaults import SamplingDefaults
from maxjax.models.source import (EMBEDDED_FILE, EMBEDDED_NAME,  # noqa: F401 (re-exported)
                                   EMBEDDED_PACKAGE, ModelSource, embedded_model_path)
from maxjax.graphs.config import ModelConfig
from maxjax.errors import UserError, read_user_file
from maxjax.graphs.arch import Architecture

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
    # What the user called it (--model-path as given; the server's default model id); `name`,
    # the file or directory's, is what artifacts and logs record and requests may still use.
    served_name: str = ""
    vision: Any = None        # an image-text model's encoder (maxjax/models/vision.py)
    # what requests that leave sampling fields out get (maxjax/models/sampling_defaults.py;
    # build_core reads them under --generation-config)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def compute_dtype(self):
        """The activations' dtype: the float encoding, float32 for a quantized one."""
        return DTYPES.get(self.dtype, jnp.float32)


def resolve_model_path(model, encoding: str | None = None) -> str:
    """The local file or directory holding `model`'s config (maxjax/models/source.py)."""
    return source.resolve(model, encoding).config


def read_chat_template_file(path: str) -> str:
    """--chat-template's template, compiled as transformers compiles it (a template that does
    not parse is the flag's error at start, not every chat request's)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template
    text = read_user_file(path, "--chat-template")
    if path.endswith(".json") or text.lstrip().startswith("{\""):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--chat-template {path}: not valid JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("chat_template"), str):
            raise UserError(f"--chat-template {path}: JSON needs a string 'chat_template' key")
        text = data["chat_template"]
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise UserError(f"--chat-template {path}: not a valid Jinja template{line}: "
                        f"{e.message or e}") from None
    return text


def read_checkpoint(model: str | ModelSource | None = None,
                    encoding: str | None = None) -> Checkpoint:
    """The Checkpoint (header only) of `model`: a ModelSource (maxjax/models/source.py), or its
    path alone (a GGUF file, an HF directory or repo id, None: the embedded default).
    `encoding`: the --quantization-encoding as given, which picks a GGUF repo's file."""
    if encoding is not None:
        quantize.check_name(encoding)      # before anything is fetched
    src = source.as_source(model)
    return open_checkpoint(source.resolve(src, encoding), src)


def load_model(model: str | ModelSource | Checkpoint | None, encoding: str,
               chat_template: str | None = None, progress: bool = True, params_source=None,
               kernels: bool = False) -> LoadedModel:
    """`model`'s weights converted to `encoding` (maxjax/models/quantize.py), with its tokenizer
    and chat template. `model`: a Checkpoint read already (`read_checkpoint`), else as
    `read_checkpoint` takes it. `encoding` is the plan's (maxjax/engine/encoding.py: a start
    gets it from maxjax/engine/build.py `load`); one the checkpoint cannot give is a UserError.
    `kernels`: the CPU kernels run, so 4-bit GGUF blocks are packed for them as they are read.
    params_source(arch, cfg, encoding, path) -> (config, params) or None: converted weights
    stored with precompiled artifacts (maxjax/aot/weights.py; on a mesh laid out and placed
    already), used instead of converting the checkpoint."""
    t0 = time.perf_counter()
    ckpt = model if isinstance(model, Checkpoint) else read_checkpoint(model, encoding)
    files, src, path = ckpt.files, ckpt.src, ckpt.path
    arch, cfg, reader, template = ckpt.arch, ckpt.config, ckpt.reader, ckpt.template
    make_tokenizer = ckpt.make_tokenizer
    quantize.check_encoding(encoding, ckpt.types, arch)
    if reader is None:
        from maxjax.models import hf as hfw
        reader = hfw.SafetensorsReader(files.weights)
    # The tokenizer (transformers' import and conversion: Python) builds on a thread while the
    # weights convert (numpy, which releases the GIL): ~1 s of a start on two cores.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maxjax-tokenizer") as pool:
        tokenizing = pool.submit(make_tokenizer)
        vision = None
        if arch.vision is not None:
            from maxjax.models import vision as vm
            processing = pool.submit(vm.image_processor, files.tokenizer)
            vcfg, vparams = vision_weights_of(arch, ckpt, reader, encoding, files)
        stored = params_source(arch, cfg, encoding, path) if params_source else None
        if stored is not None:
            cfg, params = stored
            if hasattr(reader, "close"):
                reader.close()
        else:
            params = load_params(arch, cfg, reader, encoding, progress, os.path.basename(path),
                                 kernels)
        tokenizer = tokenizing.result()
        if arch.vision is not None:
            vision = vm.vision_model(arch.vision, vcfg, vparams, processing.result())
    template = template or getattr(tokenizer, "chat_template", None)
    if not template and not files.is_gguf:
        template = jinja_template(files.tokenizer)
    if chat_template:
        template = read_chat_template_file(chat_template)
    return LoadedModel(arch, cfg, params, tokenizer, template, path, encoding,
                       model_name(src.model_path, path), time.perf_counter() - t0,
                       served_name=src.model_path or EMBEDDED_NAME, vision=vision)


def vision_weights_of(arch: Architecture, ckpt, reader, dtype: str, files) -> tuple:
    """The image encoder's (config, params) of an image-text checkpoint, in float (its
    activations' dtype)."""
    from maxjax.models.vision import vision_weights
    if files.is_gguf:
        raise UserError(f"{files.config}: {arch.name} from GGUF: its image encoder is not "
                        "read (serve the HF checkpoint)")
    # a flat config.json (Qwen2.5-VL's hub checkpoints) is the text model's and the wrapper's
    return vision_weights(arch.vision, ckpt.hf.get("multimodal_config", ckpt.hf), reader,
                          DTYPES.get(dtype, jnp.float32), files.config)


@dataclass
class Checkpoint:
    """A checkpoint's header: what its config and tensor list say, no tensor read."""
    path: str
    arch: Architecture
    config: ModelConfig
    hf: dict                       # config.json (a GGUF's: made from its metadata)
    types: list[str] | None        # a GGUF's 2-D tensor types; None: an HF (float) checkpoint
    reader: Any                    # a GGUF's tensor reader; None for HF (opened by load_model)
    template: str | None           # the GGUF's chat template
    make_tokenizer: Any
    files: source.Resolved | None = None    # where it was read from (`open_checkpoint`)
    src: ModelSource | None = None

    def tensor_types(self, hf_names: list[str]) -> list[str] | None:
        """The GGUF types of these HF-named tensors (None: an HF checkpoint)."""
        if self.reader is None:
            return None
        tensors = self.reader.gf.tensors
        return [tensors[n][0].name if n in tensors else "?"
                for n in map(self.reader.gguf_name, hf_names)]


def open_checkpoint(files, src: ModelSource) -> Checkpoint:
    """The Checkpoint of resolved files (maxjax/models/source.py `resolve`): a GGUF file or an
    HF directory; UserError for an architecture that is not registered, a config it cannot run,
    or a source flag the checkpoint refuses (--rope-type, --trust-remote-code,
    --sliding-window)."""
    path = files.config
    if files.is_gguf:
        from maxjax.models import gguf
        hf, reader, make_tokenizer, template = gguf.open_gguf(path, tokenizer=False)
        check_rope_type(src, gguf_rope_type(reader))
        arch, cfg = model_config(hf, path, src)
        return Checkpoint(path, arch, cfg, hf, reader.matrix_types(), reader, template,
                          make_tokenizer, files, src)
    from maxjax.models import hf as hfw
    check_rope_type(src, None)
    hf = hfw.read_config(path)
    check_remote_code(src, path)
    arch, cfg = model_config(hf, path, src)   # fail before reading weights or the tokenizer
    return Checkpoint(path, arch, cfg, hf, None, None, None,
                      lambda: load_hf_tokenizer(files.tokenizer, src.trust_remote_code), files,
                      src)


def abstract_model(ckpt: Checkpoint, dtype: str, name: str) -> LoadedModel:
    """`load_model`'s LoadedModel in encoding `dtype` (the plan's) from the checkpoint's
    header alone: its params the ShapeDtypeStructs the conversion would give
    (maxjax/models/quantize.py `abstract_params`), no tokenizer. What `maxjax suggest` plans
    with (maxjax/cli/suggest.py)."""
    from maxjax.graphs.decoder import hf_layer_names
    names = hf_layer_names(ckpt.config.post_norms)

    def types_of(i: int, key: str):
        return ckpt.tensor_types([n.format(i=i) for n in names.get(key, ())])
    params = quantize.abstract_params(ckpt.arch.param_specs(ckpt.config), dtype, types_of)
    return LoadedModel(ckpt.arch, ckpt.config, params, None, ckpt.template, ckpt.path, dtype, name)


def model_name(model: str | None, path: str) -> str:
    """The name artifacts and the compile cache know a model by (its served name is what the
    user passed: LoadedModel.served_name)."""
    return EMBEDDED_NAME if not model else os.path.basename(path.rstrip("/")).removesuffix(".gguf")


def jinja_template(directory: str) -> str | None:
    """An HF directory's chat_template.jinja (newer checkpoints keep the template there)."""
    path = os.path.join(directory, "chat_template.jinja")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def gguf_rope_type(reader) -> str:
    """A GGUF's rope layout as llama.cpp names it: "normal" (llama's permuted rows) or "neox"."""
    return "normal" if reader.permute else "neox"


def check_rope_type(src: ModelSource, own: str | None) -> None:
    """--rope-type: only the model's own layout is served (`own` None: not a GGUF)."""
    if src.rope_type is None:
        return
    if own is None:
        raise UserError(f"{src.flag('rope_type')} {src.rope_type}: only applies to GGUF weights "
                        "(an HF checkpoint's config sets its rope)")
    if src.rope_type != own:
        raise UserError(f"{src.flag('rope_type')} {src.rope_type}: this GGUF's rope layout is "
                        f"{own!r}; another is not supported")


def check_remote_code(src: ModelSource, path: str) -> None:
    """A config.json naming custom code (`auto_map`) is loaded only with --trust-remote-code
    (maxjax still runs its own JAX graph of architectures[0]: it never runs that code's model)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            custom = "auto_map" in json.load(f)
    except (OSError, ValueError):
        return
    if custom and not src.trust_remote_code:
        raise UserError(f"{path}: config.json asks for custom code (auto_map): pass "
                        f"{src.flag('trust_remote_code')} to load it")


def model_config(hf: dict, path: str, src: ModelSource | None = None
                 ) -> tuple[Architecture, ModelConfig]:
    """The architecture and its config; --sliding-window replaces the HF config's
    `sliding_window`, refused where the architecture puts it on no layer."""
    arch = registry.get_architecture(hf["architectures"][0])
    window = src.sliding_window if src else None
    if window is not None:
        hf = dict(hf, sliding_window=window)
    try:
        cfg = arch.config_from_hf(hf)
    except (KeyError, ValueError) as e:   # an architecture file's word on a config it cannot run
        raise UserError(f"{path}: {arch.name}: unsupported config: {e}") from e
    if window is not None and window not in cfg.layer_windows:
        raise UserError(f"{src.flag('sliding_window')} {window}: {arch.name} as configured has no "
                        "sliding-window layers to apply it to (MistralForCausalLM, Gemma3, or "
                        "Qwen2/Qwen3 with use_sliding_window have)")
    return arch, cfg


def load_params(arch: Architecture, cfg: ModelConfig, reader, encoding: str, progress: bool,
                label: str, kernels: bool = False):
    """`kernels`: the CPU kernels run (maxjax/engine/plan.py choose_kernels): 4-bit GGUF blocks
    are packed for them as they are read."""
    from tqdm import tqdm
    total = len(arch.param_shapes(cfg)["layers"])
    extra = {}
    if quantize.is_quantized(encoding):
        extra["quantizer"] = quantize.Quantizer(encoding, reader, getattr(reader, "q4", None),
                                                getattr(reader, "q4_blocks", None) if kernels
                                                else None)
    with tqdm(total=total, desc=f"loading {label}", unit="tensor", disable=not progress,
              leave=False) as bar:
        try:
            return arch.params_from_hf(cfg, reader, DTYPES.get(encoding, jnp.float32),
                                       progress=bar.update, **extra)
        finally:
            if hasattr(reader, "close"):
                reader.close()


# The files some transformers tokenizer reads (one of them is needed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "tokenizer_config.json", "spiece.model", "tiktoken.model")


def load_hf_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f))
                                       for f in TOKENIZER_FILES):
        raise UserError(f"{path}: no tokenizer files (tokenizer.json, tokenizer.model or "
                        f"vocab.json with tokenizer_config.json): copy the model's tokenizer "
                        f"into the directory")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise UserError(f"{path}: cannot load the tokenizer: {' '.join(str(e).split())}") from e
