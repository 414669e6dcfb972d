"""The one validator of a request: `check_request` runs at admission (EngineCore.add_request, and
tests/mock_engine.py so the server tests see the same errors); `check_params` is its part that
needs no engine, which `maxjax generate` also runs on its flags before loading a model. Each
failure is a RequestError naming the SamplingParams field (or "prompt"); the server turns it into
an OpenAI 400 with that field's request name.

Limits, each checked here and nowhere else (the server's pydantic models repeat the OpenAI spec's
bounds for early 400s; tests/test_sampling_params.py keeps them equal to the declaration):
  - every number within the bounds declared on its SamplingParams field (maxjax/engine/types.py),
    floats finite, ints that reach the device without a declared bound within int32;
    min_tokens <= max_new_tokens;
  - logit_bias: at most MAX_LOGIT_BIAS entries (the width of the device arrays), token ids in
    the vocabulary, biases in [-100, 100];
  - stop: at most MAX_STOP_STRINGS strings of at most MAX_STOP_STRING_CHARS characters;
  - stop_token_ids: in the vocabulary and, with min_tokens > 0, at most MAX_SUPPRESS together with
    the model's EOS ids (they are suppressed on the device until min_tokens is reached);
  - prompt: not empty, token ids in the vocabulary, and prompt + max_new_tokens within max_length;
  - an embedding request (`check_embedding_input`): a prompt as above, of at most max_length
    tokens, and a known pooling type;
  - structured_output: a GrammarSpec. Whether the grammar compiles is the grammar backend's
    check (maxjax/structured/backend.py), made before the request reaches the scheduler.
Limits of the engine's resources (KV pool size, a whole prompt per step without chunked prefill)
are the Scheduler's, in `Scheduler.add`.
"""
from __future__ import annotations

import functools
import math
import numbers
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from maxjax.engine.types import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, POOLING_TYPES,
                                 PoolingParams, SamplingParams, param_specs)
from maxjax.errors import RequestError
from maxjax.graphs.sampling import MAX_LOGIT_BIAS, MAX_SUPPRESS
from maxjax.structured.spec import KINDS, GrammarSpec

MAX_ABS_LOGIT_BIAS = 100.0
DEVICE_INT = 2**31     # an int reaching the device without a declared bound must fit its int32


@dataclass(frozen=True)
class EngineLimits:
    """What the engine can take: the vocabulary (width of its logits), max_length (prompt +
    output tokens) and its EOS ids."""
    vocab_size: int
    max_length: int
    eos_token_ids: tuple[int, ...] = ()
    penalties: bool = True      # --enable-penalties
    min_tokens: bool = True     # --enable-min-tokens
    window: int | None = None   # the model's max_position_embeddings (None: not known)


def length_advice(max_length: int, window: int | None = None) -> str:
    """What to change when a prompt does not fit in `max_length` tokens."""
    if window is not None and window <= max_length:
        return ("shorten the prompt or serve a model with a longer context window (this is the "
                f"model's whole window of {window} tokens)")
    most = f" (this model reads up to {window})" if window is not None else \
        " (up to the model's context window)"
    return (f"start the server with a larger --max-length{most}, serve a model with a longer "
            "context window, or shorten the prompt")


PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams,
                  limits: EngineLimits) -> None:
    """Raise RequestError for the first limit the request breaks."""
    check_params(params)
    _check_enabled(params, limits)
    vocab = limits.vocab_size
    if not prompt_token_ids:
        raise RequestError("prompt", "must not be empty")
    _check_token_ids("prompt", prompt_token_ids, vocab)
    n, most = len(prompt_token_ids), limits.max_length
    if n >= most:
        raise RequestError("prompt", f"{n} tokens; the maximum length {most} (prompt + "
                                     f"completion) leaves room for at most {most - 1}: "
                                     + length_advice(most, limits.window))
    if n + params.max_new_tokens > most:
        raise RequestError("max_new_tokens", f"{n} prompt tokens + {params.max_new_tokens} new "
                                             f"tokens exceed the maximum length {most}")
    _check_token_ids("logit_bias", params.logit_bias, vocab)
    _check_token_ids("stop_token_ids", params.stop_token_ids, vocab)
    if params.min_tokens > 0:
        eos = set(limits.eos_token_ids)
        if len(eos | set(params.stop_token_ids)) > MAX_SUPPRESS:
            raise RequestError("stop_token_ids", f"at most {MAX_SUPPRESS - len(eos)} ids besides "
                                                 f"EOS with min_tokens (got "
                                                 f"{len(set(params.stop_token_ids) - eos)})")


def _check_enabled(params: SamplingParams, limits: EngineLimits) -> None:
    if not limits.penalties:
        off = SamplingParams()
        for name in PENALTIES:
            if getattr(params, name) != getattr(off, name):
                raise RequestError(name, "penalties are off on this server "
                                         "(--no-enable-penalties)")
    if not limits.min_tokens and params.min_tokens:
        raise RequestError("min_tokens", "min_tokens is off on this server "
                                         "(--no-enable-min-tokens)")


def check_embedding_input(prompt_token_ids: Sequence[int], pooling: PoolingParams,
                          limits: EngineLimits) -> None:
    """An embedding request's limits: a prompt that is not empty, token ids in the vocabulary,
    at most max_length tokens (nothing is generated after it), a known pooling type."""
    if not prompt_token_ids:
        raise RequestError("prompt", "must not be empty")
    _check_token_ids("prompt", prompt_token_ids, limits.vocab_size)
    if len(prompt_token_ids) > limits.max_length:
        raise RequestError("prompt", f"{len(prompt_token_ids)} tokens, more than the maximum "
                                     f"length {limits.max_length}")
    if pooling.pooling_type not in POOLING_TYPES:
        raise RequestError("pooling_type", f"{pooling.pooling_type!r} is not one of "
                                           f"{', '.join(POOLING_TYPES)}")


def check_params(params: SamplingParams) -> None:
    """The limits that hold whatever the engine: declared bounds, types, collection sizes."""
    hints = _hints()
    for name, spec in param_specs().items():
        value = getattr(params, name)
        kind = hints[name]
        if kind is bool and not isinstance(value, bool):
            hint = " (top_logprobs=N returns N alternatives)" if name == "logprobs" else ""
            raise RequestError(name, f"must be true or false (got {value!r}){hint}")
        if kind in (int, float) and value is not None:
            integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            real = integral or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                                and math.isfinite(value))
            if not (integral if kind is int else real):
                what = "an integer" if kind is int else "a finite number"
                raise RequestError(name, f"must be {what} (got {value!r})")
            if not spec.in_bounds(value):
                raise RequestError(name, f"must be {spec.bounds_text()} (got {value!r})")
            if integral and spec.device and spec.le is None and spec.lt is None and \
                    not -DEVICE_INT < value < DEVICE_INT:
                raise RequestError(name, f"must be < {DEVICE_INT} (got {value})")
    if params.min_tokens > params.max_new_tokens:
        raise RequestError("min_tokens", f"must be at most the number of tokens to generate "
                                         f"({params.max_new_tokens}; got {params.min_tokens})")
    _check_logit_bias(params.logit_bias)
    _check_stop(params.stop)
    if not isinstance(params.stop_token_ids, Sequence):
        raise RequestError("stop_token_ids", "must be a list of token ids")
    _check_structured(params)


def _check_structured(params: SamplingParams) -> None:
    spec = params.structured_output
    if spec is None:
        return
    if not isinstance(spec, GrammarSpec) or spec.kind not in KINDS:
        raise RequestError("structured_output", "must be a GrammarSpec (maxjax.structured)")


@functools.cache
def _hints() -> dict:
    """Each field's type, optional ones (`int | None`) reduced to the type."""
    out = {}
    for name, hint in typing.get_type_hints(SamplingParams).items():
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        out[name] = hint
    return out


def _check_logit_bias(bias) -> None:
    if not isinstance(bias, Mapping):
        raise RequestError("logit_bias", "must map token ids to biases")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries (got {len(bias)})")
    for tid, v in bias.items():
        if not (isinstance(v, numbers.Real) and -MAX_ABS_LOGIT_BIAS <= v <= MAX_ABS_LOGIT_BIAS):
            raise RequestError("logit_bias", f"the bias of token {tid} must be in "
                                             f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}] "
                                             f"(got {v!r})")


def _check_stop(stop) -> None:
    if isinstance(stop, str) or not isinstance(stop, Sequence) or \
            not all(isinstance(s, str) for s in stop):
        raise RequestError("stop", "must be a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})")
    long = next((s for s in stop if len(s) > MAX_STOP_STRING_CHARS), None)
    if long is not None:
        raise RequestError("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} "
                                   f"characters (got {len(long)})")


def _check_token_ids(name: str, ids, vocab_size: int) -> None:
    """`ids` (a list, or a mapping keyed by token id) are integers in [0, vocab_size)."""
    bad = next((t for t in ids if not (isinstance(t, numbers.Integral) and
                                       not isinstance(t, bool) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise RequestError(name, f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")
