"""A peer's API tests in CI: vLLM's own OpenAI entrypoint tests, from its pinned sdist (fetched
at test time from the package index, never kept in this repository), run against `maxjax serve`
through our shim (tests/conformance/: a RemoteOpenAIServer that starts maxjax, a stand-in for the
`vllm` package, a plugin). Every test that fails is on tests/conformance/vllm_expected_failures.txt
with its reason; one that fails off the list, or passes on it, fails this test: the list changes
on purpose only."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

VLLM_VERSION = "0.34.0"
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
CONFORMANCE = Path(__file__).with_name("conformance")
sys.path.insert(0, str(CONFORMANCE))
from vllm_plugin import read_expected  # noqa: E402

# The protocol-level modules, under the sdist's tests/entrypoints/ (not those that test vLLM's
# own classes, need its LoRA checkpoints, multimodal or harmony models, or its launchers).
MODULES = [
    "openai/chat_completion/test_chat.py",
    "openai/chat_completion/test_chat_completion.py",
    "openai/chat_completion/test_chat_echo.py",
    "openai/chat_completion/test_chat_logit_bias_validation.py",
    "openai/chat_completion/test_completion_with_function_calling.py",
    "openai/chat_completion/test_enable_force_include_usage.py",
    "openai/chat_completion/test_logprob_token_ids.py",
    "openai/completion/test_completion.py",
    "openai/models/test_models.py",
    "openai/test_chunked_prompt.py",
    "openai/test_return_token_ids.py",
    "openai/test_return_tokens_as_ids.py",
    "openai/responses/test_basic.py",
    "openai/responses/test_function_call.py",
    "openai/responses/test_simple.py",
    "openai/responses/test_stateful.py",
    "openai/responses/test_structured_output.py",
    "serve/tokenize/test_tokenization.py",
    "anthropic/test_messages.py",
]
# what the modules import from beside them (vLLM's tests/utils.py is replaced by ours)
SUPPORT = ["conftest.py", "openai/responses/conftest.py"]
PYTEST_INI = """[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
timeout = 600
"""


def index_url() -> str:
    """pip's index: $PIP_INDEX_URL, else pip's own default."""
    from pip._internal.models.index import PyPI
    return (os.environ.get("PIP_INDEX_URL") or PyPI.simple_url).rstrip("/")


def fetch_sdist(cache: Path) -> Path:
    """The pinned sdist, from the index's JSON simple API (PEP 691), checked against its hash;
    pip download cannot fetch it (it builds the sdist's metadata, which needs vLLM's torch)."""
    path = cache / SDIST
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == SDIST_SHA256:
        return path
    req = urllib.request.Request(f"{index_url()}/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        files = {f["filename"]: f for f in json.load(r)["files"]}
    assert SDIST in files, f"the index has no {SDIST}"
    with urllib.request.urlopen(files[SDIST]["url"], timeout=600) as r:
        data = r.read()
    assert hashlib.sha256(data).hexdigest() == SDIST_SHA256, f"{SDIST}: sha256 mismatch"
    path.write_bytes(data)
    return path


def unpack(sdist: Path, dest: Path) -> Path:
    """The modules, their packages' __init__.py and the support files, under dest/tests/."""
    wanted = {f"tests/entrypoints/{m}" for m in MODULES + SUPPORT}
    for m in wanted.copy():
        parts = Path(m).parts
        wanted |= {"/".join(parts[:i] + ("__init__.py",)) for i in range(1, len(parts))}
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.removeprefix(prefix) in wanted]
        for m in members:
            m.name = m.name.removeprefix(prefix)
        tar.extractall(dest, members=members, filter="data")
    shutil.copy(CONFORMANCE / "vllm_utils.py", dest / "tests" / "utils.py")
    (dest / "pytest.ini").write_text(PYTEST_INI)
    return dest


def run_suite(root: Path, report: Path, log: Path, extra: list[str] = ()) -> int:
    env = dict(os.environ, MAXJAX_VLLM_REPORT=str(report), MAXJAX_VLLM_LOGDIR=str(log.parent),
               PYTHONPATH=os.pathsep.join([str(CONFORMANCE), str(root)]))
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-c", str(root / "pytest.ini"), "--rootdir", str(root),
           "-p", "vllm_plugin", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rfE",
           *[f"tests/entrypoints/{m}" for m in MODULES], *extra]
    with log.open("w") as out:
        return subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=3600).returncode


@pytest.mark.timeout(4000)
def test_vllm_entrypoint_tests_fail_only_as_listed(tmp_path, request):
    cache = Path(request.config.cache.mkdir("vllm-sdist")) if request.config.cache else tmp_path
    root = unpack(fetch_sdist(cache), tmp_path / "vllm")
    report, log = tmp_path / "report.json", tmp_path / "pytest.log"
    rc = run_suite(root, report, log)
    tail = log.read_text()[-6000:]
    assert report.exists(), f"the vLLM tests did not run (rc {rc}):\n{tail}"
    result = json.loads(report.read_text())
    outcomes = result["outcomes"]
    expected = read_expected()
    unexpected = [f"{t}: {result['messages'].get(t, '')[:300]}"
                  for t, o in sorted(outcomes.items()) if o in ("failed", "error")]
    now_passing = sorted(t for t, o in outcomes.items() if o == "xpassed")
    gone = sorted(set(expected) - set(result["collected"]))
    assert not (unexpected or now_passing or gone), (
        "failing, not on the list:\n" + "\n".join(unexpected) +
        f"\npassing, on the list: {now_passing}\n"
        f"on the list, not collected: {gone}\n{tail}")
    assert rc == 0, tail
    assert sum(o == "passed" for o in outcomes.values()) > 0
