"""The access log: one line per request on the `maxjax.access` logger (INFO), written by
server/app.py's middleware when the response ends (a stream: after its last event; a client
that went away: status 499, with the tokens generated until then):

    127.0.0.1 "POST /v1/chat/completions" 200 model=smollm2 prompt_tokens=12
    completion_tokens=8 cached_tokens=0 ttft=0.041s duration=0.193s

(one line). The request's `model` is the body's (the served model's id when the body names
none; "-" for a route without a body); ttft is from the request's arrival to its first
generated token ("-" when none came). --disable-log-requests turns it off."""
from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("maxjax.access")


@dataclass
class Record:
    """What the log line of the request in progress says beyond its status."""
    t0: float = field(default_factory=time.perf_counter)
    model: str | None = None        # None: no body was read
    read_body: bool = False
    generations: list = field(default_factory=list)   # server/generation.py Generation
    prompt_tokens: int = 0          # a route without a Generation (embeddings)

    def counts(self) -> tuple[int, int, int]:
        prompt, completion, cached = self.prompt_tokens, 0, 0
        for g in self.generations:
            p, c, k = g.usage_counts()
            prompt, completion, cached = prompt + p, completion + c, cached + k
        return prompt, completion, cached

    def ttft(self) -> float | None:
        firsts = [g.first_token_time for g in self.generations if g.first_token_time]
        return min(firsts) - self.t0 if firsts else None


_current: ContextVar[Record | None] = ContextVar("maxjax_access_record", default=None)


def begin() -> object:
    """A record for the request the calling task serves; the token for `end`."""
    return _current.set(Record())


def end(token) -> None:
    _current.reset(token)


def current() -> Record | None:
    return _current.get()


def note_body(body: dict) -> None:
    """The request's body was read (server/state.py read_json): its model."""
    rec = _current.get()
    if rec is not None:
        rec.read_body = True
        model = body.get("model")
        rec.model = model if isinstance(model, str) else None


def note_generation(gen) -> None:
    rec = _current.get()
    if rec is not None:
        rec.generations.append(gen)


def note_prompt_tokens(n: int) -> None:
    rec = _current.get()
    if rec is not None:
        rec.prompt_tokens += n


def _field(text: str) -> str:
    """A value as one token of the line: quoted (JSON) when it holds spaces, quotes or control
    characters, so a client cannot write a line of its own."""
    text = text[:200]
    if text and text.isprintable() and not any(c in text for c in ' "\\'):
        return text
    return json.dumps(text)


def line(remote: str | None, method: str, path: str, status: int, rec: Record,
         served_model: str) -> str:
    prompt, completion, cached = rec.counts()
    model = "-" if not rec.read_body else (rec.model or served_model)
    ttft = rec.ttft()
    return (f"{remote or '-'} {_field(f'{method} {path}')} {status} model={_field(model)} "
            f"prompt_tokens={prompt} completion_tokens={completion} cached_tokens={cached} "
            f"ttft={'-' if ttft is None else f'{ttft:.3f}s'} "
            f"duration={time.perf_counter() - rec.t0:.3f}s")


def write(request, status: int, rec: Record, served_model) -> None:
    """`served_model()`: the served model's id, asked only for a body that named none (a
    server still loading has none yet, and its 503 must stay a 503)."""
    if not log.isEnabledFor(logging.INFO):
        return
    try:
        served = served_model() if rec.read_body and not rec.model else "-"
    except Exception:
        served = "-"
    log.info("%s", line(request.remote, request.method, request.path, status, rec, served))
