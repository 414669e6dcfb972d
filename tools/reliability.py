"""What tools/fuzz.py and tools/soak.py share: a `maxjax serve` subprocess, a mix of valid
requests run by N concurrent streams with every answer checked against the server's own
/openapi.json and the request's parameters, and the leak check on /metrics afterwards."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import jsonschema

WORDS = ("the cat sat on a mat while seven quiet rivers ran past old stone bridges under a pale "
         "sky full of birds and distant thunder").split()
# The engine of tests/test_engine_smollm2.py: its graphs are in the shared compilation cache.
SMOLLM2_FLAGS = ["--max-length", "512", "--max-batch-size", "8", "--max-batch-input-tokens",
                 "32", "--kv-cache-page-size", "16", "--num-kv-pages", "48"]


class ServeProcess:
    """`maxjax serve --port 0 FLAGS` until the block ends (then SIGTERM; `returncode`)."""

    def __init__(self, flags: list[str], env: dict | None = None, ready_timeout: float = 600):
        self.flags, self.env, self.ready_timeout = flags, env, ready_timeout
        self.stderr: list[str] = []
        self.returncode = None

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maxjax.cli", "serve", "--port", "0", *self.flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(self.env or {})})
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr),
                         daemon=True).start()
        line = self.proc.stdout.readline()
        if not line.startswith("Server ready on http://"):
            self.proc.kill()
            raise RuntimeError("maxjax serve did not start: " + "".join(self.stderr)[-3000:])
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.url, self.pid = line.split()[-1], self.proc.pid
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()


def get(url: str, headers=None, timeout: float = 30) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                timeout=timeout) as r:
        return r.read()


def metrics(url: str, headers=None) -> dict:
    """/metrics as {name: value} (unlabelled samples only)."""
    out = {}
    for line in get(url + "/metrics", headers).decode().splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_idle(url: str, headers=None, timeout: float = 60) -> dict:
    """Wait until the engine holds no request (abort commands are asynchronous)."""
    end = time.monotonic() + timeout
    while True:
        m = metrics(url, headers)
        if (m.get("maxjax_num_requests_running", 0) + m.get("maxjax_num_requests_waiting", 0)
                + m.get("maxjax_server_requests_waiting", 0) == 0) or time.monotonic() > end:
            return m
        time.sleep(0.2)


def leak_report(url: str, before: dict, headers=None) -> dict:
    """What the server holds once idle, against `before`: engine requests, KV pages beyond the
    prefix cache's, asyncio tasks and file descriptors (a few may be in flight)."""
    time.sleep(1.0)          # connections the clients just closed finish closing
    m = wait_idle(url, headers)
    pages = m.get("maxjax_kv_cache_pages_used", 0)
    tasks, fds = "maxjax_server_asyncio_tasks", "process_open_fds"
    rep = {"kv_pages_used": pages, "kv_pages_cached": m.get("maxjax_kv_cache_pages_cached", 0),
           "running": m.get("maxjax_num_requests_running", 0),
           "waiting": m.get("maxjax_num_requests_waiting", 0),
           "tasks": [before.get(tasks), m.get(tasks)], "open_fds": [before.get(fds), m.get(fds)],
           "compiles_since_ready": m.get("maxjax_xla_compiles_since_ready", 0)}
    # kv_pages_used counts pages requests hold; the prefix cache's free pages are not in it.
    problems = []
    if pages or rep["running"] or rep["waiting"]:
        problems.append(f"engine holds {pages:.0f} KV pages / {rep['running']:.0f} requests")
    if m.get(tasks, 0) > before.get(tasks, 0) + 4:
        problems.append(f"asyncio tasks {rep['tasks'][0]:.0f} -> {rep['tasks'][1]:.0f}")
    if m.get(fds, 0) > before.get(fds, 0) + 8:
        problems.append(f"open fds {rep['open_fds'][0]:.0f} -> {rep['open_fds'][1]:.0f}")
    if rep["compiles_since_ready"]:
        problems.append(f"{rep['compiles_since_ready']:.0f} compilations while serving")
    rep["problems"] = problems
    return rep


# ---- valid traffic --------------------------------------------------------------------------------

def random_request(rng: random.Random, long_words: int = 300) -> tuple[str, dict, dict]:
    """(route, body, expectations) of a random valid request of the soak's mix."""
    chat = rng.random() < 0.6
    words = rng.choice([4, 12, 40, long_words])
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    body: dict = {"max_tokens": rng.choice([1, 8, 16, 32]), "stream": rng.random() < 0.5}
    body["n"] = 1 if rng.random() < 0.8 else rng.choice([2, 3])
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    elif rng.random() < 0.5:
        body.update(temperature=rng.choice([0.7, 1.0]), top_p=0.9, top_k=40)
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS), "\n\n"]
    if rng.random() < 0.3:
        if chat:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 2]))
        else:
            body["logprobs"] = rng.choice([0, 2])
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body, {}
    body["prompt"] = text
    return "/v1/completions", body, {}


def check_answer(route: str, body: dict, obj: dict, texts: dict) -> str | None:
    """Semantic checks beyond the schema: every choice present, finish reasons, the token budget,
    stop strings absent, logprobs per token."""
    n = body.get("n", 1)
    if sorted(texts) != list(range(n)):
        return f"choices {sorted(texts)} for n={n}"
    for i, (text, finish, ntok, nlp) in texts.items():
        if finish not in ("stop", "length"):
            return f"choice {i}: finish_reason {finish!r}"
        if ntok is not None and ntok > body["max_tokens"]:
            return f"choice {i}: {ntok} tokens > max_tokens {body['max_tokens']}"
        for s in body.get("stop") or []:
            if s in text:
                return f"choice {i}: stop string {s!r} in the text"
        if "logprobs" in body and body.get("logprobs") not in (None, False) and nlp == 0 \
                and text:
            return f"choice {i}: no logprobs"
    use = obj.get("usage")
    if use and use["completion_tokens"] > n * body["max_tokens"]:
        return f"usage.completion_tokens {use['completion_tokens']} over n * max_tokens"
    return None


class Schemas:
    """Validators for the components of a server's /openapi.json."""

    def __init__(self, doc: dict):
        comps = doc["components"]["schemas"]
        self._v = {name: jsonschema.Draft202012Validator({**s, "components": {"schemas": comps}})
                   for name, s in comps.items()}

    def problem(self, name: str, obj) -> str | None:
        try:
            self._v[name].validate(obj)
        except jsonschema.ValidationError as e:
            return f"not a valid {name}: {e.message[:160]}"
        return None


RESPONSE = {"/v1/chat/completions": ("ChatCompletion", "ChatCompletionChunk"),
            "/v1/completions": ("Completion", "Completion")}


async def one_request(session, url: str, route: str, body: dict, schemas: Schemas,
                      abort_after: int | None = None) -> tuple[str | None, float | None, bool]:
    """(problem, TTFT seconds, aborted) of one valid request; the answer checked."""
    t0 = time.perf_counter()
    chat = route.endswith("chat/completions")
    async with session.post(url + route, json=body) as r:
        if r.status != 200:
            return f"HTTP {r.status}: {(await r.text())[:200]}", None, False
        if not body["stream"]:
            obj = await r.json()
            ttft = time.perf_counter() - t0
            problem = schemas.problem(RESPONSE[route][0], obj)
            if problem:
                return problem, ttft, False
            texts = {}
            for c in obj["choices"]:
                text = c["message"]["content"] or "" if chat else c["text"]
                lp = c.get("logprobs")
                nlp = len((lp or {}).get("content" if chat else "tokens") or [])
                texts[c["index"]] = (text, c["finish_reason"], nlp if lp else None, nlp)
            return check_answer(route, body, obj, texts), ttft, False
        ttft, events, texts, final = None, 0, {}, {}
        async for line in r.content:
            # Let the loop run between events: reading buffered lines does not, and checking a
            # long stream's events back to back on a starved CPU can hold the loop for seconds,
            # while another worker's new connection sits unwritten until the server's idle
            # timeout cuts it (see _run).
            await asyncio.sleep(0)
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                return f"error event: {obj['error'].get('message')}", ttft, False
            problem = schemas.problem(RESPONSE[route][1], obj)
            if problem:
                return problem, ttft, False
            events += 1
            if abort_after is not None and events >= abort_after:
                return None, ttft, True             # the client goes away mid-stream
            for c in obj["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                t, _, ntok, nlp = texts.get(c["index"], ("", None, 0, 0))
                lp = c.get("logprobs") or {}
                k = len(lp.get("content" if chat else "tokens") or [])
                texts[c["index"]] = (t + piece, c["finish_reason"], None, nlp + k)
                if c["finish_reason"]:
                    final[c["index"]] = c["finish_reason"]
            if obj.get("usage"):
                final["usage"] = obj["usage"]
        else:
            return "the stream ended without [DONE]", ttft, False
        texts = {i: (t, final.get(i), None, nlp) for i, (t, _, _, nlp) in texts.items()}
        return check_answer(route, body, {"usage": final.get("usage")}, texts), ttft, False


class ValidTraffic:
    """`streams` concurrent clients sending random valid requests (random_request) on a thread
    of their own until the block ends (or `duration` seconds pass); a share `abort_rate` of
    streamed ones are abandoned mid-stream. `samples`: (t, route, e2e s, TTFT s)."""

    def __init__(self, url: str, streams: int, seed: int = 0, headers=None,
                 duration: float | None = None, abort_rate: float = 0.1, long_words: int = 300):
        self.url, self.streams, self.seed, self.headers = url, streams, seed, headers
        self.duration, self.abort_rate, self.long_words = duration, abort_rate, long_words
        self.errors: list[str] = []
        self.samples: list[tuple] = []
        self.done = self.aborted = 0
        self._stop = threading.Event()

    def __enter__(self):
        self.schemas = Schemas(json.loads(get(self.url + "/openapi.json", self.headers)))
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(300)

    def wait(self) -> None:
        self._thread.join()

    async def _run(self) -> None:
        import aiohttp
        timeout = aiohttp.ClientTimeout(total=300)
        # A fresh connection per request (force_close), not a keep-alive pool: the server closes
        # a connection idle for --http-idle-timeout (2 s in tests/test_reliability.py), as it
        # should, and a client whose event loop lags (CPU-starved beside the fuzz) takes such a
        # connection from its pool before it has seen the server's FIN; the request then fails
        # before any byte of it went out ("Can not write request body", "Server
        # disconnected"), a known HTTP/1.1 keep-alive race that is no fault of the server.
        # With a new connection each time, written as soon as it is open (one_request lets the
        # loop run between events), a valid request that fails is a server failure.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(headers=self.headers, timeout=timeout,
                                         connector=connector) as s:
            await asyncio.gather(*[self._worker(s, i) for i in range(self.streams)])

    async def _worker(self, session, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not self._stop.is_set() and (self.duration is None or
                                           time.monotonic() - self.t0 < self.duration):
            route, body, _ = random_request(rng, self.long_words)
            abort = rng.randint(1, 4) if body["stream"] and rng.random() < self.abort_rate \
                else None
            t0 = time.perf_counter()
            try:
                problem, ttft, aborted = await one_request(session, self.url, route, body,
                                                           self.schemas, abort)
            except Exception as e:
                problem, ttft, aborted = f"{type(e).__name__}: {e}", None, False
            if problem:
                self.errors.append(f"{route} {json.dumps(body)[:300]}: {problem}")
            elif aborted:
                self.aborted += 1
            else:
                self.done += 1
                self.samples.append((time.monotonic() - self.t0, route,
                                     time.perf_counter() - t0, ttft))

    def report(self) -> dict:
        return {"requests": self.done, "aborted_by_client": self.aborted,
                "errors": len(self.errors), "error_examples": self.errors[:5]}
