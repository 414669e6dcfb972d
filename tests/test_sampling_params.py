"""The one declaration of the sampling parameters (maxjax/engine/types.py) against everything
that restates it: the server's request models and their translation, `generate`'s flags, the
device arrays; and the one validator (maxjax/engine/validate.py): every limit, at its edge."""
import dataclasses
import math
import types
import typing

import numpy as np
import pytest
from mock_engine import EOS_ID, MockEngine
from server_harness import ServerThread, http

from maxjax.cli.main import build_parser
from maxjax.cli.args import sampling_params as flags_to_params
from maxjax.engine.types import MAX_TOP_LOGPROBS, SamplingParams, param_specs
from maxjax.engine.validate import EngineLimits, check_params, check_request
from maxjax.errors import RequestError
from maxjax.graphs.sampling import (MAX_LOGIT_BIAS, MAX_SUPPRESS, SamplingArrays,
                                    build_sampling_arrays)
from maxjax.structured import GrammarSpec
from maxjax.server.protocol import ChatCompletionRequest, CompletionRequest

SPECS = param_specs()
HINTS = typing.get_type_hints(SamplingParams)
ROUTES = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
# Request value and the SamplingParams value it becomes, for every request-facing field.
EXAMPLES = {
    "max_new_tokens": (3, 3), "temperature": (0.5, 0.5), "top_k": (7, 7), "top_p": (0.9, 0.9),
    "min_p": (0.1, 0.1), "seed": (11, 11), "frequency_penalty": (0.5, 0.5),
    "presence_penalty": (-0.5, -0.5), "repetition_penalty": (1.2, 1.2),
    "logit_bias": ({"65": 5}, {65: 5.0}), "min_tokens": (2, 2), "ignore_eos": (True, True),
    "stop": (["zz"], ["zz"]), "stop_token_ids": ([EOS_ID], [EOS_ID]),
    "logprobs": (True, True), "top_logprobs": (3, 3), "skip_special_tokens": (False, False),
    "structured_output": ({"type": "json_object"}, GrammarSpec.json_object())}
# SamplingArrays fields that carry no parameter: position and history of the row, grammar mask.
NOT_PARAMS = {"step", "history", "output_start", "token_mask"}
LIMITS = EngineLimits(vocab_size=100, max_length=32, eos_token_ids=(2,))


def numeric(name) -> bool:
    """An int or float field, optional or not."""
    hint = HINTS[name]
    if isinstance(hint, types.UnionType):
        hint, = set(typing.get_args(hint)) - {type(None)}
    return hint in (int, float)


def pydantic_bounds(info) -> dict:
    return {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt")
            if hasattr(m, k)}


def api_bounds(spec) -> dict:
    """The bounds a request field must declare: the engine's, as the OpenAI spec narrows them."""
    low = {"ge": spec.api_off} if spec.api_off is not None else {"ge": spec.ge, "gt": spec.gt}
    high = {"le": spec.api_le} if spec.api_le is not None else {"le": spec.le, "lt": spec.lt}
    return {k: v for k, v in {**low, **high}.items() if v is not None}


# ---- the server's request models --------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
def test_request_fields_have_the_declared_bounds(route):
    fields = ROUTES[route].model_fields
    for name, spec in SPECS.items():
        for request_name in getattr(spec, route):
            assert request_name in fields, (route, name, request_name)
            if numeric(name):
                assert pydantic_bounds(fields[request_name]) == api_bounds(spec), \
                    (route, name, request_name)
    assert set(SPECS) - {n for n, s in SPECS.items() if getattr(s, route)} == {"prompt_logprobs"}


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine())
    yield s
    s.close()


def sent(server, route, body):
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}[route]
    body = {**body, **({"messages": [{"role": "user", "content": "hi"}]} if route == "chat"
                       else {"prompt": "hi"})}
    r = http("POST", server.url + path, body)
    assert r.status_code == 200, r.text
    return server.engine.requests[-1][1:3]


@pytest.mark.parametrize("route", ROUTES)
def test_every_request_field_reaches_the_engine(server, route):
    request_facing = {n for n, s in SPECS.items() if getattr(s, route)}
    assert set(EXAMPLES) == request_facing
    body = {getattr(SPECS[n], route)[0]: EXAMPLES[n][0] for n in SPECS if n in EXAMPLES}
    _, p = sent(server, route, body)
    for name, (_, value) in EXAMPLES.items():
        assert getattr(p, name) == value, name


@pytest.mark.parametrize("route", ROUTES)
def test_omitted_request_fields_are_the_declared_defaults(server, route):
    prompt, p = sent(server, route, {})
    max_new = server.engine.max_length - len(prompt) if route == "chat" else 16
    assert p == SamplingParams(max_new_tokens=max_new)
    _, p = sent(server, route, {"top_k": SPECS["top_k"].api_off})
    assert p.top_k == 0


# ---- the device arrays ------------------------------------------------------------------------

def arrays(params: SamplingParams):
    return build_sampling_arrays([(params, [5, 6], [7], params.seed or 0)], 1, 8,
                                 eos_token_ids=[2], vocab_size=64)


def test_every_int64_seed_is_its_own_64_bit_key():
    """A negative seed is the two's complement of its 64 bits: no two int64 seeds share the
    device key (the hash's input), so each stays its own reproducible stream."""
    seeds = [0, 1, -1, 2**63 - 1, -2**63, 2**32, -2**32, 2**32 - 1]
    keys = [tuple(arrays(SamplingParams(seed=s)).seed[0].tolist()) for s in seeds]
    assert len(set(keys)) == len(seeds)
    assert keys[2] == (2**32 - 1, 2**32 - 1) and keys[4] == (2**31, 0)


def test_device_params_have_their_arrays():
    fields = {f.name for f in dataclasses.fields(SamplingArrays)}
    claimed = {a for s in SPECS.values() for a in s.device}
    assert claimed <= fields and fields - claimed == NOT_PARAMS
    base = SamplingParams(min_tokens=2)        # so stop_token_ids reach the suppressed ids
    for name, spec in SPECS.items():
        if not spec.device:
            continue
        before = arrays(dataclasses.replace(base, min_tokens=0) if name == "min_tokens" else base)
        after = arrays(dataclasses.replace(base, **{name: EXAMPLES[name][1]}))
        for field in spec.device:
            assert not np.array_equal(getattr(before, field), getattr(after, field)), (name, field)


# ---- generate's flags -------------------------------------------------------------------------

def parse(*flags):
    return build_parser().parse_args(["generate", "--prompt", "x", *flags])


def test_generate_flags_come_from_the_declaration(capsys):
    flagged = {n: s for n, s in SPECS.items() if s.has_flag}
    defaults = flags_to_params(parse())
    assert defaults == SamplingParams(**{n: s.flag_default for n, s in flagged.items()})
    assert (defaults.max_new_tokens, defaults.temperature) == (64, 0.0)
    for name in flagged:
        value = EXAMPLES[name][1]
        if isinstance(value, bool):
            args = [f"--{name.replace('_', '-')}"]
        else:
            args = [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, list)
                                                          else [value])]
        assert getattr(flags_to_params(parse(*args)), name) == value, name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(s.help in help_text for s in flagged.values())


# ---- the validator ----------------------------------------------------------------------------

def refused(prompt, param, match=None, limits=LIMITS, **kw):
    with pytest.raises(RequestError, match=match) as e:
        check_request(prompt, SamplingParams(**{"max_new_tokens": 4, **kw}), limits)
    assert e.value.param == param and str(e.value).startswith(f"{param}: ")


@pytest.mark.parametrize("name,value", [
    ("max_new_tokens", 0), ("max_new_tokens", 2.5), ("temperature", -0.1),
    ("temperature", math.inf), ("temperature", math.nan), ("top_k", -1), ("top_k", 2.0),
    ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5),
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0),
    ("seed", -2**63 - 1), ("seed", 2**63), ("top_logprobs", MAX_TOP_LOGPROBS + 1),
    ("top_logprobs", -1), ("min_tokens", -1), ("min_tokens", 5),
])
def test_numbers_out_of_their_bounds(name, value):
    refused([1, 2], name, **{name: value})


def test_numbers_at_their_bounds():
    check_request([1, 2], SamplingParams(
        max_new_tokens=30, temperature=0, top_k=0, top_p=1, min_p=1, frequency_penalty=-2,
        presence_penalty=2, repetition_penalty=1e-3, seed=2**63 - 1, min_tokens=30,
        top_logprobs=MAX_TOP_LOGPROBS), LIMITS)
    check_request([1], SamplingParams(max_new_tokens=1, seed=-2**63, temperature=100.0), LIMITS)


def test_prompt_and_length():
    refused([], "prompt", "empty")
    refused(list(range(32)), "prompt", "maximum length 32")      # moved from test_scheduler
    refused([1, 100], "prompt", r"token id 100 is outside the vocabulary \[0, 100\)")
    refused([-1], "prompt", "token id -1")
    refused([1.5], "prompt", "1.5")
    refused(list(range(29)), "max_new_tokens", "29 prompt tokens \\+ 4 new tokens")
    check_request(list(range(28)), SamplingParams(max_new_tokens=4), LIMITS)


def test_logit_bias():
    full = {i: 1.0 for i in range(MAX_LOGIT_BIAS)}
    check_request([1], SamplingParams(max_new_tokens=4, logit_bias={**full, 0: -100.0, 1: 100}),
                  EngineLimits(1000, 32))
    refused([1], "logit_bias", f"at most {MAX_LOGIT_BIAS}", EngineLimits(1000, 32),
            logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    refused([1], "logit_bias", "token id 100", logit_bias={100: 1.0})
    refused([1], "logit_bias", "token id -1", logit_bias={-1: 1.0})
    refused([1], "logit_bias", r"\[-100, 100\]", logit_bias={5: 100.5})
    refused([1], "logit_bias", r"\[-100, 100\]", logit_bias={5: math.nan})
    refused([1], "logit_bias", "map", logit_bias=[5])


def test_stop_strings():
    check_request([1], SamplingParams(max_new_tokens=4, stop=["x" * 256] * 16), LIMITS)
    refused([1], "stop", "at most 16", stop=["x"] * 17)
    refused([1], "stop", "at most 256 characters", stop=["x" * 257])
    assert SamplingParams(stop="x").stop == ["x"]      # one string, as vLLM and OpenAI take it
    refused([1], "stop", "list of strings", stop=[3])
    refused([1], "stop", "list of strings", stop=("x", 3))


def test_stop_token_ids():
    refused([1], "stop_token_ids", "token id 100", stop_token_ids=[100])
    ids = list(range(3, 3 + MAX_SUPPRESS - 1))      # with EOS (2): exactly MAX_SUPPRESS
    check_request([1], SamplingParams(max_new_tokens=4, min_tokens=1, stop_token_ids=ids + [2]),
                  LIMITS)
    check_request([1], SamplingParams(max_new_tokens=4, stop_token_ids=ids + [50, 51]), LIMITS)
    refused([1], "stop_token_ids", f"at most {MAX_SUPPRESS - 1} ids besides EOS", min_tokens=1,
            stop_token_ids=ids + [50])


def test_params_alone_need_no_engine():
    check_params(SamplingParams(logit_bias={10**6: 1.0}, stop_token_ids=[10**6]))
    with pytest.raises(RequestError, match="temperature"):
        check_params(SamplingParams(temperature=-1))


def test_bools_are_bools():
    refused([1], "logprobs", "top_logprobs=N", logprobs=5)      # vLLM's logprobs=N
    refused([1], "ignore_eos", "true or false", ignore_eos="yes")
    check_params(SamplingParams(logprobs=True, ignore_eos=False))


def test_every_field_has_a_check():
    """Numbers are checked against their declared bounds, bools are bools; a new collection
    field needs its own check in validate.py (and a line here)."""
    collections = {n for n in SPECS if not numeric(n) and HINTS[n] is not bool}
    assert collections == {"logit_bias", "stop", "stop_token_ids", "structured_output"}
    with pytest.raises(RequestError, match="structured_output"):
        check_params(SamplingParams(structured_output={"type": "object"}))
