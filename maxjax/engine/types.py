"""Request-level types shared by the engine, the Python API and the server.

`SamplingParams` is the one declaration of every sampling parameter: each field's metadata
(`ParamSpec`, read with `param_specs()`) holds its bounds, help text, the names it has in the
OpenAI request bodies, the SamplingArrays fields it reaches on the device and, for the fields that
`maxjax generate` exposes, the flag's default. maxjax/engine/validate.py checks requests against
it at admission, maxjax/cli/args.py builds `generate`'s flags from it, and tests/
test_sampling_params.py checks the server's request models (server/protocol.py) and the device
arrays (graphs/sampling.py) against it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field

from maxjax.structured.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20      # the top-k width every step graph is compiled with
MAX_STOP_STRINGS = 16      # stop strings per request (OpenAI allows 4, vLLM any number)
MAX_STOP_STRING_CHARS = 256   # characters per stop string: the detokenizer holds back up to this
_NO_FLAG = object()


@dataclass(frozen=True)
class ParamSpec:
    """How one SamplingParams field is declared.

    Bounds (ge/gt/le/lt) apply to numbers; None (for `seed`: draw one) is not checked against
    them. `chat` / `completions`: the field's names in that request body, the first the one
    errors name; None: the field's own name; (): not a field of that body. `api_le`: the tighter
    upper bound the OpenAI spec puts on the request value; `api_off`: one more value a request
    may send to switch the field off. `device`: the SamplingArrays fields the value reaches.
    `flag_default`: the default of its `maxjax generate` flag (`has_flag` False: no flag)."""
    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    chat: tuple[str, ...] | None = None
    completions: tuple[str, ...] | None = None
    api_le: float | None = None
    api_off: float | None = None
    device: tuple[str, ...] = ()
    flag_default: object = _NO_FLAG

    @property
    def has_flag(self) -> bool:
        return self.flag_default is not _NO_FLAG

    def in_bounds(self, v) -> bool:
        """False for NaN, whatever the bounds."""
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt)
                and v == v)

    def bounds_text(self) -> str:
        low = (f">= {self.ge:g}" if self.ge is not None else
               f"> {self.gt:g}" if self.gt is not None else "")
        high = (f"<= {self.le:g}" if self.le is not None else
                f"< {self.lt:g}" if self.lt is not None else "")
        return " and ".join(b for b in (low, high) if b)


def param(default, help: str, *, flag=_NO_FLAG, **spec):
    """A SamplingParams field declared by its ParamSpec; `default` may be a factory (list,
    dict)."""
    meta = {"param": ParamSpec(help, flag_default=flag, **spec)}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class SamplingParams:
    # api_off 0: /v1/completions with echo scores the prompt, nothing generated
    max_new_tokens: int = param(256, "Tokens to generate at most", ge=1, api_off=0,
                                chat=("max_tokens", "max_completion_tokens"),
                                completions=("max_tokens",), flag=64)
    temperature: float = param(1.0, "Sampling temperature (0: greedy)", ge=0, api_le=2,
                               device=("temperature",), flag=0.0)
    top_k: int = param(0, "Top-k (0: off)", ge=0, api_off=-1, device=("top_k",), flag=0)
    top_p: float = param(1.0, "Nucleus sampling mass", gt=0, le=1, device=("top_p",), flag=1.0)
    min_p: float = param(0.0, "Min-p filter", ge=0, le=1, device=("min_p",), flag=0.0)
    # any int64, as OpenAI and vLLM take it; graphs/sampling.py reads its 64 bits as the key
    seed: int | None = param(None, "Sampling seed", ge=-2**63, lt=2**63, device=("seed",),
                             flag=None)
    frequency_penalty: float = param(0.0, "OpenAI frequency penalty", ge=-2, le=2,
                                     device=("frequency_penalty",), flag=0.0)
    presence_penalty: float = param(0.0, "OpenAI presence penalty", ge=-2, le=2,
                                    device=("presence_penalty",), flag=0.0)
    repetition_penalty: float = param(1.0, "HF repetition penalty", gt=0,
                                      device=("repetition_penalty",), flag=1.0)
    logit_bias: dict[int, float] = param(
        dict, "Token id -> bias in [-100, 100] added to its logit (at most MAX_LOGIT_BIAS)",
        device=("bias_ids", "bias_values"))
    min_tokens: int = param(0, "Tokens generated before EOS, stop_token_ids or a stop string "
                               "may end the request (as in vLLM); at most max_new_tokens", ge=0,
                            device=("suppress_ids",))
    ignore_eos: bool = param(False, "Keep generating past EOS", flag=False)
    stop: list[str] = param(list, f"Stop string (repeatable; at most {MAX_STOP_STRINGS}, each "
                                  f"at most {MAX_STOP_STRING_CHARS} characters)", flag=[])
    stop_token_ids: list[int] = param(list, "Token ids that end the request; with min_tokens, "
                                            "at most MAX_SUPPRESS together with EOS",
                                      device=("suppress_ids",))
    logprobs: bool = param(False, "Return the logprob of each sampled token",
                           device=("logprobs",))
    top_logprobs: int = param(0, "Most likely alternatives returned with each logprob", ge=0,
                              le=MAX_TOP_LOGPROBS, completions=("logprobs",))
    prompt_logprobs: bool = param(False, "Return the prompt tokens' logprobs (completions' echo "
                                         "with logprobs)", chat=(), completions=())
    skip_special_tokens: bool = param(True, "Leave special tokens out of the text")
    structured_output: GrammarSpec | None = param(
        None, "The grammar the output must match (JSON schema, regex, choice, Lark); the "
              "request's field that set it is the spec's `param`",
        chat=("response_format",), completions=("response_format",))

    def __post_init__(self):
        if isinstance(self.stop, str):      # one stop string, as OpenAI and vLLM take it
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@functools.cache
def param_specs() -> dict[str, ParamSpec]:
    """Every SamplingParams field's ParamSpec, in declaration order, request names resolved."""
    out = {}
    for f in dataclasses.fields(SamplingParams):
        spec = f.metadata["param"]
        out[f.name] = dataclasses.replace(
            spec, chat=(f.name,) if spec.chat is None else spec.chat,
            completions=(f.name,) if spec.completions is None else spec.completions)
    return out


POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How an embedding request's vector is made from its prompt's final-normed hidden states:
    the last token's (as vLLM does for causal LMs) or their mean, then L2-normalized unless
    `normalize` is off (--no-pool-embeddings: the last token's state as the model computes it)."""
    pooling_type: str = "last"
    normalize: bool = True


class FinishReason(enum.StrEnum):
    """Why a request ended. A str: the value is what every API sends (OpenAI's finish_reason;
    server/anthropic_api.py and server/responses_api.py map it to their own words)."""
    STOP = "stop"                     # EOS, a stop token or a stop string
    LENGTH = "length"                 # max_tokens, or the model's length
    ABORT = "abort"                   # the caller went away, or the engine shut down
    ERROR = "error"                   # the engine failed the request (RequestOutput.error says how)
    GRAMMAR_ERROR = "grammar_error"   # its grammar allows no next token (the request's own)
    TOOL_CALLS = "tool_calls"         # the server's, for a chat output holding tool calls


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One update for one request, as the engine streams it: the tokens new since the last one."""
    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    embedding: list[float] | None = None   # an embedding request's vector (its last output)
