"""MockEngine: an EngineClient (server/engine_client.py) whose outputs can be worked out by hand,
for the server tests. No model: every request "generates" the bytes of OUTPUT_TEXT, starting at
offset `seed % len(OUTPUT_TEXT)` (0 without a seed), one token per byte, one token per output,
with `delay` seconds between tokens (or, with `script`, exactly that text, finishing "stop"). The tokenizer is byte-level: token id = byte value, plus
three special tokens (BOS/EOS/IM_START..). Logprobs: token t has logprob -(t % 10) / 10 and its
top list is [(t, lp), (t+1, lp-1), (t+2, lp-2), ...]. KV pages: PAGE_SIZE tokens per page, held
from the first output to the last (or to abort), so tests can assert they return to zero.
Embeddings (`embed`): `mock_embedding`, EMBED_DIM floats from the token ids, after `delay`
seconds per prompt token, pages held meanwhile.
Requests go through the engine's validator (maxjax/engine/validate.py), so the server tests see
the engine's 400s."""
from __future__ import annotations

import asyncio
import math

import numpy as np

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from maxjax.engine.stats import EngineStats, KVCacheStats, SchedulerStats
from maxjax.engine.types import (FinishReason, PoolingParams, RequestOutput, SamplingParams,
                                 TokenLogprob)
from maxjax.engine.validate import EngineLimits, check_embedding_input, check_request
from maxjax.errors import RequestError
from maxjax.server.engine_client import QueueFullError

OUTPUT_TEXT = "The quick brown fox jumps over the lazy dog. "
PAGE_SIZE = 4
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 256, 257, 258
EOS_ID = 256
EMBED_DIM = 8        # the mock's "hidden size": width of its embeddings


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: token id == byte value for ids < 256."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's alphabet maps byte b to a printable char; order the vocab by byte value.
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:])
    fast.add_special_tokens({"eos_token": SPECIAL[0]})
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def token_logprob(t: int) -> float:
    return -(t % 10) / 10


def expected_text(max_tokens: int, seed: int | None = None,
                  stop: list[str] = ()) -> tuple[str, str]:
    """(text, finish_reason) the mock produces: what the tests compare against."""
    start = (seed or 0) % len(OUTPUT_TEXT)
    full = (OUTPUT_TEXT * (max_tokens // len(OUTPUT_TEXT) + 2))[start:start + max_tokens]
    cut = min((full.find(s) for s in stop if s and full.find(s) >= 0), default=-1)
    return (full[:cut], "stop") if cut >= 0 else (full, "length")


def mock_embedding(token_ids: list[int], pooling_type: str = "last") -> list[float]:
    """The mock's embedding: token t's "hidden state" is cos(t * (j + 1)) over j < EMBED_DIM;
    pooled (the last one, or the mean) and L2-normalized."""
    h = np.cos(np.outer(np.asarray(token_ids, np.float64), np.arange(1, EMBED_DIM + 1)))
    v = h.mean(0) if pooling_type == "mean" else h[-1]
    return (v / np.linalg.norm(v)).astype(np.float32).tolist()


class MockEngine:
    def __init__(self, model_name: str = "mock-model", max_length: int = 512, delay: float = 0.0,
                 chat_template: str | None = CHAT_TEMPLATE, max_queue: int | None = None,
                 script: str | None = None):
        self.model_name = model_name
        self.tokenizer = byte_tokenizer()
        self.chat_template = chat_template
        self.max_length = max_length
        self.is_ready = True
        self.delay = delay
        self.max_queue = max_queue
        self.fail_on: str | None = None     # prompt substring that makes the engine fail
        self.script = script                # ASCII text every request generates instead
        self.cached_tokens = 0              # what each request reports read from the prefix cache
        self.pages: dict[str, int] = {}
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.requests: list[tuple[str, list[int], SamplingParams, str | None]] = []
        self.compiles = 3

    # -- EngineClient ---------------------------------------------------------------------------
    def lora_adapters(self):
        return {}

    async def load_lora(self, name, path):
        raise RequestError("lora_name", "LoRA is off on this server (--enable-lora)")

    async def unload_lora(self, name):
        raise RequestError("lora_name", "LoRA is off on this server (--enable-lora)")

    def generate(self, request_id, prompt_token_ids, params, cache_salt=None, lora=None):
        check_request(prompt_token_ids, params,
                      EngineLimits(len(self.tokenizer), self.max_length, (EOS_ID,)))
        if self.max_queue is not None and len(self.running) >= self.max_queue:
            raise QueueFullError(f"engine queue full ({self.max_queue})")
        self.requests.append((request_id, list(prompt_token_ids), params, cache_salt))
        self.running.add(request_id)
        return self._run(request_id, list(prompt_token_ids), params)

    async def embed(self, request_id, prompt_token_ids, pooling_type=None, lora=None):
        pooling = PoolingParams(pooling_type or "last")
        check_embedding_input(prompt_token_ids, pooling,
                              EngineLimits(len(self.tokenizer), self.max_length, (EOS_ID,)))
        if self.max_queue is not None and len(self.running) >= self.max_queue:
            raise QueueFullError(f"engine queue full ({self.max_queue})")
        self.requests.append((request_id, list(prompt_token_ids), pooling, None))
        self.running.add(request_id)
        self.pages[request_id] = math.ceil(len(prompt_token_ids) / PAGE_SIZE)
        try:
            await asyncio.sleep(self.delay * len(prompt_token_ids))
            if self.fail_on and self.fail_on in self.tokenizer.decode(prompt_token_ids):
                raise RuntimeError("mock engine failure")
            self.finished.append(request_id)
            return mock_embedding(prompt_token_ids, pooling.pooling_type)
        finally:
            if request_id not in self.finished:
                self.aborted.append(request_id)
            self.running.discard(request_id)
            self.pages.pop(request_id, None)

    def abort(self, request_id):
        if request_id in self.running:
            self.running.discard(request_id)
            self.pages.pop(request_id, None)
            self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            scheduler=SchedulerStats(running=len(self.running)),
            kv=KVCacheStats(pages_used=self.pages_used, pages_total=1000,
                            prefix_query_tokens=10 * len(self.requests),
                            prefix_hit_tokens=5 * len(self.requests)),
            xla_compiles=self.compiles, steps=7,
            step_seconds={"schedule": 0.25, "device_step": 1.5})

    def info(self):
        return {"model": self.model_name, "max_length": self.max_length, "page_size": PAGE_SIZE,
                "num_pages": 1000, "buckets": ["step_t1_r1", "step_t8_r4"],
                "structured_output": False, "engine_config": {"max_batch_size": 4},
                "hidden_size": EMBED_DIM}

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def pages_used(self) -> int:
        return sum(self.pages.values())

    async def _run(self, rid: str, prompt: list[int], p: SamplingParams):
        try:
            text, reason = expected_text(p.max_new_tokens, p.seed, p.stop)
            prompt_text = self.tokenizer.decode(prompt)
            if self.fail_on and self.fail_on in prompt_text:
                raise RuntimeError("mock engine failure")
            start = (p.seed or 0) % len(OUTPUT_TEXT)
            full = (OUTPUT_TEXT * (p.max_new_tokens // len(OUTPUT_TEXT) + 2))[start:]
            # A stop string is excluded from the text but its tokens were generated.
            ntok = p.max_new_tokens if reason == "length" else min(
                p.max_new_tokens, len(text) + max(len(s) for s in p.stop if full.find(s) ==
                                                  len(text)))
            if self.script is not None:       # a scripted output, then EOS
                text = full = self.script[:p.max_new_tokens]
                reason, ntok = ("stop" if len(self.script) <= p.max_new_tokens else "length",
                                len(text))
            ids = list(full[:ntok].encode())
            plps = None
            if p.prompt_logprobs:
                plps = [None] + [TokenLogprob(t, token_logprob(t), self._top(t, p.top_logprobs))
                                 for t in prompt[1:]]
            for i, t in enumerate(ids):
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await asyncio.sleep(0)
                if rid not in self.running:     # aborted: its last output, as the engine's
                    yield RequestOutput(request_id=rid, new_token_ids=[], new_text="",
                                        finished=True, finish_reason=FinishReason.ABORT,
                                        prompt_tokens=len(prompt), completion_tokens=i,
                                        cached_tokens=0)
                    return
                self.pages[rid] = math.ceil((len(prompt) + i + 1) / PAGE_SIZE)
                last = i == len(ids) - 1
                new_text = text[i] if i < len(text) else ""
                if last:   # done before the last output is handed over, as in a real engine
                    self.finished.append(rid)
                    self.running.discard(rid)
                    self.pages.pop(rid, None)
                yield RequestOutput(
                    request_id=rid, new_token_ids=[t], new_text=new_text,
                    new_logprobs=[TokenLogprob(t, token_logprob(t), self._top(t, p.top_logprobs))]
                    if p.logprobs else None,
                    finished=last, finish_reason=FinishReason(reason) if last else None,
                    prompt_tokens=len(prompt), completion_tokens=i + 1,
                    cached_tokens=min(self.cached_tokens, len(prompt) - 1),
                    prompt_logprobs=plps if i == 0 else None)
        finally:
            # Closing the iteration early (client gone) is an abort.
            if rid in self.running and rid not in self.finished:
                self.abort(rid)
            self.running.discard(rid)
            self.pages.pop(rid, None)

    @staticmethod
    def _top(t: int, k: int) -> list[tuple[int, float]]:
        return [((t + j) % 256, token_logprob(t) - j) for j in range(k)]
