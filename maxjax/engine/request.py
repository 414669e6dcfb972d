"""A request carries all of its engine state: the Scheduler's (tokens, pages, status), the
sampling seed the ModelRunner reads, and the output state the OutputProcessor keeps (detokenizer and
stop strings, prompt logprobs gathered until the first output). No engine piece keeps a side table
keyed by request id.

A request's token sequence is its prompt followed by the tokens it has generated. The KV cache holds
the first `num_computed_tokens` of them; the rest (the whole prompt at admission, one sampled token
while decoding, everything after a preemption) is what the next steps compute. An embedding
request's sequence is its prompt alone: it is computed in chunks and ends, pages freed, with its
last chunk (its pooled hidden states gathered here meanwhile).
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from maxjax.engine.detokenizer import TextStream
from maxjax.engine.types import FinishReason, SamplingParams, TokenLogprob

_arrival = itertools.count()
# The overlap scheduler's stand-in for a token sampled by a step still on the device
# (maxjax/engine/overlap.py): the last token of a request while its step is in flight.
PLACEHOLDER = -1


def new_seed(rng: np.random.Generator | None = None) -> int:
    """A fresh 64-bit seed for a request that gave none (drawn once, at admission)."""
    rng = rng or np.random.default_rng()
    return int(rng.integers(0, 2**63, dtype=np.int64))


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued, holds no pages
    RUNNING = "running"        # holds pages, prefilling or decoding
    PREEMPTED = "preempted"    # gave its pages back to let older ones go on; first in the queue
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    seed: int | None = None               # sampling seed: sampling.seed, else drawn at creation
    adapter_id: str | None = None         # LoRA adapter (a load's id, maxjax/lora/); None: base
    lora_slot: int = 0                    # the device slot of its adapter while running (0: none)
    state_slot: int = 0                   # a hybrid model's request-state slot while running
    grammar: Any = None                   # structured-output matcher; None: unconstrained
    # An embedding request (PoolingParams): prefill only, no token sampled, no prefix cache;
    # None: generation. The pooled hidden states of its chunks so far:
    pooling: Any = None
    pool_sum: np.ndarray | None = None    # f64[H] sum over its computed prompt tokens
    pool_last: np.ndarray | None = None   # f32[H] at its last computed token
    images: list = field(default_factory=list)   # its prompt's ImageSpans (engine/vision.py)
    # M-RoPE with images: the prompt's [3, n] rope positions, and the delta every later token's
    # position takes (engine/vision.py `rope_rows`); None: each token's position on all rows.
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)   # proposed next tokens, unverified
    spec_counts: tuple = (0.0, 0.0)       # decayed (kept, verified) drafts: its acceptance rate
    draft_state: Any = None               # its sequence in a draft model's KV pool (engine/draft.py)
    num_computed_tokens: int = 0          # tokens whose K/V are in this request's pages
    pages: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None              # why it failed, with finish_reason ERROR
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    admitted: bool = False                # admitted at least once (num_cached_tokens is final)

    # Prefix-cache bookkeeping, kept by the BlockManager: hashes of this sequence's full pages
    # (a pure function of the tokens, so they survive preemption) and the cache entries those pages
    # match (cleared when the request's pages are freed).
    page_hashes: list = field(default_factory=list)
    page_uids: list = field(default_factory=list)

    # Output state, kept by the OutputProcessor (maxjax/engine/output.py).
    text: TextStream | None = None        # created with the first output (None: no tokenizer)
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)   # position -> logprob

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._tokens = self.prompt_token_ids + list(self.output_token_ids)
        if self.seed is None:
            self.seed = self.sampling.seed if self.sampling.seed is not None else new_seed()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output. The list is the request's own: read it, do not mutate it."""
        return self._tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._tokens.append(token_id)

    @property
    def has_placeholder(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER

    def fill_placeholder(self, token_id: int) -> None:
        """The in-flight step's token, now read back, in place of its PLACEHOLDER."""
        assert self.has_placeholder, self
        self.output_token_ids[-1] = self._tokens[-1] = token_id

    def drop_placeholder(self) -> None:
        if self.has_placeholder:
            self.output_token_ids.pop()
            self._tokens.pop()

    @property
    def cache_token_ids(self) -> list[int]:
        """What the prefix cache keys pages by: the tokens, each image's placeholders replaced
        by its content's key, so two different images never share a page."""
        if not self.images:
            return self._tokens
        keyed = list(self._tokens)
        for im in self.images:
            keyed[im.start:im.start + im.length] = [im.key] * im.length
        return keyed

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self._tokens) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token to compute: a prompt (or a preempted sequence) not yet in the cache."""
        return len(self._tokens) - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_embedding(self) -> bool:
        return self.pooling is not None

    def add_pooled(self, start_pos: int, total: np.ndarray, last: np.ndarray) -> None:
        """Fold in one step's pooled hidden states of its tokens from `start_pos`; a chunk from
        position 0 starts over (the first chunk, or a recompute after preemption)."""
        if start_pos == 0 or self.pool_sum is None:
            self.pool_sum = np.zeros(total.shape, np.float64)
        self.pool_sum += total
        self.pool_last = np.asarray(last, np.float32)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pages={self.pages})")
