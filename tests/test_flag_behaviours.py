"""One behaviour check per `max serve` flag that had none (tests/flag_tests.py maps every flag
maxjax serves to its tests): each test sets the flag and looks at what it changes, so it fails
if the flag were parsed and ignored. Fast: the mock engine behind the real server, the grammar
backend over the mock's byte tokenizer, the pool planner on an abstract model, tiny random
checkpoints that load without compiling."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from mock_engine import CHAT_TEMPLATE, EOS_ID, MockEngine, byte_tokenizer
from server_harness import ServerThread, http

from maxjax.engine.config import EngineConfig
from maxjax.engine.types import SamplingParams
from maxjax.errors import RequestError, UserError
from maxjax.server.config import ServeConfig

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow' (server subprocesses)

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]


def serving(cfg: ServeConfig | None = None, **engine_kw):
    return ServerThread(MockEngine(**engine_kw), cfg or ServeConfig())


def chat(s, **kw):
    return http("POST", s.url + "/v1/chat/completions",
                {"model": "mock-model", "messages": MSGS, "max_tokens": 40, **kw})


# ---- server flags (ServeConfig) ----------------------------------------------------------------

def test_emit_reasoning_content():
    want = {None: {"reasoning_content", "reasoning"}, True: {"reasoning_content"},
            False: {"reasoning"}}
    for emit, fields in want.items():
        s = serving(ServeConfig(reasoning_parser="qwen3", emit_reasoning_content=emit),
                    script="<think>a</think>b")
        try:
            msg = chat(s).json()["choices"][0]["message"]
            assert msg["content"] == "b"
            assert {k for k in ("reasoning_content", "reasoning") if msg.get(k)} == fields
            assert all(msg[k] == "a" for k in fields)
        finally:
            s.close()


def test_tool_parser():
    call = "[get_weather(city='Paris')]"
    # pythonic: the call is parsed out; hermes (the mock template's default) leaves it content
    for parser, calls in (("pythonic", [("get_weather", {"city": "Paris"})]), (None, None)):
        s = serving(ServeConfig(tool_parser=parser), script=call, max_length=4096)
        try:
            msg = chat(s, tools=TOOLS).json()["choices"][0]["message"]
            got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                   for c in msg.get("tool_calls") or []] or None
            assert got == calls, msg
            assert (msg["content"] is None) == (calls is not None)
        finally:
            s.close()
    s = serving(ServeConfig(tool_parser="none"), max_length=4096)
    try:
        r = chat(s, tools=TOOLS)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert chat(s).status_code == 200
    finally:
        s.close()


def test_enable_tool_call_constrained_decode():
    for on in (True, False):
        s = serving(ServeConfig(enable_tool_call_constrained_decode=on),
                    script='<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n'
                           '</tool_call>', max_length=4096)
        try:
            r = chat(s, tools=TOOLS, tool_choice="required")
            assert r.status_code == 200, r.text
            spec = s.engine.requests[-1][2].structured_output
            assert (spec is not None) == on, spec
            if on:
                assert "get_weather" in spec.source
        finally:
            s.close()


def _run_server(env: dict, host: str, port: int | None):
    """The real run_server over the mock engine in a subprocess; ServeConfig's host and port
    from the flags when given, else its defaults ($MAX_SERVE_HOST / $MAX_SERVE_PORT)."""
    kw = {"host": host} if host else {}
    if port is not None:
        kw["port"] = port
    code = ("import asyncio, sys; sys.path.insert(0, 'tests'); from mock_engine import MockEngine;"
            "from maxjax.server.app import run_server; from maxjax.server.config import ServeConfig;"
            f"asyncio.run(run_server(MockEngine(), ServeConfig(**{kw!r})))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_probe(env, host, port, probes):
    proc = _run_server(env, host, port)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("Server ready on http://"), proc.stderr.read()
        url = ready.split()[-1]
        return url, {p: _reachable(p) for p in probes}
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _reachable(addr) -> bool:
    try:
        socket.create_connection(addr, timeout=2).close()
        return True
    except OSError:
        return False


def test_host():
    port = _free_port()
    url, seen = _serve_and_probe({}, "127.0.0.2", port,
                                 [("127.0.0.2", port), ("127.0.0.1", port)])
    assert url == f"http://127.0.0.2:{port}"
    assert seen == {("127.0.0.2", port): True, ("127.0.0.1", port): False}
    # not given: $MAX_SERVE_HOST
    port = _free_port()
    url, seen = _serve_and_probe({"MAX_SERVE_HOST": "127.0.0.3"}, None, port,
                                 [("127.0.0.3", port), ("127.0.0.1", port)])
    assert seen == {("127.0.0.3", port): True, ("127.0.0.1", port): False}


def test_pretty_print_config(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "maxjax.cli", "serve", "--pretty-print-config",
         "--model-path", str(tmp_path / "missing"), "--max-batch-size", "3",
         "--api-key", "s3cret", "--port", "8123"],
        cwd=root, capture_output=True, text=True, timeout=120)
    printed = json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])
    assert printed["engine"]["max_batch_size"] == 3
    assert printed["server"]["port"] == 8123 and printed["server"]["api_key"] == "***"
    assert printed["model"]["model_path"] == str(tmp_path / "missing")
    assert "s3cret" not in proc.stdout
    plain = subprocess.run(
        [sys.executable, "-m", "maxjax.cli", "serve", "--model-path", str(tmp_path / "missing")],
        cwd=root, capture_output=True, text=True, timeout=120)
    assert "max_batch_size" not in plain.stdout


# ---- engine flags (EngineConfig) ----------------------------------------------------------------

def _limits(**cfg):
    """The request limits EngineCore checks requests against, from its config."""
    from maxjax.engine.core import EngineCore
    core = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=300)),
                           max_length=64, eos_token_ids=(EOS_ID,), cfg=EngineConfig(**cfg))
    return EngineCore._limits(core)


def test_pool_embeddings():
    from maxjax.engine.core import EngineCore
    pooling = lambda **cfg: EngineCore.default_pooling(SimpleNamespace(cfg=EngineConfig(**cfg)))
    assert (pooling().pooling_type, pooling().normalize) == ("last", True)
    assert pooling(pooling_type="mean").pooling_type == "mean"
    off = pooling(pool_embeddings=False, pooling_type="mean")
    assert (off.pooling_type, off.normalize) == ("last", False)


def _grammar_model():
    tok = byte_tokenizer()
    return SimpleNamespace(tokenizer=tok, config=SimpleNamespace(vocab_size=len(tok),
                                                                 eos_token_ids=(EOS_ID,)))


def test_enable_structured_output():
    from maxjax.structured.backend import GrammarBackend, backend_for
    on = backend_for(EngineConfig(), _grammar_model())
    try:
        assert isinstance(on, GrammarBackend)
    finally:
        on.shutdown()
    assert backend_for(EngineConfig(enable_structured_output=False), _grammar_model()) is None


def test_structured_output_any_whitespace():
    from maxjax.structured import GrammarSpec
    from maxjax.structured.backend import backend_for
    spaced = list(b'{ "a" : 1 }')
    compact = list(b'{"a":1}')

    def accepts(any_ws: bool, ids) -> bool:
        backend = backend_for(EngineConfig(structured_output_any_whitespace=any_ws),
                              _grammar_model())
        try:
            m = backend.compiled(GrammarSpec.json_schema({
                "type": "object", "properties": {"a": {"type": "integer"}},
                "required": ["a"], "additionalProperties": False}))
            m = m.deep_copy()
            return m.consume_tokens(ids) and not m.is_error()
        finally:
            backend.shutdown()
    assert accepts(False, compact) and accepts(True, compact)
    assert accepts(True, spaced)
    assert not accepts(False, spaced)


# ---- the pool planner (plan_layout) on an abstract model: no weights, no compile ----------------

@pytest.fixture
def host(monkeypatch):
    from maxjax.engine import memory
    monkeypatch.setattr(memory, "device_free_bytes", lambda device=None: 256 << 20)


def _model():
    from test_memory_plan import SMALL, FakeModel
    return FakeModel(SMALL)          # max_position_embeddings 4096


def test_device_memory_utilization(host):
    from maxjax.engine.plan import plan_layout
    cfg = dict(max_length=4096, max_batch_size=32)
    full = plan_layout(EngineConfig(device_memory_utilization=0.9, **cfg), _model())
    half = plan_layout(EngineConfig(device_memory_utilization=0.45, **cfg), _model())
    assert "0.90 utilization" in full.memory_report and "0.45 utilization" in half.memory_report
    assert 2 <= half.num_pages < 0.75 * full.num_pages


def test_kv_cache_page_size():
    from maxjax.engine.plan import plan_layout
    for page in (8, 16, 32):
        lay = plan_layout(EngineConfig(max_length=256, num_kv_pages=40, kv_cache_page_size=page),
                          _model())
        assert (lay.page_size, lay.max_pages_per_row) == (page, 256 // page)
    with pytest.raises(UserError, match="--kv-cache-page-size must be >= 1"):
        plan_layout(EngineConfig(kv_cache_page_size=0, num_kv_pages=40), _model())


def test_kv_cache_hash_seed():
    """The seed's effect on page keys is tests/test_block_manager.py's; here: a seed that is
    not 64 hex digits is a one-line start-up error."""
    from maxjax.engine.plan import plan_layout
    cfg = dict(max_length=64, num_kv_pages=8)
    plan_layout(EngineConfig(kv_cache_hash_seed="ab" * 32, **cfg), _model())
    with pytest.raises(UserError, match="--kv-cache-hash-seed: expected 64 hex digits") as e:
        plan_layout(EngineConfig(kv_cache_hash_seed="xyz", **cfg), _model())
    assert "\n" not in str(e.value)


# ---- speculative decoding's draft model, loaded (not compiled) ----------------------------------

def test_draft_quantization_encoding(tmp_path):
    from tiny_llama import write_tiny_llama

    from maxjax.engine.draft import load_draft
    from maxjax.models.loader import load_model
    target = load_model(write_tiny_llama(tmp_path / "target"), "float32", progress=False)
    path = write_tiny_llama(tmp_path / "draft")

    def draft(**kw):
        return load_draft(EngineConfig(speculative_method="draft", draft_model_path=path, **kw),
                          target)
    assert draft().dtype == "float32"                         # default: the target's
    assert draft(draft_quantization_encoding="bfloat16").dtype == "bfloat16"
