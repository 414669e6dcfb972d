"""A request's sampling fields -> SamplingParams (with the defaults in force), the request
field an engine error names, and the per-choice seeds; shared by every generation route."""
from __future__ import annotations

from dataclasses import replace

from maxjax.engine.types import SamplingParams, param_specs

from .protocol import APIError
from .state import ServerState
from .structured import grammar_spec


def default_max_tokens(st: ServerState, prompts: list[list[int]], max_tokens: int | None,
                       most: int | None = None, clamp: bool = False) -> int:
    """max_tokens, or what the longest prompt leaves of the maximum length, up to `most` (at
    least 1, so a prompt that does not fit is the error the engine reports). `clamp`: a
    max_tokens over what is left is cut to it (the APIs whose clients send a large default
    whatever the model: Anthropic Messages, Responses), not the engine's 400."""
    left = max(st.engine.max_length - max(map(len, prompts)), 1)
    if max_tokens is not None:
        return min(max_tokens, left) if clamp else max_tokens
    return left if most is None else min(left, most)


def sampling_params(st: ServerState, req, max_new: int, logprobs: bool, top_logprobs: int,
                    prompt_logprobs: bool = False) -> SamplingParams:
    """The request's fields as SamplingParams, the defaults in force (ServerState.
    sampling_defaults) for those it leaves out; the engine validates them at admission."""
    bias = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            bias[int(k)] = float(v)
        except ValueError:
            raise APIError(400, f"logit_bias: key {k!r} is not a token id",
                           param="logit_bias") from None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return st.sampling_defaults.params(
        max_new_tokens=max_new, temperature=req.temperature,
        top_k=None if req.top_k is None else max(req.top_k, 0), top_p=req.top_p,
        min_p=req.min_p, seed=req.seed, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=bias, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        stop=[s for s in stop if s], stop_token_ids=list(req.stop_token_ids or []),
        logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens, structured_output=grammar_spec(req))


def error_names(route: str, prompt_field: str) -> dict[str, str]:
    """SamplingParams field (and "prompt") -> the request field an engine error names, from the
    declaration; route is "chat" or "completions"."""
    return {"prompt": prompt_field, **{name: getattr(spec, route)[0]
                                       for name, spec in param_specs().items()
                                       if getattr(spec, route)}}


CHAT_ERROR_NAMES = error_names("chat", "messages")
COMPLETION_ERROR_NAMES = error_names("completions", "prompt")


def per_choice(params: SamplingParams, count: int, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice j of each prompt uses seed + j so the
    n samples differ but stay reproducible (wrapping within int64)."""
    if params.seed is None:
        return [replace(params) for _ in range(count)]   # copies: an engine may annotate them
    return [replace(params, seed=(params.seed + i % n + 2**63) % 2**64 - 2**63)
            for i in range(count)]
