"""AsyncEngine: runs EngineCore on its own thread and streams outputs to asyncio callers.

Thread design: the engine thread alone touches EngineCore. Callers (the aiohttp server, on its
event loop) send commands (add, abort) through a thread-safe queue and receive RequestOutputs
through per-request asyncio queues fed with `loop.call_soon_threadsafe`; `generate` merges the
outputs that queued up since its last yield; `embed` awaits an embedding request's one output. The RequestOutputs are complete when they leave the
engine thread (EngineCore.step runs the output processor: text, stop strings, logprobs), so a stop
string ends its request in the step that found it, and a model step never blocks the event loop.
A request with a grammar waits for its compilation here, on the caller's side (the grammar
workers of maxjax/structured/backend.py), before it is sent to the engine thread.
A fault in a step fails only the requests it is traced to (EngineCore); should a step raise
anyway (a fault outside those guards), every unfinished request fails and the engine goes on.
--max-pending-requests M: the loop hands a request from its intake (the arrival order) to the
scheduler only while the scheduler holds fewer than M not-yet-running requests, so the backlog
waits in the intake (and counts against the server's --max-queue-size, which answers 429).
--ce-delay-ms: EngineCore waits before a step that begins a prefill batch by running this loop's
commands until the delay is over, so requests arriving meanwhile join that batch.
Should the loop thread itself die (a BaseException, a bug in the loop), `dead` holds the cause,
every request ends with an error, new ones are refused (EngineDeadError), `is_ready` turns False
and `on_death` is called: `maxjax serve` then stops and exits non-zero.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import AsyncIterator

from maxjax.engine import faults
from maxjax.engine.commands import (Abort, AddEmbedding, AddRequest, Call, Command, Intake,
                                    Wake)
from maxjax.engine.core import EngineCore
from maxjax.graphs.attention import backend_named
from maxjax.engine.output import merge_outputs
from maxjax.engine.stats import EngineStats
from maxjax.engine.types import FinishReason, RequestOutput, SamplingParams
from maxjax.errors import EngineDeadError, RequestError, UserError

log = logging.getLogger("maxjax.engine")
UNLOAD_POLL_SECONDS = 0.02


def _settle(fut: concurrent.futures.Future, fn, *args) -> None:
    """Run fn(*args) and put its outcome in `fut`, which the caller may have cancelled meanwhile
    (a client gone while its request was queued): then the outcome is dropped (the caller's
    cleanup aborts the request), and the engine loop goes on."""
    try:
        result, error = fn(*args), None
    except Exception as e:
        result, error = None, e
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def check_max_pending(n: int | None) -> None:
    """--max-pending-requests: None (unbounded) or >= 1."""
    if n is not None and n < 1:
        raise UserError(f"--max-pending-requests {n}: must be >= 1 (the engine would take no "
                        "request)")


def kernels_info(core) -> dict | None:
    """What of the step runs in maxjax's CPU kernels (None: XLA's path throughout)."""
    if not core.cfg.use_experimental_kernels:
        return None
    from maxjax.graphs import cpu_kernels
    return {"isa": cpu_kernels.isa(), "extension": cpu_kernels.extension(),
            "linear": cpu_kernels.kernels_of(core.model.params),
            "attention": backend_named(core.layout.attention).needs_cpu_kernels}


class AsyncEngine:
    def __init__(self, core: EngineCore, tokenizer, model_name: str, chat_template: str | None,
                 max_pending_requests: int | None = None, model_aliases: tuple[str, ...] = ()):
        self.core = core
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_aliases = tuple(model_aliases)   # other ids requests may name the model by
        self.chat_template = chat_template
        self.vision = core.model.vision      # an image-text model's (maxjax/models/vision.py)
        self.sampling_defaults = core.model.sampling_defaults   # --generation-config's
        self.max_length = core.max_length
        check_max_pending(max_pending_requests)
        self.max_pending_requests = max_pending_requests
        self._intake: deque[Intake] = deque()     # requests not yet handed to the scheduler
        core.sleep = self._run_commands_for
        self.is_ready = False
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats: EngineStats = core.stats()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.num_step_errors = 0          # steps that raised out of EngineCore.step
        self.dead: BaseException | None = None
        self.on_death = None              # called (on the engine thread) if the loop dies

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        faults.install(self.core)
        self._thread = threading.Thread(target=self._run, name="maxjax-engine", daemon=True)
        self._thread.start()
        self.is_ready = True

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(Wake())
        if self._thread:
            self._thread.join(timeout)
        events = getattr(self.core, "kv_events", None)
        if events is not None:
            events.close()

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            self.dead, self.is_ready = e, False
            log.critical("the engine thread died: %s: %s", type(e).__name__, e, exc_info=e)
            try:
                self._flush_intake()
                for out in self._end_all(FinishReason.ERROR, f"the engine thread died: {e}"):
                    self._deliver(out)
            finally:
                if self.on_death is not None:
                    self.on_death()

    def _loop(self) -> None:
        priming = True
        while not self._stop.is_set():
            block = not self.core.has_unfinished() and not priming and not self._intake
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
            self._pull()
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
                outputs = self.core.step()
            except Exception as e:
                self.num_step_errors += 1
                log.exception("engine step failed")
                outputs = self._end_all(FinishReason.ERROR,
                                        f"engine step failed: {type(e).__name__}: {e}")
            self._stats = self.core.stats()    # before delivery: a caller sees its pages back
            for out in outputs:
                self._deliver(out)
        self._flush_intake()
        for out in self._end_all(FinishReason.ABORT):
            self._deliver(out)

    def _run_command(self, cmd: Command) -> None:
        match cmd:
            case AddRequest() | AddEmbedding():
                self._intake.append(cmd)
            case Call(fn, args, done):
                _settle(done, fn, *args)
            case Abort(rid):
                self._abort(rid)
            case Wake():
                pass
            case _:
                raise TypeError(f"not an engine command: {cmd!r}")

    def _abort(self, rid: str) -> None:
        held = next((c for c in self._intake if c.request_id == rid), None)
        if held is not None:    # handed over to be ended the usual way (its final output)
            self._intake.remove(held)
            self._hand_over(held)
        out = self.core.abort(rid)
        self._stats = self.core.stats()
        if out is not None:
            self._deliver(out)

    def _hand_over(self, cmd: Intake) -> None:
        """A request from the intake to the scheduler."""
        match cmd:
            case AddRequest():
                _settle(cmd.done, self.core.add_request, cmd.request_id, cmd.prompt, cmd.params,
                        cmd.cache_salt, cmd.grammar, cmd.lora, cmd.images)
            case AddEmbedding():
                _settle(cmd.done, self.core.add_embedding, cmd.request_id, cmd.prompt,
                        cmd.pooling_type, cmd.lora)

    def _pull(self) -> None:
        """Hand requests over in arrival order while the scheduler holds fewer than
        --max-pending-requests not-yet-running ones (backpressure: the rest wait here)."""
        cap = self.max_pending_requests
        while self._intake and (cap is None or self.core.scheduler.num_waiting < cap):
            self._hand_over(self._intake.popleft())

    def _flush_intake(self) -> None:
        """Every request still in the intake to the scheduler, to be ended with the others."""
        while self._intake:
            self._hand_over(self._intake.popleft())

    def _run_commands_for(self, seconds: float) -> None:
        """EngineCore's wait for --ce-delay-ms: run the commands that arrive until it is over."""
        end = time.monotonic() + seconds
        while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
            try:
                cmd = self._commands.get(timeout=left)
            except queue.Empty:
                break
            self._run_command(cmd)
            self._pull()

    def _end_all(self, reason: FinishReason, error: str | None = None) -> list[RequestOutput]:
        return [self.core.abort(rid, reason, error) for rid in list(self.core.scheduler.requests)]

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            target = self._streams.get(out.request_id)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:    # the caller's event loop has closed (shutdown)
                pass

    # ---- the caller's side --------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        self._commands.put(Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def info(self) -> dict:
        core, lay = self.core, self.core.layout
        cfg = {k: v for k, v in dataclasses.asdict(core.cfg).items()
               if isinstance(v, (str, int, float, bool)) or v is None}
        return {"model": self.model_name, "max_length": lay.max_length,
                "page_size": lay.page_size, "num_pages": lay.num_pages,
                "buckets": [b.name for b in lay.buckets],
                "structured_output": core.grammars is not None, "engine_config": cfg,
                "hidden_size": core.model.config.hidden_size, "kernels": kernels_info(core)}

    def lora_adapters(self) -> dict[str, str]:
        return {} if self.core.lora is None else self.core.lora.paths()

    async def load_lora(self, name: str, path: str) -> None:
        await self._on_engine_thread(self.core.load_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        """New requests naming `name` are refused at once; this returns when the unfinished ones
        using it have ended, or raises a RequestError after --lora-unload-timeout seconds (the
        adapter still goes when they end)."""
        uid = await self._on_engine_thread(self.core.unload_lora, name)
        timeout = self.core.cfg.lora_unload_timeout
        deadline = time.monotonic() + timeout
        while (users := await self._on_engine_thread(self.core.lora_users, uid)) > 0:
            if time.monotonic() >= deadline:
                raise RequestError("lora_name", f"adapter {name!r}: {users} unfinished requests "
                                                f"still use it after {timeout:g} s "
                                                "(--lora-unload-timeout); it is no longer served "
                                                "and goes when they end")
            await asyncio.sleep(UNLOAD_POLL_SECONDS)

    async def _on_engine_thread(self, fn, *args):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(Call(fn, args, fut))
        return await asyncio.wrap_future(fut)

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        """Check the engine takes requests, and register the request's output queue."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine thread died ({type(self.dead).__name__}); the "
                                  "server is shutting down")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, q)
        return q

    async def embed(self, request_id: str, prompt_token_ids: list[int],
                    pooling_type: str | None = None, lora: str | None = None) -> list[float]:
        """The prompt's embedding (EngineCore.add_embedding); RequestError naming the field.
        Cancelled (client gone): the request is aborted, its pages freed."""
        q = self._open_stream(request_id)
        out = None
        try:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(AddEmbedding(request_id, list(prompt_token_ids), pooling_type,
                                            lora, fut))
            await asyncio.wrap_future(fut)
            out = await q.get()
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if out is None:
                self.abort(request_id)
        if out.embedding is None:
            raise RuntimeError(f"embedding request ended without a vector: {out.finish_reason} "
                               f"({out.error or 'no error'})")
        return out.embedding

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, lora: str | None = None,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        q = self._open_stream(request_id)
        finished = False
        try:
            grammar = await self._compile(params)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.put(AddRequest(request_id, list(prompt_token_ids), params, cache_salt,
                                          grammar, lora, images, fut))
            await asyncio.wrap_future(fut)
            while not finished:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                out = merge_outputs(batch)
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _compile(self, params: SamplingParams):
        """The request's grammar, compiled on the grammar workers while this caller waits (the
        engine thread goes on stepping); None without one."""
        spec = params.structured_output
        if spec is None or self.core.grammars is None:
            return None       # (without a backend, add_request names the field)
        return await self.core.grammars.compiled_async(spec)

    stream = generate   # `async for out in engine.stream(...)`: the same API under its issue name
