"""Claude Code and Codex themselves (pinned in tests/agent_clis/package.json; .ci/run installs
them with npm ci) each run one non-interactive turn against `maxjax serve`, configured with
nothing but the server's base URL, a key and the served model's name (docs/openai-api.md): they
exit 0 with the server's answer, and every request they make is answered 200. Against a model
whose window cannot hold their prompt (~12.4k tokens for Claude Code, ~9.2k for Codex) they fail
with the server's 400 saying what to change. The model is tiny_llama's answering Llama (any
prompt: "Hello from maxjax" then EOS), so a turn ends after six tokens on a CPU. The protocol
details these runs rest on are in tests/test_agent_protocols.py."""
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
from tiny_llama import write_answering_llama

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
from reliability import ServeProcess  # noqa: E402

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

BIN = os.path.join(os.path.dirname(__file__), "agent_clis", "node_modules", ".bin")
MODEL = "tiny-agent"
ANSWER = "Hello from maxjax"
SMALL_WINDOW = 4096
TOO_SMALL = f"serve a model with a longer context window (this is the model's whole window of " \
            f"{SMALL_WINDOW} tokens)"
FLAGS = ["--served-model-name", MODEL, "--max-batch-size", "2", "--max-batch-input-tokens",
         "2048"]
ACCESS = re.compile(r'maxjax\.access: \S+ "(\w+ \S+)" (\d{3}) ')


@pytest.fixture(scope="module")
def clis() -> dict[str, str]:
    paths = {name: os.path.join(BIN, name) for name in ("claude", "codex")}
    missing = [name for name, path in paths.items() if not os.access(path, os.X_OK)]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"no {', '.join(missing)}: .ci/run installs them "
                        "(npm ci --prefix tests/agent_clis)")
        pytest.skip(f"no {', '.join(missing)} (npm ci --prefix tests/agent_clis)")
    return paths


@pytest.fixture(scope="module")
def servers(clis, tmp_path_factory):
    """{"roomy": a server whose --max-length of 32768 holds the CLIs' prompts, "small": one
    whose model's whole window is SMALL_WINDOW tokens}, started side by side."""
    from maxjax.models.gguf import open_gguf
    from maxjax.models.loader import embedded_model_path
    _, _, tokenizer, _ = open_gguf(embedded_model_path())     # SmolLM2's ChatML tokenizer
    root = tmp_path_factory.mktemp("models")
    roomy = write_answering_llama(root / "roomy", tokenizer, ANSWER, window=65536)
    small = write_answering_llama(root / "small", tokenizer, ANSWER, window=SMALL_WINDOW)
    procs = {"roomy": ServeProcess(["--model", roomy, "--max-length", "32768",
                                    "--num-kv-pages", "1100", *FLAGS]),
             "small": ServeProcess(["--model", small, "--num-kv-pages", "200", *FLAGS])}
    with ExitStack() as stack:
        for p in procs.values():
            stack.push(p)
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(ServeProcess.__enter__, procs.values()))
        yield procs
    for name, p in procs.items():
        assert p.returncode == 0, name + ": " + "".join(p.stderr)[-3000:]


def run_cli(server: ServeProcess, argv: list[str], env: dict, cwd) -> tuple[int, str, str, list]:
    """(exit status, stdout, stderr and the server's log meanwhile, [(request, status) it
    logged])."""
    seen = len(server.stderr)
    # only what the CLI needs: nothing of the caller's own Anthropic/OpenAI settings or proxies
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd), **env}
    r = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=600)
    deadline = time.monotonic() + 30     # the server logs a request once its answer is out
    while True:
        logged = [m.groups() for line in server.stderr[seen:] if (m := ACCESS.search(line))]
        if logged or time.monotonic() > deadline:
            log = "".join(server.stderr[seen:])[-4000:]
            return r.returncode, r.stdout, f"{r.stderr}\nmaxjax serve:\n{log}", logged
        time.sleep(0.2)


def claude(path: str, server: ServeProcess, tmp_path):
    return run_cli(server, [path, "-p", "Say hello", "--output-format", "json"],
                   {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "any",
                    "ANTHROPIC_MODEL": MODEL, "DISABLE_TELEMETRY": "1",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, tmp_path)


def codex(path: str, server: ServeProcess, tmp_path):
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "maxjax"\n\n[model_providers.maxjax]\n'
        f'name = "maxjax"\nbase_url = "{server.url}/v1"\nwire_api = "responses"\n'
        'env_key = "MAXJAX_API_KEY"\n')
    # exec runs without asking (approval "never", a read-only sandbox); outside a git repository
    # it needs --skip-git-repo-check
    return run_cli(server, [path, "exec", "--skip-git-repo-check", "Say hello"],
                   {"CODEX_HOME": str(home), "MAXJAX_API_KEY": "any"}, tmp_path)


def test_claude_code_one_turn(clis, servers, tmp_path):
    rc, out, err, logged = claude(clis["claude"], servers["roomy"], tmp_path)
    assert rc == 0, out + err
    result = json.loads(out)
    assert result["result"] == ANSWER and not result["is_error"], result
    assert logged and all(status == "200" for _, status in logged), logged
    assert ("POST /v1/messages", "200") in logged, logged


def test_codex_one_turn(clis, servers, tmp_path):
    rc, out, err, logged = codex(clis["codex"], servers["roomy"], tmp_path)
    assert rc == 0, out + err
    assert out.strip() == ANSWER, out + err     # exec prints the last message alone on stdout
    assert logged and all(status == "200" for _, status in logged), logged
    assert ("POST /v1/responses", "200") in logged, logged


def test_claude_code_window_too_small(clis, servers, tmp_path):
    rc, out, err, logged = claude(clis["claude"], servers["small"], tmp_path)
    assert rc != 0, out + err
    result = json.loads(out)
    assert result["api_error_status"] == 400 and TOO_SMALL in result["result"], result
    assert logged and all(status == "400" for _, status in logged), logged


def test_codex_window_too_small(clis, servers, tmp_path):
    rc, out, err, logged = codex(clis["codex"], servers["small"], tmp_path)
    assert rc != 0, out + err
    assert TOO_SMALL in err, err
    assert logged and all(status == "400" for _, status in logged), logged
