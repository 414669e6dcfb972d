"""The OpenAI Responses API: POST /v1/responses (whole, streamed as typed SSE events, or in the
background), GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel. A request is
translated into a ChatCompletionRequest (server/responses_request.py) and runs as any chat turn
(server/chat_run.py); its typed parts become output items and events (server/
responses_run.py). Stored responses (`store`, `previous_response_id`) live in a bounded
in-memory ResponseStore (server/response_store.py). Registered by server/app.py through
add_routes()."""
from __future__ import annotations

import itertools
import json
import time
from typing import Any, Literal

from aiohttp import web
from pydantic import ValidationError
from typing_extensions import NotRequired, TypedDict

from .chat_run import ChatTurn
from .openai_routes import SSE, _accept
from .openapi import describe
from .protocol import APIError, validation_error
from .response_store import ResponseStore
from .responses_request import ResponsesRequest, _id, input_items, listed_item, renamed, to_chat
from .responses_run import BackgroundRuns, ResponseRun
from .responses_tools import dropped_tools
from .tools import dropped_tools_header

RESPONSES = web.AppKey("maxjax_responses", ResponseStore)
BACKGROUND = web.AppKey("maxjax_background_responses", BackgroundRuns)


class ResponseObject(TypedDict):
    """The spec's `Response` (its required fields, and the ones this server fills)."""
    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    text: dict[str, Any]
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    usage: NotRequired[dict[str, Any]]


class ResponseStreamEvent(TypedDict):
    """One `event: TYPE` / `data: {...}` of a streamed response (the spec's
    ResponseStreamEvent family)."""
    type: str
    sequence_number: int


class InputItemList(TypedDict):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class InputTokens(TypedDict):
    object: Literal["response.input_tokens"]
    input_tokens: int


class ResponseDeleted(TypedDict):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


def add_routes(app: web.Application, store: ResponseStore | None = None) -> None:
    app[RESPONSES] = store if store is not None else ResponseStore()
    app[BACKGROUND] = BackgroundRuns()
    app.on_shutdown.append(lambda app: app[BACKGROUND].cancel_all())
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/responses/input_tokens", count_input_tokens)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)


def _stored(request: web.Request, rid: str, param: str) -> tuple[dict, list[dict]]:
    """(response, conversation items) of a stored or still running (background) response;
    a running one cannot be continued yet."""
    live = request.app[BACKGROUND].live.get(rid)
    if live is not None:
        run = live[0]
        if param == "previous_response_id":
            raise APIError(400, f"{param}: response {rid!r} is still {run.status} (background); "
                                "continue it once it has finished", param=param)
        return run.response(), run.conversation
    hit = request.app[RESPONSES].get(rid)
    if hit is None:
        raise APIError(404, f"{param}: no stored response {rid!r} (never stored, store: false, "
                            "deleted, or evicted)", param=param, code="not_found")
    return hit


async def _fitted_turn(st, req: ResponsesRequest, prior: list[dict], rid: str, t0: float,
                       lora: str | None) -> ChatTurn:
    """The request's chat turn. With truncation "auto", a conversation whose prompt leaves no
    room for max_output_tokens (or one token) loses its oldest items, the fewest that make it
    fit (found by bisection: each try renders and tokenizes the prompt); the instructions and
    the last item stay. What cannot fit even then is the usual 400."""
    images = getattr(st.engine, "vision", None) is not None

    async def turn(drop: int) -> ChatTurn:
        try:
            chat = to_chat(req, prior, images, drop)
        except ValidationError as e:
            raise validation_error(e) from None
        # no max_output_tokens (Codex sends none), or too many: what the prompt leaves
        t = await ChatTurn.prepare(st, chat, rid, t0, lora, clamp=True)
        t.headers.update(dropped_tools_header(dropped_tools(req.tools)))
        return t

    def fits(t: ChatTurn) -> bool:
        return len(t.prompt) + (req.max_output_tokens or 1) <= st.engine.max_length

    whole = await turn(0)
    if req.truncation != "auto" or fits(whole):
        return whole
    last = len(prior) + len(input_items(req)) - 1      # the most that can go
    lo, hi, best = 1, last, None
    while lo <= hi:
        mid = (lo + hi) // 2
        t = await turn(mid)
        if fits(t):
            best, hi = t, mid - 1
        else:
            lo = mid + 1
    return best or await turn(last)


@describe(request=ResponsesRequest, response=ResponseObject, stream=ResponseStreamEvent)
async def create_response(request: web.Request) -> web.StreamResponse:
    """OpenAI Responses API (streamed as typed SSE events with stream: true)."""
    t0 = time.perf_counter()
    st, req, lora = await _accept(request, ResponsesRequest)
    store = request.app[RESPONSES]
    prior: list[dict] = []
    if req.previous_response_id is not None:
        prev, prev_items = _stored(request, req.previous_response_id, "previous_response_id")
        prior = prev_items + prev["output"]
    conversation = prior + input_items(req)
    rid = _id("resp")
    try:
        turn = await _fitted_turn(st, req, prior, rid, t0, lora)
    except APIError as e:
        raise renamed(e) from None
    run = ResponseRun(st, req, rid, turn, lora or st.model_id, store, conversation)
    if req.background:
        return web.json_response(request.app[BACKGROUND].start(run), headers=turn.headers)
    try:
        await turn.__aenter__()
    except APIError as e:
        raise renamed(e) from None
    try:
        if not req.stream:
            async for _ in run.events():
                pass
            return web.json_response(run.done(), headers=turn.headers)
        return await _stream(request, run)
    finally:
        await turn.__aexit__(None, None, None)


async def _stream(request: web.Request, run: ResponseRun) -> web.StreamResponse:
    sse = await SSE(request, run.turn.headers).start()
    seq = itertools.count()

    async def emit(ev: dict, last: bool = False) -> None:
        ev["sequence_number"] = next(seq)
        body = (b"event: " + ev["type"].encode() + b"\ndata: " +
                json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
        await (sse.finish(body) if last else sse.write(body))

    await emit({"type": "response.created", "response": run.response()})
    await emit({"type": "response.in_progress", "response": run.response()})
    try:
        async for e in run.events():
            await emit(e)
    except APIError as e:
        await emit({"type": "error", "code": e.code, "message": e.message, "param": e.param})
        await emit({"type": "response.failed", "response": run.failed(e)}, last=True)
        return sse.resp
    resp = run.done()
    await emit({"type": f"response.{resp['status']}", "response": resp}, last=True)
    return sse.resp


@describe(response=ResponseObject)
async def get_response(request: web.Request) -> web.Response:
    """A stored response, or a background one as it stands (404 when unknown, not stored or
    evicted)."""
    rid = request.match_info["response_id"]
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise APIError(400, "stream: a response is retrieved whole here (poll a background "
                            "one until its status is no longer queued or in_progress)",
                       param="stream")
    return web.json_response(_stored(request, rid, "response_id")[0])


@describe(response=ResponseObject)
async def cancel_response(request: web.Request) -> web.Response:
    """Cancel a background response that is still running: its generation is aborted and it
    ends `cancelled` (cancelling it again answers the same); a response that did not run in the
    background cannot be cancelled (400), nor one that has already ended."""
    rid = request.match_info["response_id"]
    cancelled = await request.app[BACKGROUND].cancel(rid)
    if cancelled is not None:
        return web.json_response(cancelled)
    resp = _stored(request, rid, "response_id")[0]
    if not resp["background"]:
        raise APIError(400, "response_id: Cannot cancel a synchronous response.",
                       param="response_id")
    if resp["status"] != "cancelled":
        raise APIError(400, f"response_id: the response has already ended ({resp['status']})",
                       param="response_id")
    return web.json_response(resp)


@describe(response=InputItemList)
async def list_input_items(request: web.Request) -> web.Response:
    """The conversation a stored response answered (the items of its previous_response_id
    chain, then its input), as the spec lists them: `order` desc (the default) or asc, `limit`
    1-100 (20), `after` / `before` an item's id."""
    rid = request.match_info["response_id"]
    items = [listed_item(it, f"{rid.removeprefix('resp_')}_{i}") for i, it in
             enumerate(_stored(request, rid, "response_id")[1])]
    q = request.query
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: {order!r}: must be asc or desc", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit: {q.get('limit')!r}: must be an integer from 1 to 100",
                       param="limit")
    if order == "desc":
        items.reverse()
    ids = [it["id"] for it in items]
    for name, cut in (("after", lambda i: items[i + 1:]), ("before", lambda i: items[:i])):
        if name in q:
            if q[name] not in ids:
                raise APIError(404, f"{name}: no item {q[name]!r} in response {rid!r}",
                               param=name, code="not_found")
            items = cut(ids.index(q[name]))
            ids = [it["id"] for it in items]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": len(items) > limit})


@describe(request=ResponsesRequest, response=InputTokens)
async def count_input_tokens(request: web.Request) -> web.Response:
    """How many tokens a Responses request's input is (its instructions, tools and
    previous_response_id chain included), as POST /v1/responses would prompt the model."""
    st, req, lora = await _accept(request, ResponsesRequest)
    prior: list[dict] = []
    if req.previous_response_id is not None:
        prev, prev_items = _stored(request, req.previous_response_id, "previous_response_id")
        prior = prev_items + prev["output"]
    try:
        turn = await _fitted_turn(st, req, prior, _id("resp"), time.perf_counter(), lora)
    except APIError as e:
        raise renamed(e) from None
    return web.json_response({"object": "response.input_tokens",
                              "input_tokens": len(turn.prompt)})


@describe(response=ResponseDeleted)
async def delete_response(request: web.Request) -> web.Response:
    """Forget a stored response (a running background one is cancelled first)."""
    rid = request.match_info["response_id"]
    await request.app[BACKGROUND].cancel(rid)
    if not request.app[RESPONSES].delete(rid):
        _stored(request, rid, "response_id")
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})
