"""maxjax: an OpenAI-compatible LLM inference server on JAX/XLA."""
from maxjax.version import __version__  # noqa: E402

from maxjax import xla_flags as _xla_flags  # noqa: E402

_xla_flags.apply_defaults()

from maxjax.engine.types import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    if name == "LLM":   # lazy: importing maxjax should not import jax
        from maxjax.llm import LLM
        return LLM
    raise AttributeError(name)
