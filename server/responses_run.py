"""One Responses API response while its chat turn runs: the turn's events fed into its output
items (with each text's logprobs, when included), the response object at any moment, and its
end (completed, incomplete, failed or cancelled; stored unless `store: false`). Whole, streamed
and background responses all run through `ResponseRun.events()`, so they are one rendering.
`BackgroundRuns` owns the background responses that are still running: each is an asyncio task
of its own, not the request's, so it survives the client's disconnect; cancelling it aborts its
engine requests (their KV pages go back). Used by server/responses_api.py."""
from __future__ import annotations

import asyncio
import logging

from maxjax.engine.types import FinishReason

from .chat_events import Finish, Text
from .chat_render import logprob_entries
from .chat_run import ChatTurn
from .protocol import APIError
from .response_store import ResponseStore
from .responses_request import OutputItems, ResponsesRequest, response_object, response_usage
from .responses_tools import function_tools
from .state import ServerState

log = logging.getLogger(__name__)


class ResponseRun:
    def __init__(self, st: ServerState, req: ResponsesRequest, rid: str, turn: ChatTurn,
                 model: str, store: ResponseStore, conversation: list[dict]):
        self.st, self.req, self.rid, self.turn, self.model = st, req, rid, turn, model
        self.store, self.conversation = store, conversation
        self.out = OutputItems(function_tools(req.tools)[1])   # namespaced calls split back
        self.finish = Finish(FinishReason.STOP, FinishReason.STOP)
        self.status = "queued" if req.background else "in_progress"
        self.final: dict | None = None          # the response once it has ended

    def response(self, status: str | None = None, usage: dict | None = None) -> dict:
        """The response object as it stands (its final form once it has ended)."""
        if self.final is not None and status is None:
            return self.final
        resp = response_object(self.req, self.rid, self.turn.created, self.model,
                               status or self.status, self.out.items, usage)
        for key in ("user", "usage"):
            if resp.get(key) is None:
                resp.pop(key)
        return resp

    async def events(self):
        """Run the turn to its end, feeding the output items; yield the stream events they
        add (without sequence numbers). Raises APIError. A token's logprob goes with the
        message text it wrote: the tokens of an output that wrote nothing (held back) wait for
        the next text, unless an output writes reasoning or a tool call first, or the text
        starts after a reasoning item (then they were that item's, its end tag)."""
        top_n = self.req.top_logprobs or 0
        pending: list[dict] = []
        async for ev in self.turn.events():
            texts = [p for p in ev.parts if isinstance(p, Text) and p.text]
            if texts and self.out.open is not None and self.out.open["type"] != "message":
                pending = []
            if ev.logprobs:
                pending += logprob_entries(self.st.token_str, ev.logprobs, top_n)
            for p in ev.parts:
                lps = None
                if texts and p is texts[0]:
                    lps, pending = pending, []
                for e in self.out.feed(p, lps):
                    yield e
            if ev.parts and not texts:
                pending = []
            self.finish = ev.finish or self.finish
        for e in self.out.finish(truncated=self.finish.reason == FinishReason.LENGTH):
            yield e

    def _usage(self) -> dict | None:
        return response_usage(*self.turn.usage_counts()) if self.turn.gen is not None else None

    def _end(self, resp: dict) -> dict:
        self.final, self.status = resp, resp["status"]
        if self.req.store is not False:
            self.store.put(resp, self.conversation)
        return resp

    def done(self) -> dict:
        """The finished response (completed, or incomplete when max_output_tokens cut it)."""
        status = "incomplete" if self.finish.reason == FinishReason.LENGTH else "completed"
        return self._end(self.response(status, self._usage()))

    def failed(self, e: APIError) -> dict:
        resp = self.response("failed")
        code = "server_error" if e.status >= 500 else (
            "rate_limit_exceeded" if e.status == 429 else "invalid_prompt")
        resp["error"] = {"code": code, "message": e.message}
        return self._end(resp) if self.req.background else resp

    def cancelled(self) -> dict:
        return self._end(self.response("cancelled", self._usage()))


class BackgroundRuns:
    """The background responses still running, by id; at most `store.max_count` at once (each
    is stored when it ends)."""

    def __init__(self):
        self.live: dict[str, tuple[ResponseRun, asyncio.Task]] = {}

    def start(self, run: ResponseRun) -> dict:
        """Start `run` in its own task; the response as it is now (queued)."""
        if len(self.live) >= run.store.max_count:
            raise APIError(429, f"background: {len(self.live)} background responses are "
                                "running, as many as the server stores; retry later",
                           param="background", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.live[run.rid] = (run, asyncio.create_task(self._run(run)))
        return run.response()

    async def _run(self, run: ResponseRun) -> None:
        try:
            async with run.turn:
                run.status = "in_progress"
                async for _ in run.events():
                    pass
            run.done()
        except asyncio.CancelledError:      # cancel(), DELETE or the server's shutdown
            run.cancelled()
        except APIError as e:
            run.failed(e)
        except Exception as e:
            log.exception("background response %s failed", run.rid)
            run.failed(APIError(500, f"the server failed on this response "
                                     f"({type(e).__name__})"))
        finally:
            self.live.pop(run.rid, None)

    async def cancel(self, rid: str) -> dict | None:
        """Cancel a running background response: its engine requests are aborted (their pages
        freed) before this returns. The cancelled response; None when `rid` is not running."""
        hit = self.live.get(rid)
        if hit is None:
            return None
        run, task = hit
        task.cancel()
        await asyncio.wait([task])        # never cancels the task from this caller's side
        return run.response()

    async def cancel_all(self, app=None) -> None:
        """The server is stopping: what still runs is cancelled."""
        await asyncio.gather(*(self.cancel(rid) for rid in list(self.live)))
