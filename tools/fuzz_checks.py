"""What tools/fuzz.py checks in each answer, by route: an error in the route's own envelope
(Anthropic's on /v1/messages, OpenAI's elsewhere), a 200 valid against the route's schema in the
server's /openapi.json, a stream that ends as the route's streams end (chat and completions:
`data: [DONE]`; Responses: response.completed, .incomplete or .failed; Messages: message_stop or
an error event), and never a 5xx, in the status or inside a stream."""
from __future__ import annotations

import collections
import json
import re
import threading

from reliability import Schemas

_RESPONSES_ENDS = ("response.completed", "response.incomplete", "response.failed")


def is_anthropic(route: str) -> bool:
    return route == "/v1/messages" or route.startswith("/v1/messages/")


class Findings:
    """Answers by (route, status), and failures by class: (what, route, status, message shape)."""

    def __init__(self, doc: dict):
        self.doc, self.cases = doc, 0
        self.statuses: collections.Counter = collections.Counter()
        self.failures: dict[tuple, dict] = {}
        self.lock = threading.Lock()
        self.schemas = Schemas(doc)

    def schema_of(self, route: str, stream: bool) -> str | None:
        op = self.doc["paths"].get(route, {}).get("post") or {}
        content = op.get("responses", {}).get("200", {}).get("content", {})
        entry = content.get("text/event-stream" if stream else "application/json") or {}
        ref = entry.get("x-event-schema" if stream else "schema", {}).get("$ref", "")
        return ref.rsplit("/", 1)[1] if ref else None

    def check(self, name: str, obj) -> str | None:
        return self.schemas.problem(name, obj)

    def fail(self, what: str, route: str, status, message: str, case=None) -> None:
        shape = re.sub(r"\d+", "N", message)[:90]
        with self.lock:
            f = self.failures.setdefault((what, route, str(status), shape),
                                         {"count": 0, "example": repr(case)[:600]})
            f["count"] += 1

    def answer(self, route: str, status: int, body: bytes, case, stream: bool = False) -> None:
        with self.lock:
            self.cases += 1
            self.statuses[f"{route} {status}"] += 1
        text = body.decode("utf-8", "replace")
        if status >= 500:
            self.fail("5xx", route, status, _message(text), case)
        if "Traceback" in text:
            self.fail("traceback", route, status, "a traceback in the answer", case)
        if status >= 400:
            try:
                obj = json.loads(body)
                problem = (_anthropic_error(obj) if is_anthropic(route)
                           else self.check("ErrorResponse", obj))
            except ValueError:
                problem = "not JSON"
            if problem:
                self.fail("envelope", route, status, problem, case)
        elif status == 200 and stream:
            for problem in self._stream_problems(route, text):
                self.fail("bad stream", route, status, problem, case)
        elif status == 200 and is_anthropic(route):
            try:
                problem = _anthropic_answer(route, json.loads(body))
            except ValueError:
                problem = "not JSON"
            if problem:
                self.fail("bad answer", route, status, problem, case)
        elif status == 200 and self.schema_of(route, False):
            try:
                problem = self.check(self.schema_of(route, False), json.loads(body))
            except ValueError:
                problem = "not JSON"
            if problem:
                self.fail("bad answer", route, status, problem, case)

    def _stream_problems(self, route: str, text: str):
        if route == "/v1/responses" or is_anthropic(route):
            yield from self._typed_stream_problems(route, text)
            return
        events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
        if events and events[-1] == "[DONE]":
            events.pop()
        else:
            yield "the stream does not end with [DONE]"
        for e in events:
            try:
                obj = json.loads(e)
            except ValueError:
                yield "an event is not JSON"
                continue
            problem = self.check("ErrorResponse" if "error" in obj
                                 else self.schema_of(route, True), obj)
            if problem:
                yield problem
            if "error" in obj and str(obj["error"].get("type")) == "server_error":
                yield f"5xx in the stream: {_message(e)}"

    def _typed_stream_problems(self, route: str, text: str):
        """`event: TYPE` / `data: {...}` pairs, each data's type its event's."""
        events = []
        for block in filter(None, text.split("\n\n")):
            head, _, data = block.partition("\ndata: ")
            try:
                obj = json.loads(data)
            except ValueError:
                yield "an event is not JSON"
                continue
            if not head.startswith("event: ") or obj.get("type") != head[7:]:
                yield f"event {head[:40]!r} carries type {str(obj.get('type'))[:40]!r}"
            events.append(obj)
        last = events[-1]["type"] if events else None
        if route == "/v1/responses":
            schema = self.schema_of(route, True)
            for obj in events:
                problem = schema and self.check(schema, obj)
                if problem:
                    yield problem
            if last not in _RESPONSES_ENDS:
                yield f"the stream ends with {last!r}, not one of {_RESPONSES_ENDS}"
            elif last == "response.failed" and \
                    (events[-1]["response"].get("error") or {}).get("code") == "server_error":
                yield f"5xx in the stream: {events[-1]['response']['error'].get('message')}"
        else:
            if last not in ("message_stop", "error"):
                yield f"the stream ends with {last!r}, not message_stop or error"
            for obj in events:
                if obj["type"] == "error" and (_anthropic_error(obj) or obj["error"]["type"]
                                               in ("api_error", "overloaded_error")):
                    yield f"5xx in the stream: {_anthropic_error(obj) or obj['error']}"

    def report(self) -> dict:
        return {"cases": self.cases, "statuses": dict(sorted(self.statuses.items())),
                "failures": [{"class": list(k), **v} for k, v in sorted(self.failures.items())]}


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:120]


def _anthropic_error(obj) -> str | None:
    """What is wrong with an Anthropic error envelope: {"type": "error", "error": {"type": str,
    "message": str}}."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if not (isinstance(obj, dict) and obj.get("type") == "error" and isinstance(err, dict)
            and isinstance(err.get("type"), str) and isinstance(err.get("message"), str)):
        return f"not Anthropic's error envelope: {str(obj)[:120]}"
    return None


def _anthropic_answer(route: str, obj) -> str | None:
    if route.endswith("/count_tokens"):
        ok = isinstance(obj, dict) and type(obj.get("input_tokens")) is int
    else:
        ok = (isinstance(obj, dict) and obj.get("type") == "message"
              and isinstance(obj.get("content"), list) and isinstance(obj.get("usage"), dict)
              and all(isinstance(b, dict) and isinstance(b.get("type"), str)
                      for b in obj["content"]))
    return None if ok else f"not an Anthropic {route.rsplit('/', 1)[1]} answer: {str(obj)[:120]}"
