"""Fuzz a running `maxjax serve` (or one this tool starts) as an attacker would, while valid
requests run beside it:

  python tools/fuzz.py [--url URL | -- SERVE FLAGS...] [--cases 1200] [--seed 0] [--json OUT]

1. Schema-driven cases from the server's own GET /openapi.json, with hypothesis: for every POST
   route, bodies whose fields are drawn from their schema or replaced by hostile values (wrong
   types, huge or negative numbers, lone surrogates, NUL bytes, deep nesting, long strings).
   Then as many route-shaped cases (tools/fuzz_shapes.py): chat, Responses, Messages and
   embeddings bodies of the shape clients send (items, content blocks, image parts, tools and
   their schemas, tool calls, structured output), broken at their leaves.
2. Raw HTTP cases: truncated, oversized and chunked bodies, wrong content types, invalid UTF-8,
   deep nesting (on each generation route), half-sent headers and bodies (slow clients),
   abandoned clients, disconnects mid-stream, and thousands of concurrent connections.
3. Valid traffic beside it all (streamed and not, chat and completions), each answer checked.

Pass: no 5xx, no hang, every error in the route's envelope (tools/fuzz_checks.py: Anthropic's on
/v1/messages, OpenAI's elsewhere), every 200 valid against the route's response schema, every
valid request served, and nothing leaked afterwards (engine requests, KV pages beyond what the
prefix cache holds, asyncio tasks, file descriptors). Prints a report (cases, answers by status,
failures by class) and exits 1 when the pass fails."""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import socket
import sys
import time
import warnings
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hypothesis.errors import HypothesisWarning  # noqa: E402
from hypothesis import HealthCheck, given, seed as seed_of, settings, strategies as st  # noqa: E402

from fuzz_checks import Findings, _message  # noqa: E402
from fuzz_shapes import shaped_cases  # noqa: E402
from reliability import (SMOLLM2_FLAGS, ServeProcess, ValidTraffic, get,  # noqa: E402
                         leak_report, metrics, wait_idle)

from maxjax.server.config import ServeConfig  # noqa: E402

HANG_S = 60.0
HOSTILE = [None, True, -1, 0, 2**31, 2**64, -2**63 - 1, 1e308, -1e308, 0.5, "", "\x00",
           "\ud800", "\udfff\ud800", "A" * 100_000, "😀" * 2000, [], [[[[[[[[[[[]]]]]]]]]]],
           {}, {"": None}, [0] * 5000, list(range(-3, 3)), {"type": "json_schema"},
           "{{ ''.__class__.__mro__ }}", "../../etc/passwd", "<|im_end|>"]
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                        | st.text(max_size=20),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                           c, max_size=4),
                        max_leaves=12)


# ---- values from a JSON schema ----------------------------------------------------------------

def values(schema: dict, comps: dict, depth: int = 0) -> st.SearchStrategy:
    """Instances of `schema` (an OpenAPI 3.1 / JSON Schema subset: what pydantic writes)."""
    if depth > 6:
        return st.none()
    if "$ref" in schema:
        return values(comps[schema["$ref"].rsplit("/", 1)[1]], comps, depth)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([values(s, comps, depth) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([values({**schema, "type": k}, comps, depth) for k in kind])
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 24))
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        lo = schema["exclusiveMinimum"] + 1 if "exclusiveMinimum" in schema else lo
        hi = schema["exclusiveMaximum"] - 1 if "exclusiveMaximum" in schema else hi
        near = st.integers(lo if lo is not None else -8, hi if hi is not None else 64)
        return st.one_of(near, st.integers(lo, hi)) if hi is None or lo is None else near
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                         schema.get("maximum", schema.get("exclusiveMaximum")),
                         exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(values(schema.get("items", {}), comps, depth + 1),
                        min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        if not props:
            extra = schema.get("additionalProperties", {})
            return st.dictionaries(st.text(max_size=10), values(
                extra if isinstance(extra, dict) else {}, comps, depth + 1), max_size=4)
        required = [k for k in props if k in set(schema.get("required", ()))]
        optional = [k for k in props if k not in required]
        # A few optional fields at a time: with all of them, nearly every body would break
        # some rule at the first check and nothing would reach the engine.
        return st.lists(st.sampled_from(optional), max_size=min(4, len(optional)),
                        unique=True).flatmap(lambda names: st.fixed_dictionaries(
                            {k: values(props[k], comps, depth + 1) for k in required + names}))
    return ANY_JSON


def bodies(schema: dict, comps: dict) -> st.SearchStrategy:
    """A body from the schema, then 0-3 of its fields replaced by hostile or any JSON values
    (and sometimes one unknown field), so most cases pass the first checks and reach deeper."""
    props = list(comps[schema["$ref"].rsplit("/", 1)[1]].get("properties", {}))

    def mutate(draw_args):
        body, swaps, extra = draw_args
        body = dict(body)
        for name, value in swaps:
            body[name] = value
        if extra:
            body["no_such_field"] = 1
        return body
    hostile = st.integers(0, len(HOSTILE) - 1).map(lambda i: HOSTILE[i])   # (a short repr)
    swap = st.tuples(st.sampled_from(props), st.one_of(hostile, ANY_JSON))
    swaps = st.one_of(st.just([]), st.lists(swap, min_size=1, max_size=3))   # half intact
    return st.tuples(values(schema, comps), swaps,
                     st.integers(0, 9).map(lambda i: i == 7)).map(mutate)   # not 0: its minimum


# ---- 1. schema-driven cases ---------------------------------------------------------------------

def post(url: str, route: str, raw: bytes, headers=None, timeout=HANG_S):
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", route, raw, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def generate_cases(doc: dict, cases: int, seed: int) -> list[tuple[str, dict]]:
    """(route, body) pairs drawn with hypothesis from each POST route's request schema, the
    generation routes weighted 4 to 1."""
    warnings.simplefilter("ignore", HypothesisWarning)    # large strategy reprs
    comps = doc["components"]["schemas"]
    routes = [(path, op["requestBody"]["content"]["application/json"]["schema"])
              for path, ops in doc["paths"].items() for m, op in ops.items()
              if m == "post" and "requestBody" in op and "lora" not in path]
    weights = {"/v1/chat/completions": 4, "/v1/completions": 4}
    total = sum(weights.get(p, 1) for p, _ in routes)
    out: list[tuple[str, dict]] = []
    for path, schema in routes:
        n = max(1, cases * weights.get(path, 1) // total)

        @seed_of(seed)
        @settings(max_examples=n, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=["generate"])
        @given(bodies(schema, comps))
        def draw(body):
            out.append((path, shorten(path, body)))
        draw()
    return out


def shorten(path: str, body: dict) -> dict:
    """Few tokens and choices: the fuzz checks answers, it is not a soak (tools/soak.py is)."""
    for name, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 4)):
        if type(body.get(name)) is int and body[name] > cap:
            body[name] = 1 + body[name] % cap
    if path.endswith("completions") and "max_completion_tokens" not in body:
        body.setdefault("max_tokens", 4)     # not the default: up to max_length
    return body


def send_case(url: str, path: str, body: dict, findings: Findings, headers=None) -> None:
    raw = json.dumps(body).encode()
    t0 = time.monotonic()
    try:
        status, answer = post(url, path, raw, headers)
    except (TimeoutError, socket.timeout):
        findings.fail("hang", path, "-", f"no answer in {HANG_S:.0f} s", body)
        return
    except (ConnectionError, http.client.HTTPException) as e:
        findings.fail("connection", path, "-", f"{type(e).__name__}", body)
        return
    if time.monotonic() - t0 > HANG_S / 2:
        findings.fail("slow", path, status, f"answered after > {HANG_S / 2:.0f} s", body)
    stream = body.get("stream") is True and not path.endswith(("/input_tokens", "/count_tokens"))
    findings.answer(path, status, answer, body, stream)


def schema_cases(url: str, doc: dict, findings: Findings, cases: int, seed: int,
                 headers=None, workers: int = 8, shaped: int = 0) -> None:
    """The generated cases and `shaped` route-shaped ones, `workers` at a time (so hostile
    requests share engine steps with each other and with the valid traffic)."""
    from concurrent.futures import ThreadPoolExecutor
    model = json.loads(get(url + "/v1/models", headers))["data"][0]["id"]
    todo = generate_cases(doc, cases, seed) + shaped_cases(shaped, seed, model)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda c: send_case(url, c[0], c[1], findings, headers), todo))


# ---- 2. raw HTTP cases ---------------------------------------------------------------------------

async def _exchange(host, port, data: bytes, *, close_after: bool = True, wait: float = HANG_S,
                    hold: float = 0.0) -> bytes:
    """Send `data` (then hold the connection `hold` seconds without sending more), read what
    comes back until the server closes or `wait` passes."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        if hold:
            await asyncio.sleep(hold)
        if not close_after:
            return b""
        out = b""
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), end - time.monotonic())
            except asyncio.TimeoutError:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        writer.close()


def _status(raw: bytes) -> tuple[int | None, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    return (int(m.group(1)) if m else None), body


def _request(path: str, body: bytes, ctype="application/json", length: int | None = None,
             extra: bytes = b"") -> bytes:
    n = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {n}\r\nConnection: close\r\n").encode() + extra + b"\r\n" + body


PROTOCOL_ERRORS = ("huge header", "many headers", "bad request line")
RAW_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/messages/count_tokens", "/v1/embeddings", "/v1/tokenize")
CHAT = json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}).encode()


async def raw_cases(url: str, findings: Findings, limits: dict, headers=None) -> None:
    """Each case's failures are findings; a case that cannot even connect (the server died) is
    one too, and the rest still run."""
    for case in (_raw_bodies, _slow_clients, _abandoned, _mid_stream_disconnects,
                 _many_connections):
        try:
            await case(url, findings, limits, headers)
        except OSError as e:
            findings.fail("connection", "-", "-", f"{case.__name__}: {type(e).__name__}: {e}")


async def _raw_bodies(url: str, findings: Findings, limits: dict, headers=None) -> None:
    u = urlsplit(url)
    host, port = u.hostname, u.port
    auth = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    body_limit = limits["max_request_body_bytes"]

    async def expect(name, data, ok=(400, 413, 415), route="/v1/chat/completions", **kw):
        t0 = time.monotonic()
        raw = await _exchange(host, port, data, **kw)
        status, body = _status(raw)
        if status is None:
            findings.fail("raw", route, "-", f"{name}: no HTTP answer "
                                             f"({time.monotonic() - t0:.0f} s)", data[:200])
            return
        if name in PROTOCOL_ERRORS:     # not HTTP the app could parse: aiohttp's plain answer
            with findings.lock:
                findings.cases += 1
                findings.statuses[f"(protocol) {status}"] += 1
        else:
            findings.answer(route, status, body, name)
        if status not in ok:
            findings.fail("raw", route, status, f"{name}: expected one of {ok}", data[:200])

    def body_cases(route):      # each route's own body reading, its errors in its envelope
        return [
            ("invalid JSON", _request(route, b'{"messages": [', extra=auth), (400,)),
            ("invalid UTF-8", _request(route, b'{"messages": [{"role": "user", "content": "'
                                              b'\xff\xfe"}]}', extra=auth), (400,)),
            ("a JSON array", _request(route, b"[1, 2]", extra=auth), (400,)),
            ("oversized body", _request(route, b" " * (body_limit + 1), extra=auth), (413,)),
            ("deep nesting", _request(route, b"[" * 100_000 + b"]" * 100_000, extra=auth),
             (400, 413)),
            ("deep objects", _request(route, b'{"input": ' + b'{"a": ' * 500 + b"1"
                                      + b"}" * 501, extra=auth), (400,)),
            ("NaN", _request(route, b'{"input": NaN, "messages": NaN}', extra=auth), (400,)),
            ("a lone surrogate", _request(route, b'{"input": "\\ud800", "messages": [{"role": '
                                                 b'"user", "content": "\\ud800"}]}', extra=auth),
             (400,))]

    route = "/v1/chat/completions"
    cases = [
        ("wrong content type", _request(route, CHAT, "text/plain", extra=auth), (200, 415)),
        ("form content type", _request(route, b"a=1&b=2", "application/x-www-form-urlencoded",
                                       extra=auth), (400, 415)),
        ("oversized Content-Length", _request(route, b"{}", length=body_limit * 4, extra=auth),
         (413,)),
        ("gzip body claims", _request(route, b"not gzip", extra=auth + b"Content-Encoding: gzip"
                                      b"\r\n"), (400, 415)),
        ("huge header", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000
         + b"\r\n\r\n", (400, 431)),
        ("many headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
            b"X-%d: 1\r\n" % i for i in range(1000)) + b"\r\n", (400, 431)),
        ("bad request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", (400,)),
    ]
    for name, data, ok in cases:
        await expect(name, data, ok)
    for other in RAW_ROUTES:
        for name, data, ok in body_cases(other):
            await expect(name, data, ok, other)
    chunked = (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\nConnection: close\r\n").encode() + auth + b"\r\n"
    big = b"".join(b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
                   for _ in range(body_limit // (1 << 16) + 2)) + b"0\r\n\r\n"
    await expect("oversized chunked body", chunked + big, (413,))


async def _slow_clients(url: str, findings: Findings, limits: dict, headers=None) -> None:
    """Half-sent headers and half-sent bodies must be cut, not held forever."""
    u = urlsplit(url)
    host, port, idle = u.hostname, u.port, limits["http_idle_timeout"]
    auth = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    route = "/v1/chat/completions"
    for name, data in [("half-sent headers", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"),
                       ("half-sent body", _request(route, CHAT[:10], length=len(CHAT),
                                                   extra=auth))]:
        t0 = time.monotonic()
        raw = await _exchange(host, port, data, wait=idle * 3 + 10)
        took = time.monotonic() - t0
        if took > idle * 3 + 5:
            findings.fail("slow client", route, "-", f"{name}: connection held over "
                                                     f"{idle * 3:.0f} s", name)
        status, body = _status(raw)
        if status is not None:
            findings.answer(route, status, body, name)
        findings.cases += status is None


async def _abandoned(url: str, findings: Findings, limits: dict, headers=None) -> None:
    """Requests sent and the connection closed before the answer."""
    u = urlsplit(url)
    auth = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    route = "/v1/chat/completions"
    for stream in (False, True):
        body = json.dumps({"messages": [{"role": "user", "content": "Tell me a story"}],
                           "max_tokens": 64, "stream": stream}).encode()
        await asyncio.gather(*[_exchange(u.hostname, u.port, _request(route, body, extra=auth),
                                         close_after=False, hold=0.05 * i) for i in range(8)])
        findings.cases += 8


async def _mid_stream_disconnects(url: str, findings: Findings, limits: dict,
                                  headers=None) -> None:
    import aiohttp
    body = {"prompt": "Once upon a time", "max_tokens": 64, "stream": True, "n": 2}

    async def one(i):
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                for _ in range(1 + i % 4):
                    await r.content.readline()
            # leaving the block closes the connection mid-stream
    await asyncio.gather(*[one(i) for i in range(16)], return_exceptions=True)
    findings.cases += 16


async def _many_connections(url: str, findings: Findings, limits: dict, headers=None) -> None:
    """`max_connections` idle connections at once, then a health check: the server answers
    and keeps serving."""
    u = urlsplit(url)
    host, port, count = u.hostname, u.port, limits["max_connections"]
    opened = []
    try:
        for _ in range(count):
            try:
                opened.append(await asyncio.wait_for(asyncio.open_connection(host, port), 5))
            except (OSError, asyncio.TimeoutError):
                break
        raw = await _exchange(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                          b"Connection: close\r\n\r\n", wait=30)
        status, _ = _status(raw)
        if status not in (200, 503):
            findings.fail("connections", "/health", status, f"/health with {len(opened)} "
                                                            "other connections open", count)
        findings.cases += 1
    finally:
        for _, w in opened:
            w.close()


# ---- the run -------------------------------------------------------------------------------------

def run_fuzz(url: str, cases: int = 1200, seed: int = 0, headers: dict | None = None,
             streams: int = 4, limits: dict | None = None, shaped: int | None = None) -> dict:
    """Fuzz the server at `url`; the report, with "passed". `shaped`: route-shaped cases beside
    the `cases` schema-driven ones (default: as many). `limits`: the server's
    max_request_body_bytes, http_idle_timeout (default: ServeConfig's) and how many
    connections to open at once (max_connections)."""
    doc = json.loads(get(url + "/openapi.json", headers))
    defaults = ServeConfig()
    limits = {"max_request_body_bytes": defaults.max_request_body_bytes,
              "http_idle_timeout": defaults.http_idle_timeout,
              "max_connections": 2000, **(limits or {})}
    before = metrics(url, headers)
    findings = Findings(doc)
    t0 = time.monotonic()
    with ValidTraffic(url, streams, seed, headers) as traffic:
        schema_cases(url, doc, findings, cases, seed, headers,
                     shaped=cases if shaped is None else shaped)
        asyncio.run(raw_cases(url, findings, limits, headers))
    wait_idle(url, headers)
    report = findings.report()
    report.update(seconds=round(time.monotonic() - t0, 1), valid=traffic.report(),
                  leaks=leak_report(url, before, headers))
    report["passed"] = (not report["failures"] and not traffic.errors
                        and not report["leaks"]["problems"])
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start `maxjax serve SERVE FLAGS`)")
    p.add_argument("--cases", type=int, default=1200, help="schema-driven cases over all routes")
    p.add_argument("--shaped", type=int, help="route-shaped cases (default: --cases)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streams", type=int, default=4, help="valid streams running beside")
    p.add_argument("--api-key", default=os.environ.get("MAXJAX_API_KEY"))
    p.add_argument("--json", help="write the report here")
    p.add_argument("--connections", type=int, default=2000,
                   help="connections held open at once in the connection-flood case")
    p.add_argument("--body-limit", type=int, help="the server's --max-request-body-bytes")
    p.add_argument("--idle-timeout", type=float, help="the server's --http-idle-timeout")
    p.add_argument("serve", nargs=argparse.REMAINDER, help="-- then flags for maxjax serve")
    a = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
    flags = [f for f in a.serve if f != "--"]
    limits = {"max_connections": a.connections}
    if a.body_limit:
        limits["max_request_body_bytes"] = a.body_limit
    if a.idle_timeout:
        limits["http_idle_timeout"] = a.idle_timeout
    if a.url:
        report = run_fuzz(a.url, a.cases, a.seed, headers, a.streams, limits, a.shaped)
    else:
        with ServeProcess(flags or SMOLLM2_FLAGS) as server:
            report = run_fuzz(server.url, a.cases, a.seed, headers, a.streams, limits, a.shaped)
    text = json.dumps(report, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(text)
    print("PASS" if report["passed"] else "FAIL")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
