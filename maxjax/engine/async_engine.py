"""AsyncEngine: runs EngineCore on its own thread and streams outputs to asyncio callers.

Thread design: the engine thread alone touches EngineCore. Callers (the aiohttp server, on its
event loop) send commands (add, abort) through a thread-safe queue and receive token events
through per-request asyncio queues fed with `loop.call_soon_threadsafe`. Detokenization and stop
strings run on the caller's side (`generate`), so they never stall a model step, and a model
step never blocks the event loop. A step that raises fails only the requests in it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import AsyncIterator

from maxjax.engine.core import EngineCore, TokenEvent
from maxjax.engine.detokenizer import TextStream
from maxjax.engine.types import RequestOutput, SamplingParams
from maxjax.errors import QueueFullError

log = logging.getLogger("maxjax.engine")


class AsyncEngine:
    def __init__(self, core: EngineCore, tokenizer, model_name: str, chat_template: str | None,
                 max_pending_requests: int | None = None):
        self.core = core
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.chat_template = chat_template
        self.max_length = core.max_length
        self.max_pending_requests = max_pending_requests
        self.is_ready = False
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats: dict = core.stats()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.num_step_errors = 0
        self.detokenize_seconds = 0.0     # summed on the callers' side, where detokenizing runs

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="maxjax-engine", daemon=True)
        self._thread.start()
        self.is_ready = True

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread:
            self._thread.join(timeout)

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        priming = True
        while not self._stop.is_set():
            block = not self.core.has_unfinished() and not priming
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._run_command(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not self.core.has_unfinished():
                self._stats = self.core.stats()
                if priming:   # idle: run the next executable's first run before a request does
                    try:
                        priming = self.core.prime_next()
                    except Exception:
                        log.exception("priming step failed")
                        priming = False
                continue
            try:
                events = self.core.step()
            except Exception as e:  # a failed step ends the requests it held, not the server
                self.num_step_errors += 1
                log.exception("engine step failed")
                self._fail_running(f"engine step failed: {type(e).__name__}: {e}")
                continue
            for ev in events:
                self._deliver(ev.request_id, ev)
            self._stats = self.core.stats()

    def _run_command(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, salt, fut = cmd
            try:
                self.core.add_request(rid, prompt, params, salt)
                fut.set_result(None)
            except Exception as e:
                fut.set_exception(e)
        elif kind == "abort":
            self.core.abort(cmd[1], cmd[2])

    def _fail_running(self, message: str) -> None:
        sched = self.core.scheduler
        for rid in list(sched.requests):
            self.core.abort(rid, "error")
            self._deliver(rid, message)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    # ---- the caller's side --------------------------------------------------------------------
    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._commands.put(("abort", request_id, reason))

    def stats(self) -> dict:
        s = self._stats
        return {"num_running": s.get("running", 0), "num_waiting": s.get("waiting", 0),
                "kv_pages_used": s.get("pages_used", 0), "kv_pages_total": s.get("pages_total", 0),
                "prefix_cache_queries": s.get("prefix_query_tokens", 0),
                "prefix_cache_hits": s.get("prefix_hit_tokens", 0),
                "preemptions": s.get("preemptions", 0), "xla_compiles": s.get("xla_compiles", 0),
                "xla_compiles_since_ready": s.get("xla_compiles_since_ready", 0),
                "steps": s.get("steps", 0),
                "step_seconds": dict(s.get("step_seconds", {}), detokenize=self.detokenize_seconds)}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        if self.max_pending_requests is not None and \
                self._stats.get("waiting", 0) >= self.max_pending_requests:
            raise QueueFullError(f"{self._stats.get('waiting')} requests are pending "
                                 f"(--max-pending-requests {self.max_pending_requests})")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, q)
        text = TextStream(self.tokenizer, params, prompt_token_ids) if self.tokenizer else None
        finished = False
        try:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(("add", request_id, list(prompt_token_ids), params, cache_salt, fut))
            await asyncio.wrap_future(fut)
            while not finished:
                item = await q.get()
                batch = [item]
                while not q.empty():
                    batch.append(q.get_nowait())
                out = self._merge(request_id, batch, text, params)
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    stream = generate   # `async for out in engine.stream(...)`: the same API under its issue name

    def _merge(self, request_id: str, batch: list, text: TextStream | None,
               params: SamplingParams) -> RequestOutput:
        """Fold the events that arrived since the last yield into one output."""
        out = RequestOutput(request_id, [])
        for ev in batch:
            if isinstance(ev, str):     # the engine failed this request
                out.finished, out.finish_reason, out.error = True, "error", ev
                break
            assert isinstance(ev, TokenEvent)
            out.prompt_tokens, out.completion_tokens = ev.prompt_tokens, ev.completion_tokens
            out.cached_tokens = ev.cached_tokens
            if ev.prompt_logprobs is not None:
                out.prompt_logprobs = ev.prompt_logprobs
            out.new_token_ids.append(ev.token_id)
            if ev.logprob is not None:
                out.new_logprobs = (out.new_logprobs or []) + [ev.logprob]
            # A stop token id ends the request without appearing in its text (EOS is special
            # and skipped by the detokenizer anyway).
            stop_token = ev.finished and ev.token_id in params.stop_token_ids
            if text is not None and not stop_token:
                t = time.perf_counter()
                out.new_text += text.add([ev.token_id])
                self.detokenize_seconds += time.perf_counter() - t
            if text is not None and text.stopped:
                if not ev.finished:
                    self.abort(request_id, "stop")
                out.finished, out.finish_reason = True, "stop"
                break
            if ev.finished:
                out.finished, out.finish_reason = True, ev.finish_reason
                break
        if out.finished and text is not None and out.finish_reason != "error":
            out.new_text += text.finish()
        return out
