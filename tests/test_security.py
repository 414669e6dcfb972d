"""Security review, as tests (mock engine behind the real app):
  - `--api-key` guards every route but /health and the web UI's static files, compared in
    constant time (hmac.compare_digest), wrong keys of any length refused the same way;
  - the server binds 127.0.0.1 unless told otherwise;
  - limits: a body over --max-request-body-bytes is refused from its Content-Length before it
    is read, over-long or too many headers are refused, a half-sent request head is cut after
    --http-idle-timeout and a half-sent body gets a 408 after --http-body-timeout;
  - chat templates render in Jinja's sandbox: one that reaches for attributes or files is a 400
    naming messages, and the server keeps serving.
(Artifacts: only files whose sha256 the manifest names are deserialized, tested in
tests/test_aot.py; --custom-architectures runs code, as its help and docs/models.md say.)"""
import hmac
import socket
import time

import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http

from maxjax.cli.args import build
from maxjax.cli.main import build_parser
from maxjax.server.app import build_app
from maxjax.server.config import ServeConfig

KEY = "sekret-key"
MSGS = [{"role": "user", "content": "hi"}]
OPEN = {"/health", "/v1/health", "/"}


@pytest.fixture(scope="module")
def keyed():
    s = ServerThread(MockEngine(), ServeConfig(api_key=KEY, max_request_body_bytes=4096,
                                               http_idle_timeout=1.0, http_body_timeout=1.0))
    yield s
    s.close()


def routes():
    app = build_app(MockEngine())
    for r in app.router.routes():
        path = r.resource.canonical
        if r.method == "HEAD" or path.startswith("/ui"):
            continue
        yield r.method, path.replace("{model_id:.+}", "mock-model")


@pytest.mark.parametrize("method, path", sorted(set(routes())))
def test_every_route_but_health_needs_the_key(keyed, method, path):
    body = {} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                    {"Authorization": KEY}, {"Authorization": "Bearer " + "k" * 4000}):
        r = http(method, keyed.url + path, body, headers=headers)
        if path in OPEN:
            assert r.status_code == 200, (path, r.status_code)
        else:
            assert r.status_code == 401, (path, headers, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
    if path not in OPEN and path != "/stats/stream":
        r = http(method, keyed.url + path, body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code != 401


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert http("GET", keyed.url + "/v1/models",
                headers={"Authorization": "Bearer guess"}).status_code == 401
    assert calls == [(b"guess", KEY.encode())]


def test_default_bind_is_localhost():
    assert ServeConfig().host == "127.0.0.1"
    assert build(ServeConfig, build_parser().parse_args(["serve"])).host == "127.0.0.1"


def raw(server, data: bytes, wait: float = 10.0) -> tuple[bytes, float | None, float]:
    """Send `data` on a new connection: what comes back until the server closes it, when its
    first byte came (None: nothing came) and when the connection closed."""
    host, port = server.url[7:].split(":")
    t0, first = time.monotonic(), None
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                first = first or time.monotonic() - t0
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out, first, time.monotonic() - t0


AUTH = f"Authorization: Bearer {KEY}\r\n".encode()


def post_head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + AUTH + b"Content-Length: %d\r\n\r\n" % length)


def test_a_body_over_the_limit_is_refused_before_it_is_read(keyed):
    out, first, closed = raw(keyed, post_head(10 << 20) + b"{")   # 10 MB announced, 1 sent
    assert out.startswith(b"HTTP/1.1 413") and b'"invalid_request_error"' in out
    assert first < 2 and closed < 5


@pytest.mark.parametrize("head, status", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", (400, 431)),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
     + b"\r\n", (400, 431)),
])
def test_header_limits(keyed, head, status):
    out, _, _ = raw(keyed, head)
    assert int(out[9:12]) in status


def test_slow_clients_are_cut(keyed):
    out, _, closed = raw(keyed, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # no end
    assert out == b"" and closed < 5
    out, first, closed = raw(keyed, post_head(100) + b'{"messages"')           # body never ends
    assert out.startswith(b"HTTP/1.1 408") and b"--http-body-timeout" in out
    assert first < 4 and closed < 8
    assert http("GET", keyed.url + "/health").status_code == 200


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% include '/etc/passwd' %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for m in messages %}{{ m.content.__class__.__base__.__subclasses__() }}{% endfor %}",
])
def test_chat_templates_run_in_the_sandbox(template):
    engine = MockEngine()
    engine.chat_template = template
    s = ServerThread(engine)
    try:
        r = http("POST", s.url + "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "chat template" in err["message"]
        assert "root:" not in r.text and "uid=" not in r.text and "Traceback" not in r.text
        assert http("GET", s.url + "/health").status_code == 200
    finally:
        s.close()
