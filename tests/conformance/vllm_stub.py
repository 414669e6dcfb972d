"""A stand-in `vllm` package for vLLM's entrypoint tests run against maxjax: vLLM itself is
never installed. Any `vllm.*` module imports; a name in it is a `Stub` that stands for vLLM's
object until used, and raises `VllmInternal` when called, so a test that exercises vLLM's own
code (its request classes, its serving objects) fails by saying so. The few names the
protocol-level tests use as data are real: the tokenizer (the served SmolLM2's), the platform
(a CPU without ROCm or CUDA), the exception classes."""
import functools
import importlib.abc
import importlib.machinery
import sys
import types


class VllmInternal(RuntimeError):
    """A test used a part of vLLM itself; against maxjax there is none."""


class Stub:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise VllmInternal(f"{self._name} is vLLM-internal (not installed; maxjax is tested)")

    def __repr__(self) -> str:
        return f"<vLLM stub {self._name}>"


class _Platform:
    """vllm.platforms.current_platform: a CPU that is none of vLLM's accelerators."""

    def __getattr__(self, attr: str):
        if attr.startswith("is_"):
            return lambda *a, **k: attr == "is_cpu"
        return Stub(f"vllm.platforms.current_platform.{attr}")


@functools.cache
def _smollm2_tokenizer():
    from maxjax.models.gguf import open_gguf
    from maxjax.models.loader import embedded_model_path
    return open_gguf(embedded_model_path())[2]


def get_tokenizer(*args, **kwargs):
    """Every test's tokenizer is the served model's, whatever checkpoint the test names."""
    return _smollm2_tokenizer()


class _NoHub:
    """vllm.transformers_utils.repo_utils.hf_api(): nothing is downloaded; the LoRA adapters a
    module asks for are not served, so the tests naming them fail on the list."""

    def snapshot_download(self, repo_id: str, **kwargs) -> str:
        return f"/nonexistent/{repo_id}"


class VLLMValidationError(ValueError):
    pass


class GenerationError(RuntimeError):
    pass


REAL = {
    "vllm.platforms": {"current_platform": _Platform()},
    "vllm.tokenizers": {"get_tokenizer": get_tokenizer},
    "vllm.transformers_utils.tokenizer": {"get_tokenizer": get_tokenizer},
    "vllm.transformers_utils.repo_utils": {"hf_api": _NoHub},
    "vllm.exceptions": {"VLLMValidationError": VLLMValidationError,
                        "GenerationError": GenerationError},
}


class _Module(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        module.__dict__.update(REAL.get(spec.name, {}))
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
