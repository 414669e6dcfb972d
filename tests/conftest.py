import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Four host devices, before anything imports jax, for the tensor- and data-parallel tests (an
# engine without --devices still runs on the first one alone).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=4").strip()

# Engines built by the engine's one builder (maxjax/engine/build.py) in different tests share
# graphs through maxjax's compile cache (maxjax/aot/cache.py): one directory for the session
# (kept across sessions beside $MAXJAX_TEST_JAX_CACHE when given), never the user's home. JAX's
# own persistent cache stays off in this process: an executable it served cannot be stored in
# maxjax's cache (see maxjax/aot/export.py), so the cache tests would not see their entries.
_cache = os.environ.get("MAXJAX_TEST_JAX_CACHE")
if "MAXJAX_CACHE_DIR" not in os.environ:
    if _cache:
        os.environ["MAXJAX_CACHE_DIR"] = _cache.rstrip("/") + ".maxjax"
    else:   # made here, so removed here (pytest-xdist's workers inherit it and outlive nothing)
        os.environ["MAXJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxjax-compile-cache-")
        atexit.register(shutil.rmtree, os.environ["MAXJAX_CACHE_DIR"], True)
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
# pytest-xdist's workers share the cores: torch's OpenMP threads (the transformers references)
# spin while they wait for each other, and beside a busy worker that doubled a reference's time
# (test_embeddings' 64-text test beside one busy process: 26 s with two threads, 12 s with one).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--phase", choices=("all", "parallel", "serial"), default="all",
                     help="make test runs the suite in two phases: 'parallel' (every test not "
                     "marked serial, under pytest-xdist) then 'serial' (the serial ones alone)")


def pytest_collection_modifyitems(config, items):
    # the slow modules first (stable otherwise): on pytest-xdist's workers the longest ones then
    # start early instead of leaving one worker busy at the end
    items.sort(key=lambda i: i.get_closest_marker("slow") is None)
    phase = config.getoption("--phase")
    if phase == "all":
        return
    keep, drop = [], []
    for i in items:
        (keep if (i.get_closest_marker("serial") is not None) == (phase == "serial") else
         drop).append(i)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_sessionfinish(session, exitstatus):
    # a phase a -m filter left empty (the fast tier has no serial test) is not a failure
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and \
            session.config.getoption("--phase") != "all":
        session.exitstatus = pytest.ExitCode.OK


@pytest.fixture(scope="session")
def smollm2_chat():
    """(AsyncEngine, ServerThread) of the embedded SmolLM2 for the chat-shaped tests (tool
    calling, Responses, Messages): one engine for the session, so its graphs load once."""
    from server_harness import ServerThread

    from maxjax.engine.async_engine import AsyncEngine
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    # test_structured_output.py's engine config: its graphs come from the compile cache
    core = build_core(None, EngineConfig(max_length=512, max_batch_size=16,
                                         max_batch_input_tokens=128, kv_cache_page_size=16,
                                         num_kv_pages=300))
    eng = AsyncEngine(core, core.model.tokenizer, "smollm2", core.model.chat_template)
    eng.start()
    server = ServerThread(eng)
    yield eng, server
    server.close()
    eng.shutdown()


@pytest.fixture(scope="module")
def compiled_graphs(tmp_path_factory) -> str:
    """The step graphs a module's tests compiled into their `seeded_cache`s."""
    return str(tmp_path_factory.mktemp("graphs"))


def _copy_graphs(src: str, dst: str) -> None:
    from maxjax.aot import cache
    for e in cache.entries(src, kind="graphs"):
        if not os.path.exists(os.path.join(dst, e.name)):
            shutil.copytree(e.path, os.path.join(dst, e.name))


@pytest.fixture()
def seeded_cache(tmp_path, monkeypatch, compiled_graphs) -> str:
    """A fresh MAXJAX_CACHE_DIR that starts with copies of the graphs the module's earlier tests
    compiled, and nothing else (no converted weights, no prefetch records): for tests about what
    else the cache holds, so that only the first test of each engine compiles."""
    path = str(tmp_path / "cache")
    monkeypatch.setenv("MAXJAX_CACHE_DIR", path)
    _copy_graphs(compiled_graphs, path)
    yield path
    _copy_graphs(path, compiled_graphs)
