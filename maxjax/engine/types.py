"""Request-level types shared by the engine, the Python API and the server."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0          # 0 means greedy
    top_k: int = 0                    # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False     # for `echo` with logprobs
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        def bad(name, why):
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be >= 0")
        if self.top_k < 0:
            bad("top_k", "must be >= 0 (0 disables it)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", "must be in [-2, 2]")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        if self.min_tokens < 0 or self.min_tokens > self.max_new_tokens:
            bad("min_tokens", "must be in [0, max_new_tokens]")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            bad("seed", "must be a non-negative 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
