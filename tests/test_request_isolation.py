"""A bad request never hurts the others: while a valid streaming completion runs on a real engine
(a tiny random Llama, EngineCore + AsyncEngine behind the real server), one request breaking each
limit gets a 400 naming the field, the stream finishes with the tokens it has alone, and no KV
page stays held."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from server_harness import ServerThread, http
from tiny_llama import tiny_core

from maxjax.engine.async_engine import AsyncEngine
from pool_check import check_pool

MAX_LENGTH, VOCAB = 64, 512          # the engine's max_length; tests/tiny_llama.py's vocabulary
STREAM = {"prompt": [5, 7, 9, 11], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}}
BASE = {"prompt": [5, 7, 9], "max_tokens": 4}
BAD = [   # (body fields over BASE, the error's param)
    ({"logit_bias": {str(i): 1 for i in range(100)}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": ["a" * 257]}, "stop"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(3, 19)), "min_tokens": 1}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": list(range(3, 3 + MAX_LENGTH))}, "prompt"),
    ({"max_tokens": MAX_LENGTH - 2}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5}, "min_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": -2**63 - 1}, "seed"),
]


class StepGate:
    """Stands in for core.step: lets `allow(n)` more steps run, then makes steps do nothing
    until `release()`. The engine loop keeps taking requests meanwhile, so a running request
    stays running, its pages held, while the test sends others."""

    def __init__(self, core):
        self.step, self.left, self.lock = core.step, None, threading.Lock()
        core.step = self

    def allow(self, n: int) -> None:
        with self.lock:
            self.left = n

    def release(self) -> None:
        with self.lock:
            self.left = None

    def __call__(self):
        with self.lock:
            go = self.left is None or self.left > 0
            if go and self.left is not None:
                self.left -= 1
        if go:
            return self.step()
        time.sleep(0.002)
        return []


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    core = tiny_core(tmp_path_factory.mktemp("tiny"), max_length=MAX_LENGTH)
    engine = AsyncEngine(core, core.model.tokenizer, "tiny", None)
    engine.start()
    wait_until(lambda: core.primed, "priming")
    server = ServerThread(engine)
    gate = StepGate(core)
    yield server, core, gate
    gate.release()
    server.close()
    engine.shutdown()


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


class Stream(threading.Thread):
    """A streaming completion read on its own thread: `first` is set at the first text."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.events, self.first = url, [], threading.Event()

    def run(self):
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(STREAM).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    self.events.append(json.loads(line[6:]))
                    if self.events[-1]["choices"] and self.events[-1]["choices"][0]["text"]:
                        self.first.set()

    def result(self) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens)."""
        choices = [c for e in self.events for c in e["choices"]]
        return ("".join(c["text"] for c in choices), choices[-1]["finish_reason"],
                self.events[-1]["usage"]["completion_tokens"])


def streamed(url: str) -> Stream:
    s = Stream(url)
    s.start()
    return s


def test_bad_requests_leave_a_running_stream_intact(served):
    server, core, gate = served
    alone = streamed(server.url)
    alone.join(60)
    text, reason, n = alone.result()
    assert (reason, n) == ("length", STREAM["max_tokens"]) and text

    gate.allow(1)                       # the prefill: the first token, then the engine waits
    stream = streamed(server.url)
    assert stream.first.wait(30)
    for fields, param in BAD:
        try:
            r = http("POST", server.url + "/v1/completions", {**BASE, **fields}, timeout=10)
        except OSError:     # admitted: it waits for a step that the gate holds back
            pytest.fail(f"a request with a bad {param} was admitted")
        assert r.status_code == 400, (fields, r.text)
        assert r.json()["error"]["param"] == param, (fields, r.json())
    assert list(core.scheduler.requests) and core.block_manager.num_used_pages > 0
    assert len(core.scheduler.requests) == 1     # nothing bad was admitted
    gate.release()
    stream.join(60)
    assert stream.result() == (text, reason, n)
    wait_until(lambda: not core.has_unfinished(), "the stream's request to finish")
    assert core.block_manager.num_used_pages == 0
    check_pool(core.block_manager)


def test_a_negative_seed_samples_reproducibly(served):
    """A negative seed (any int64 is one) gives the same tokens each time at temperature 1,
    and not those of its absolute value."""
    server, core, _ = served
    body = {"prompt": [5, 7, 9], "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}

    def tokens(seed):
        r = http("POST", server.url + "/v1/completions", {**body, "seed": seed,
                                                          "logprobs": 0}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]
    first = tokens(-123456789)
    assert tokens(-123456789) == first
    assert tokens(123456789) != first
    wait_until(lambda: not core.has_unfinished(), "the requests to finish")
    assert core.block_manager.num_used_pages == 0
