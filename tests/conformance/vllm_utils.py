"""Our stand-in for vLLM's tests/utils.py (copied over it in the unpacked sdist): its
RemoteOpenAIServer starts `maxjax serve` on the embedded SmolLM2 instead of `vllm serve`.

The model a module names is served under that name (--served-model-name), so requests and the
`model` fields of answers are those the module expects. One server lives at a time and outlives
the `with` blocks: a module naming the same model reuses it, another name restarts it (the
compile cache makes a restart ~10 s). Of vLLM's serve arguments only --served-model-name (its
first name) and --max-model-len are read; the rest are vLLM's and ignored: the server is the same
for every module (what a module asks of vLLM's flags is on the expected-failure list). The
maximum length is SHORT but in WHOLE_WINDOW's modules, so that a request without max_tokens,
which the small model rarely ends by itself, ends in seconds.

vLLM's test servers run with a fixed --seed (this class's `seed=0`), so what they sample without a
request seed is the same in every run; maxjax draws an unseeded request's seed at random. The
clients handed out here give each generation request that names no seed one made from its body
(`_seeded`), so a test's samples, and its outcome, are the same in every run."""
import atexit
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import anthropic
import httpx
import openai

VLLM_PATH = Path(__file__).parent.parent
ROCM_EXTRA_ARGS: list[str] = []
ROCM_ENGINE_KWARGS: dict = {}
MAXJAX_FLAGS = ["--max-batch-size", "8", "--num-kv-pages", "400"]
WINDOW = 8192   # SmolLM2's
SHORT = 1024
# the modules whose every request bounds its output get the --max-model-len they ask for
WHOLE_WINDOW = ("tests/entrypoints/serve/tokenize/test_tokenization.py",
                "tests/entrypoints/openai/test_chunked_prompt.py")
START_TIMEOUT_S = 900


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Maxjax:
    """The one `maxjax serve` process of this pytest run."""

    def __init__(self, model: str, max_length: int):
        self.key, self.port = (model, max_length), get_open_port()
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="maxjax-serve-", suffix=".log", delete=False,
            dir=os.environ.get("MAXJAX_VLLM_LOGDIR"))
        cmd = [os.path.join(os.path.dirname(sys.executable), "maxjax"), "serve",
               "--port", str(self.port), "--served-model-name", model,
               "--max-length", str(max_length), *MAXJAX_FLAGS]
        print(f"[maxjax shim] {' '.join(cmd)} (log: {self.log.name})", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"maxjax serve did not start:\n{self.log.read()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_live: list[_Maxjax] = []


def _server_for(model: str, max_length: int) -> _Maxjax:
    if _live and _live[0].key == (model, max_length) and _live[0].proc.poll() is None:
        return _live[0]
    stop_all()
    _live.append(_Maxjax(model, max_length))
    return _live[0]


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def _max_length(args: list[str]) -> int:
    module = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    asked = int(_arg(args, "--max-model-len", str(WINDOW)))
    return min(asked, WINDOW) if module in WHOLE_WINDOW else SHORT


def stop_all() -> None:
    while _live:
        _live.pop().stop()


atexit.register(stop_all)


_SEEDED_ROUTES = ("/chat/completions", "/completions", "/responses")


def _seeded(request: httpx.Request) -> httpx.Request:
    """The request with a seed from its body's digest when it is a generation without one."""
    if request.method != "POST" or not request.url.path.endswith(_SEEDED_ROUTES):
        return request
    try:
        body = json.loads(request.content)
    except ValueError:
        return request
    if not isinstance(body, dict) or body.get("seed") is not None:
        return request
    body["seed"] = int.from_bytes(hashlib.sha256(request.content).digest()[:7], "big")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
    return httpx.Request(request.method, request.url, headers=headers,
                         content=json.dumps(body).encode(), extensions=request.extensions)


class _Transport(httpx.HTTPTransport):
    def handle_request(self, request):
        return super().handle_request(_seeded(request))


class _AsyncTransport(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request):
        return await super().handle_async_request(_seeded(request))


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict=None, seed=0,
                 auto_port=True, max_wait_seconds=None, override_hf_configs=None) -> None:
        args = list(vllm_serve_args)
        server = _server_for(_arg(args, "--served-model-name", model), _max_length(args))
        self.host, self.port, self.uds = "127.0.0.1", server.port, None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass    # kept for the next module naming the same model; stop_all() ends it

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(p.strip("/") for p in parts if p)

    def _kwargs(self, kwargs: dict) -> dict:
        return {"timeout": 600, "api_key": self.DUMMY_API_KEY, "max_retries": 0, **kwargs}

    def get_client(self, **kwargs):
        return openai.OpenAI(base_url=self.url_for("v1"), **self._kwargs(
            {"http_client": httpx.Client(transport=_Transport(), timeout=600), **kwargs}))

    def get_async_client(self, **kwargs):
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), **self._kwargs(
            {"http_client": httpx.AsyncClient(transport=_AsyncTransport(), timeout=600),
             **kwargs}))

    def get_client_anthropic(self, **kwargs):
        return anthropic.Anthropic(base_url=self.url_for(), **self._kwargs(kwargs))

    def get_async_client_anthropic(self, **kwargs):
        return anthropic.AsyncAnthropic(base_url=self.url_for(), **self._kwargs(kwargs))

