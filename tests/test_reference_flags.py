"""`max serve` flags this repository added or changed to follow the reference: the value form of
boolean flags, MAX_SERVE_HOST / MAX_SERVE_PORT, a port in use, start-up failures in the words a
readiness loop greps for, --log-prefix, the request switches (--enable-penalties,
--enable-min-tokens, --enable-echo, --allow-unsupported-logprobs) and --structured-output-backend
xgrammar. tests/test_flag_walk.py walks the whole reference and points here."""
from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http

from maxjax import cli
from maxjax.cli.args import ModelOptions, build
from maxjax.cli.main import build_parser
from maxjax.engine.config import EngineConfig
from maxjax.engine.types import SamplingParams
from maxjax.engine.validate import EngineLimits, check_request
from maxjax.errors import RequestError, UserError
from maxjax.server.config import ServeConfig

# reference/serve-model-skill.txt: the readiness loop fails fast on these
READINESS_FAILURE = re.compile(r"Traceback|CRASHED|Error building|cannot be found|"
                               r"not found in registry", re.I)


def parse(*argv, cls=EngineConfig):
    return build(cls, build_parser().parse_args(["serve", *argv]))


def test_bool_flags_take_max_serves_value_form():
    assert parse("--enable-prefix-caching", "false").enable_prefix_caching is False
    assert parse("--enable-prefix-caching", "True").enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
    assert parse("--use-experimental-kernels", "true").use_experimental_kernels is True
    assert parse("--use-experimental-kernels", "false").use_experimental_kernels is False
    assert parse().use_experimental_kernels is None
    assert parse("--compile-cache", "off", cls=ModelOptions).compile_cache is False


def test_parser_names_take_any_case():
    """`none` is case-insensitive in the reference (--reasoning-parser, --tool-parser)."""
    cfg = parse("--reasoning-parser", "None", "--tool-parser", "NONE", cls=ServeConfig)
    assert (cfg.reasoning_parser, cfg.tool_parser) == ("none", "none")


def one_error_line(capsys, *argv) -> str:
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_bad_flag_lines_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--enable-prefix-caching", "maybe"])
    assert e.value.code == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert "--enable-prefix-caching" in line and "expected true or false" in line
    with pytest.raises(SystemExit):
        cli.main(["serve", "--no-such-flag", "1"])
    line, = capsys.readouterr().err.strip().splitlines()
    assert "unrecognized arguments: --no-such-flag 1" in line and READINESS_FAILURE.search(line)


def test_host_and_port_from_max_serve_env(monkeypatch):
    assert (parse(cls=ServeConfig).host, parse(cls=ServeConfig).port) == ("127.0.0.1", 8000)
    monkeypatch.setenv("MAX_SERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("MAX_SERVE_PORT", "8123")
    cfg = parse(cls=ServeConfig)
    assert (cfg.host, cfg.port) == ("0.0.0.0", 8123)
    cfg = parse("--host", "127.0.0.2", "--port", "9", cls=ServeConfig)
    assert (cfg.host, cfg.port) == ("127.0.0.2", 9)          # the flags win
    monkeypatch.setenv("MAX_SERVE_PORT", "eighty")
    with pytest.raises(UserError, match="MAX_SERVE_PORT=eighty: not a port number"):
        parse(cls=ServeConfig)


def test_port_in_use_is_one_line_that_the_readiness_loop_sees(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(capsys, "serve", "--port", str(port), "--log-level", "ERROR")
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in line
    assert READINESS_FAILURE.search(line)


def test_a_failed_start_is_one_line_that_the_readiness_loop_sees(tmp_path):
    """A real `maxjax serve` process: the model cannot load, so the process prints one line
    the workflow's grep catches, and exits at once (no 600 s wait)."""
    proc = subprocess.run([sys.executable, "-m", "maxjax.cli", "serve", "--model",
                           str(tmp_path / "missing"), "--port", "0", "--log-level", "ERROR"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    line, = [ln for ln in proc.stderr.splitlines() if ln.startswith("maxjax: error:")]
    assert READINESS_FAILURE.search(line) and "Traceback" not in proc.stderr, proc.stderr


def test_log_prefix(tmp_path):
    from tiny_llama import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    proc = subprocess.run([sys.executable, "-m", "maxjax.cli", "generate", "--model", model,
                           "--log-prefix", "[replica-7] ", "--num-kv-pages", "100000000",
                           "--prompt", "hi", "--no-compile-cache"],
                          capture_output=True, text=True, timeout=300)
    logs = [ln for ln in proc.stderr.splitlines() if " INFO " in ln]
    assert logs and all(ln.startswith("[replica-7] ") for ln in logs), proc.stderr


LIMITS = EngineLimits(vocab_size=100, max_length=32)


@pytest.mark.parametrize("field,value", [("frequency_penalty", 0.5), ("presence_penalty", -1.0),
                                         ("repetition_penalty", 1.2)])
def test_no_enable_penalties_refuses_a_penalty(field, value):
    params = SamplingParams(max_new_tokens=4, **{field: value})
    check_request([1, 2], params, LIMITS)
    with pytest.raises(RequestError) as e:
        check_request([1, 2], params, EngineLimits(100, 32, penalties=False))
    assert e.value.param == field and "--no-enable-penalties" in e.value.reason
    check_request([1, 2], SamplingParams(max_new_tokens=4), EngineLimits(100, 32, penalties=False))


def test_no_enable_min_tokens_refuses_min_tokens():
    params = SamplingParams(max_new_tokens=4, min_tokens=2)
    check_request([1, 2], params, LIMITS)
    with pytest.raises(RequestError) as e:
        check_request([1, 2], params, EngineLimits(100, 32, min_tokens=False))
    assert e.value.param == "min_tokens"


def test_engine_switches_reach_the_engines_limits(tmp_path):
    from tiny_llama import tiny_core
    core = tiny_core(tmp_path / "tiny", enable_penalties=False, enable_min_tokens=False)
    with pytest.raises(RequestError, match="presence_penalty"):
        core.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=2, presence_penalty=1.0))
    with pytest.raises(RequestError, match="min_tokens"):
        core.add_request("b", [1, 2, 3], SamplingParams(max_new_tokens=2, min_tokens=1))
    assert not core.has_unfinished()


@pytest.fixture(scope="module")
def strict_server():
    s = ServerThread(MockEngine(), ServeConfig(enable_echo=False))
    yield s
    s.close()


def test_no_enable_echo(strict_server):
    body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2}
    assert http("POST", strict_server.url + "/v1/completions", body).status_code == 200
    r = http("POST", strict_server.url + "/v1/completions", {**body, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_allow_unsupported_logprobs(strict_server):
    """Every route returns the logprobs it is asked for (/v1/responses too, since it returns
    them), so the flag changes nothing: with or without it, the same logprobs."""
    body = {"model": "mock-model", "input": "Hi", "top_logprobs": 2, "max_output_tokens": 3,
            "include": ["message.output_text.logprobs"]}
    lenient = ServerThread(MockEngine(), ServeConfig(allow_unsupported_logprobs=True))
    try:
        answers = [http("POST", s.url + "/v1/responses", body) for s in (strict_server, lenient)]
    finally:
        lenient.close()
    parts = [r.json()["output"][0]["content"][0] for r in answers]
    assert all(r.status_code == 200 for r in answers)
    assert parts[0]["logprobs"] == parts[1]["logprobs"] and len(parts[0]["logprobs"]) == 3


def test_structured_output_backend_xgrammar_says_why():
    from maxjax.structured.backend import backend_for
    with pytest.raises(UserError) as e:
        backend_for(EngineConfig(structured_output_backend="xgrammar"), None)
    msg = str(e.value)
    assert msg.startswith("--structured-output-backend xgrammar: not supported") and \
        "torch" in msg and "supported: llguidance" in msg
