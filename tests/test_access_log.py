"""The access log (server/access_log.py): one line per request on `maxjax.access` when its
response ends, with method, path, status, model, token counts, time to first token and duration;
--disable-log-requests turns it off."""
import json
import logging
import re
import socket
import time

import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http

from maxjax.server.config import ServeConfig

CHAT = "/v1/chat/completions"
LINE = re.compile(r'^(\S+) "(\w+) (\S+)" (\d{3}) model=("(?:[^"\\]|\\.)*"|\S+) '
                  r'prompt_tokens=(\d+) '
                  r'completion_tokens=(\d+) cached_tokens=(\d+) ttft=(-|[\d.]+s) '
                  r'duration=([\d.]+)s$')


@pytest.fixture(scope="module")
def server():
    engine = MockEngine(delay=0.002)
    engine.cached_tokens = 3
    s = ServerThread(engine)
    yield s
    s.close()


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.INFO, logger="maxjax.access")

    def lines(path: str, count: int = 1, timeout: float = 30) -> list[dict]:
        """The access lines for `path` (waiting up to `timeout` for `count` of them)."""
        end = time.monotonic() + timeout
        while True:
            found = [m for r in caplog.records if r.name == "maxjax.access"
                     and (m := LINE.match(r.getMessage())) and m.group(3) == path]
            if len(found) >= count or time.monotonic() > end:
                break
            time.sleep(0.05)
        return [{"remote": m.group(1), "method": m.group(2), "status": int(m.group(4)),
                 "model": m.group(5), "prompt": int(m.group(6)), "completion": int(m.group(7)),
                 "cached": int(m.group(8)), "ttft": m.group(9), "duration": float(m.group(10))}
                for m in found]
    return lines


def test_a_chat_is_one_line_with_its_usage(server, access):
    r = http("POST", server.url + CHAT, {"model": "mock-model", "max_tokens": 5,
                                         "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    use = r.json()["usage"]
    [line] = access(CHAT)
    assert line["remote"] == "127.0.0.1" and line["method"] == "POST"
    assert line["status"] == 200 and line["model"] == "mock-model"
    assert (line["prompt"], line["completion"], line["cached"]) == (
        use["prompt_tokens"], use["completion_tokens"],
        use["prompt_tokens_details"]["cached_tokens"]) == (use["prompt_tokens"], 5, 3)
    assert line["ttft"] != "-" and 0 <= float(line["ttft"][:-1]) <= line["duration"]


def test_a_stream_is_logged_at_its_end(server, access):
    r = http("POST", server.url + "/v1/completions", {"prompt": "hello", "max_tokens": 7,
                                                      "stream": True, "n": 2})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    [line] = access("/v1/completions")
    assert line["status"] == 200 and line["completion"] == 14 and line["prompt"] == 5
    assert line["model"] == "mock-model" and line["ttft"] != "-"


def test_a_400_names_the_model_asked_for(server, access):
    r = http("POST", server.url + CHAT, {"model": "my model\n x", "messages": [], "max_tokens": 2})
    assert r.status_code in (400, 404)
    [line] = access(CHAT)
    assert line["status"] == r.status_code and line["model"] == json.dumps("my model\n x")
    assert (line["prompt"], line["completion"], line["ttft"]) == (0, 0, "-")
    r = http("POST", server.url + "/v1/messages", {"model": "claude", "max_tokens": 0,
                                                   "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    [line] = access("/v1/messages")
    assert line["status"] == 400 and line["model"] == "claude"


def test_embeddings_and_a_get(server, access):
    r = http("POST", server.url + "/v1/embeddings", {"input": ["ab", "cde"]})
    assert r.status_code == 200
    [line] = access("/v1/embeddings")
    assert line["prompt"] == r.json()["usage"]["prompt_tokens"] == 5
    assert http("GET", server.url + "/v1/models").status_code == 200
    [line] = access("/v1/models")
    assert line["status"] == 200 and line["model"] == "-" and line["method"] == "GET"


def test_a_client_gone_mid_stream_is_a_499_with_the_tokens_so_far(access):
    engine = MockEngine(delay=0.05)
    s = ServerThread(engine)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
                           "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        seen = b""
        while seen.count(b"data: ") < 4:        # a few tokens out, then the client leaves
            seen += sock.recv(65536)
        sock.close()
        [line] = access(CHAT, timeout=60)
        assert line["status"] == 499
        assert 2 <= line["completion"] < 400 and line["ttft"] != "-"
    finally:
        s.close()


def test_disable_log_requests_turns_it_off(access):
    s = ServerThread(MockEngine(), ServeConfig(disable_log_requests=True))
    try:
        r = http("POST", s.url + CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2})
        assert r.status_code == 200
        assert http("POST", s.url + CHAT, {"messages": []}).status_code == 400
        assert access(CHAT, timeout=1) == []
    finally:
        s.close()


def test_the_flag_parses():
    from maxjax.cli.main import build_parser
    sp = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert sp.parse_args(["--disable-log-requests"]).disable_log_requests is True
    assert "disable_log_requests" not in vars(sp.parse_args([]))
