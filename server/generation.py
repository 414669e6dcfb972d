"""Runs the engine requests of one HTTP request (n choices per prompt) and merges their output
streams into one, for server/app.py. Owns admission (the server-side queue cap), the mapping of
engine failures to HTTP errors (a RequestError becomes a 400 naming the request's field), the
latency metrics, and cleanup: a generation that is closed before its choices finish (client gone,
handler cancelled, shutdown) aborts them in the engine."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from maxjax.engine.types import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from maxjax.errors import EngineDeadError, RequestError

from . import access_log
from .engine_client import EngineClient, QueueFullError
from .metrics import ServerMetrics
from .protocol import APIError

log = logging.getLogger(__name__)


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_index: int
    prompt_len: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: FinishReason | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False       # first event (output or error) seen
    last_time: float = 0.0


class AdmissionState:
    """Server-wide count of engine requests that have not produced their first output."""

    def __init__(self, max_queue_size: int | None, metrics: ServerMetrics):
        self.max_queue_size = max_queue_size
        self.waiting = 0
        self.metrics = metrics
        # started, not closed: Generations, and embedding requests (server/embeddings_api.py)
        self.live: set = set()

    def abort_all(self) -> int:
        """Abort every unfinished choice of every live request (a drain's deadline): each ends
        with finish_reason abort, so its handler answers and the server can stop. How many."""
        return sum(g.abort_unfinished() for g in list(self.live))

    def add(self, k: int) -> None:
        if self.max_queue_size is not None and self.waiting + k > self.max_queue_size:
            raise APIError(429, f"the server queue is full ({self.waiting} requests waiting, "
                                f"--max-queue-size {self.max_queue_size}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.waiting += k
        self.metrics.server_waiting.set(self.waiting)

    def done(self, k: int = 1) -> None:
        self.waiting -= k
        self.metrics.server_waiting.set(self.waiting)


class Generation:
    """All choices of one HTTP request. Use as `async with`: start() submits them and waits for
    each one's first event, so submission errors become a clean HTTP error before any byte of
    the response is sent; events() then yields (choice, output) in arrival order."""

    def __init__(self, engine: EngineClient, admission: AdmissionState, metrics: ServerMetrics,
                 base_id: str, prompts: list[list[int]], n: int, params: list[SamplingParams],
                 cache_salt: str | None, t_arrival: float, error_names: dict[str, str],
                 lora: str | None = None, images: list | None = None):
        self.engine, self.admission, self.metrics = engine, admission, metrics
        self.lora = lora
        # the prompt's images (maxjax/models/vision.py ImageInput); passed only when some
        self.extra = {"images": images} if images else {}
        self.error_names = error_names
        self.params, self.cache_salt, self.t_arrival = params, cache_salt, t_arrival
        self.prompts = prompts
        self.choices = [Choice(p * n + j, f"{base_id}-{p * n + j}", p, len(prompts[p]))
                        for p in range(len(prompts)) for j in range(n)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.pending: list[tuple] = []
        self.unfinished = len(self.choices)
        self._admitted = 0
        self.first_token_time: float | None = None
        access_log.note_generation(self)

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def start(self) -> None:
        self.admission.add(len(self.choices))
        self._admitted = len(self.choices)
        self.admission.live.add(self)
        # __aexit__ does not run when __aenter__ fails, so a failure or a cancellation (client
        # gone) while waiting for the first outputs must clean up here.
        try:
            for c in self.choices:
                self.tasks.append(asyncio.create_task(self._pump(c)))
            unstarted = len(self.choices)
            while unstarted:
                item = await self.queue.get()
                c, out, exc = item
                if exc is not None:
                    raise _api_error(exc, self.error_names)
                self.pending.append(item)
                if not c.started:
                    c.started = True
                    unstarted -= 1
        except BaseException:
            await asyncio.shield(self.close())
            raise

    async def _pump(self, c: Choice) -> None:
        gen = None
        try:
            gen = self.engine.generate(c.request_id, self.prompts[c.prompt_index],
                                       self.params[c.index], self.cache_salt, self.lora,
                                       **self.extra)
            async for out in gen:
                self.queue.put_nowait((c, out, None))
                if out.finished:
                    return
            self.queue.put_nowait((c, None, RuntimeError("engine stream ended without a "
                                                         "finished output")))
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # surfaced to the handler as an HTTP error
            self.queue.put_nowait((c, None, e))
        finally:
            if gen is not None and hasattr(gen, "aclose"):
                try:
                    await gen.aclose()
                except BaseException:
                    pass

    async def events(self):
        """Yield (choice, RequestOutput) until every choice has finished. Raises APIError for an
        engine failure."""
        while self.unfinished:
            if self.pending:
                c, out, exc = self.pending.pop(0)
            else:
                c, out, exc = await self.queue.get()
            if exc is not None:
                raise _api_error(exc, self.error_names)
            self._account(c, out)
            if out.finished:
                self.unfinished -= 1
                if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT,
                                         FinishReason.GRAMMAR_ERROR):
                    raise _engine_failure(out, self.params[c.index])
            yield c, out

    def _account(self, c: Choice, out: RequestOutput) -> None:
        now = time.perf_counter()
        if self._admitted and not c.last_time:
            self.admission.done()
            self._admitted -= 1
        ntok = len(out.new_token_ids)
        if ntok:
            self.metrics.generation_tokens.inc(ntok)   # as they come: the dashboard's tokens/s
            if not c.last_time:
                self.metrics.ttft.observe(now - self.t_arrival)
                self.first_token_time = self.first_token_time or now
            else:
                self.metrics.itl.observe((now - c.last_time) / ntok)
            c.last_time = now
        elif not c.last_time:
            c.last_time = now
        c.token_ids.extend(out.new_token_ids)
        if out.new_text:
            c.text.append(out.new_text)
        if out.new_logprobs:
            c.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        c.completion_tokens = max(out.completion_tokens, len(c.token_ids))
        c.cached_tokens = max(c.cached_tokens, out.cached_tokens)
        if out.finished:
            c.finish_reason = out.finish_reason or FinishReason.STOP      # the engine's own
            self.metrics.e2e.observe(now - self.t_arrival)

    def abort_unfinished(self) -> int:
        """Abort every choice that has not finished in the engine; how many."""
        unfinished = [c for c in self.choices if c.finish_reason is None]
        for c in unfinished:
            try:
                self.engine.abort(c.request_id)
            except Exception:
                log.exception("engine.abort(%s) failed", c.request_id)
        return len(unfinished)

    async def close(self) -> None:
        """Cancel the pumps and abort every choice that has not finished; idempotent."""
        self.admission.live.discard(self)
        for t in self.tasks:
            t.cancel()
        self.abort_unfinished()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self.tasks = []
        if self._admitted:
            self.admission.done(self._admitted)
            self._admitted = 0

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached tokens); a prompt counts once however many
        choices share it."""
        firsts = {}
        for c in self.choices:
            firsts.setdefault(c.prompt_index, c)
        prompt = sum(c.prompt_len for c in firsts.values())
        cached = sum(c.cached_tokens for c in firsts.values())
        return prompt, sum(c.completion_tokens for c in self.choices), cached


def _api_error(exc: BaseException, error_names: dict[str, str]) -> APIError:
    """An engine exception as an HTTP error; a RequestError's field as its request name."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc) or "the engine queue is full; retry later",
                        code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, RequestError):
        param = error_names.get(exc.param, exc.param)
        return APIError(400, f"{param}: {exc.reason}", param=param)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc) or "invalid request")
    log.error("engine failure", exc_info=exc)
    return APIError(500, f"the engine failed on this request ({type(exc).__name__})")


def aborted() -> APIError:
    """What a request the engine aborted (a drain's deadline) is answered with."""
    return APIError(503, "the request was aborted by the engine (shutting down?)")


def _engine_failure(out: RequestOutput, params: SamplingParams) -> APIError:
    if out.finish_reason == FinishReason.GRAMMAR_ERROR:   # the request's grammar, not the server
        spec = params.structured_output
        param = spec.param if spec is not None else None
        return APIError(400, f"{param}: {out.error or 'the grammar allows no next token'}",
                        param=param)
    if out.finish_reason == FinishReason.ABORT:
        return aborted()
    log.error("engine error on %s: %s", out.request_id, out.error)
    return APIError(500, f"the engine failed on this request: {out.error or 'unknown error'}")
