"""The HTTP side of `maxjax benchmark` (maxjax/bench/command.py calls it): building prompts of a given
token length through the server's tokenizer, and sending one streaming OpenAI request while
timing every content chunk.

Works against any OpenAI-compatible server. Tokenizer endpoints tried in order: vLLM/maxjax
(`POST /tokenize {"prompt"}` -> `{"tokens"}`, `POST /detokenize {"tokens"}` -> `{"prompt"}`),
then llama-cpp-python (`POST /extras/tokenize {"input"}` -> `{"tokens"}`, `/extras/detokenize`
-> `{"text"}`); without either, a prompt of N words stands in for N tokens and the server's own
count (usage.prompt_tokens) is what gets reported.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

# Common one-token English words: without a tokenizer, N of them approximate N tokens.
WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this "
         "from or had by hot word but what some we can out other were all there when up use your "
         "how said an each she which do their time if will way about many then them write would "
         "like so these her long make thing see him two has look more day could go come did number "
         "sound no most people my over know water than call first who may down side been now find "
         "any new work part take get place made live where after back little only round man year "
         "came show every good me give our under name very through just form sentence great think "
         "say help low line differ turn cause much mean before move right boy old too same tell "
         "does set three want air well also play small end put home read hand port large spell add "
         "even land here must big high such follow act why ask men change went light kind off need "
         "house picture try us again animal point mother world near build self earth father head "
         "stand own page should country found answer school grow study still learn plant cover "
         "food sun four between state keep eye never last let thought city tree cross farm hard "
         "start might story saw far sea draw left late run while press close night real life few "
         "north").split()


@dataclass
class RequestResult:
    """One request as the client saw it: times are seconds from perf_counter."""
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0            # the server's usage count, else the client's estimate
    output_tokens: int = 0            # usage.completion_tokens, else the number of content chunks
    usage_reported: bool = False
    requested_tokens: int = 0         # max_tokens
    ttft: float = 0.0                 # send -> first content chunk
    latency: float = 0.0              # send -> end of stream
    itl: list[float] = field(default_factory=list)   # gaps between content chunks

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a one-token answer)."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Prompt:
    text: str | None = None
    messages: list | None = None
    tokens: int | None = None         # the client's count, when a tokenizer was available
    output_len: int = 16


def api_root(base_url: str) -> str:
    """`http://host:port`, `http://host:port/` and `http://host:port/v1` name one server."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


# For the small calls before a run (model list, tokenizer): a hung server fails fast.
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=60)


async def _post_json(session: aiohttp.ClientSession, url: str, body: dict) -> dict | None:
    try:
        async with session.post(url, json=body, timeout=PROBE_TIMEOUT) as r:
            if r.status != 200:
                return None
            return await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


# (name, tokenize path, detokenize path, request text field, detokenize response text field)
_FLAVOURS = [("vllm", "/tokenize", "/detokenize", "prompt", "prompt"),
             ("llama-cpp-python", "/extras/tokenize", "/extras/detokenize", "input", "text"),
             ("llama-cpp-python", "/tokenize", "/detokenize", "input", "text")]   # before 0.2.60


class RemoteTokenizer:
    """The server's tokenizer over HTTP (see the module docstring), or None from `probe`."""

    def __init__(self, session, root: str, flavour: tuple):
        self.session, self.root = session, root
        self.flavour, self._tok_path, self._detok_path, self._in, self._out = flavour
        self._prefix: list[int] = []

    @classmethod
    async def probe(cls, session: aiohttp.ClientSession, root: str) -> "RemoteTokenizer | None":
        for flavour in _FLAVOURS:
            tok = cls(session, root, flavour)
            prefix = await tok.encode("")
            if prefix is not None and await tok.encode("hello world"):
                # llama-cpp-python always adds BOS: strip whatever an empty text encodes to.
                tok._prefix = prefix
                return tok
        return None

    async def encode(self, text: str) -> list[int] | None:
        # No model field: a wrong --model must show up as request errors, not as a missing
        # tokenizer. add_special_tokens is vLLM's (maxjax's) flag; llama-cpp-python ignores it.
        body = {self._in: text}
        if self.flavour == "vllm":
            body["add_special_tokens"] = False
        out = await _post_json(self.session, self.root + self._tok_path, body)
        toks = out.get("tokens") if isinstance(out, dict) else None
        if not isinstance(toks, list):
            return None
        n = len(self._prefix)
        return toks[n:] if n and toks[:n] == self._prefix else toks

    async def decode(self, tokens: list[int]) -> str | None:
        out = await _post_json(self.session, self.root + self._detok_path, {"tokens": tokens})
        text = out.get(self._out) if isinstance(out, dict) else None
        return text if isinstance(text, str) else None


async def synthetic_prompt(tok: RemoteTokenizer | None, rng: random.Random, input_len: int,
                           output_len: int) -> Prompt:
    """Random words (distinct per prompt, so a prefix cache cannot skip the work) cut to exactly
    `input_len` tokens when a tokenizer is available."""
    words = [rng.choice(WORDS) for _ in range(max(input_len * 3, 8))]
    text = " ".join(words[:input_len])
    if tok is None:
        return Prompt(text=text, output_len=output_len)
    full = await tok.encode(" ".join(words))
    if full is None or len(full) < 2 * input_len:
        return Prompt(text=text, output_len=output_len)
    ids = full[:input_len]
    # Decoding a cut BPE sequence and encoding it again can merge differently at the cut: trim
    # until the text encodes to exactly input_len tokens (one step almost always suffices).
    for _ in range(4):
        text = await tok.decode(ids)
        if text is None:
            break
        again = await tok.encode(text)
        if again is None:
            break
        if len(again) == input_len:
            return Prompt(text=text, tokens=input_len, output_len=output_len)
        # Too long: cut again. Too short: refill from the tokens that followed the cut.
        ids = (again[:input_len] if len(again) > input_len
               else again + full[input_len:2 * input_len - len(again)])
    return Prompt(text=text, tokens=None, output_len=output_len)


def request_body(endpoint: str, model: str, prompt: Prompt, ignore_eos: bool,
                 temperature: float) -> dict:
    body = {"model": model, "max_tokens": prompt.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        # ignore_eos: maxjax, vLLM, llama.cpp's llama-server; min_tokens: maxjax, vLLM and
        # llama-cpp-python (which has no ignore_eos). Servers ignore the field they lack.
        body.update(ignore_eos=True, min_tokens=prompt.output_len)
    if endpoint == "chat":
        body["messages"] = prompt.messages or [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


def _chunk_text(endpoint: str, chunk: dict) -> str:
    out = []
    for choice in chunk.get("choices") or []:
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            out.append(delta.get("content") or delta.get("reasoning_content") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    msg = msg or body.decode("utf-8", "replace").strip()[:200] or "no body"
    return f"HTTP {status}: {msg}"


async def send_request(session: aiohttp.ClientSession, url: str, endpoint: str, body: dict,
                       prompt: Prompt) -> RequestResult:
    """POST one streaming request and time it. Never raises for server or network errors: they
    come back as RequestResult(ok=False, error=...)."""
    res = RequestResult(prompt_tokens=prompt.tokens or 0, requested_tokens=prompt.output_len)
    chunks = 0
    last = None
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                res.error = _error_text(r.status, await r.read())
                return res
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    res.error = f"malformed stream event: {data[:100]!r}"
                    return res
                if "error" in chunk:
                    err = chunk["error"]
                    res.error = "stream error: " + str(err.get("message") if isinstance(err, dict)
                                                       else err)
                    return res
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = usage.get("prompt_tokens") or res.prompt_tokens
                    res.output_tokens = usage.get("completion_tokens") or 0
                if _chunk_text(endpoint, chunk):
                    chunks += 1
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:   # Value: line too long
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return res
    res.latency = time.perf_counter() - t0
    if not res.usage_reported:
        res.output_tokens = chunks
    if last is None:
        res.error = "the stream ended without any generated text"
        return res
    res.ok = True
    return res
