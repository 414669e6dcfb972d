"""maxjax's CPU kernels by default (maxjax/engine/plan.choose_kernels): on wherever they run,
one log line naming why where they do not (MAXJAX_CPU_ISA=none stands for a CPU without the
instructions), required by --use-experimental-kernels, off with --no-use-experimental-kernels;
quantized weights on them get a bfloat16 KV pool by default;
artifacts and compile cache entries record the kernels' instruction set, and artifacts built for
another are refused naming it."""
import logging

import pytest

import quant_reference as ref
from maxjax.aot import manifest as mf
from maxjax.engine.plan import choose_kernels
from maxjax.engine.config import EngineConfig
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from maxjax.graphs import cpu_kernels
from maxjax.models.loader import load_model
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

needs_kernels = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                   reason=f"CPU kernels: {cpu_kernels.unavailable()}")
PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [300, 2, 2, 77]]
NEW_TOKENS = 6
ENGINE = dict(max_batch_size=2, max_batch_input_tokens=4, max_length=64, num_kv_pages=24,
              kv_cache_page_size=8, compile_cache=False)
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_tiny_llama(str(tmp_path_factory.mktemp("k") / "hf")), "int8",
                      progress=False)


@pytest.fixture(scope="module")
def want(tiny):
    return [ref.greedy(tiny.config, tiny.params, p, NEW_TOKENS)[1] for p in PROMPTS]


def test_default_resolves_to_where_they_run(caplog):
    cfg = EngineConfig()
    assert cfg.use_experimental_kernels is None
    assert choose_kernels(cfg) is (cpu_kernels.unavailable() is None)
    with caplog.at_level(logging.INFO, logger="maxjax.engine"):
        assert choose_kernels(EngineConfig(use_experimental_kernels=False)) is False
    assert "CPU kernels off: --no-use-experimental-kernels; XLA's path runs" in caplog.text
    assert choose_kernels(cfg, pinned=False) is False     # artifacts built without them


def test_without_the_instructions_one_line_and_required_is_an_error(monkeypatch, caplog):
    monkeypatch.setenv("MAXJAX_CPU_ISA", "none")
    why = cpu_kernels.unavailable()
    assert why and "MAXJAX_CPU_ISA=none" in why
    cfg = EngineConfig()
    with caplog.at_level(logging.INFO, logger="maxjax.engine"):
        assert choose_kernels(cfg) is False
    lines = [r.getMessage() for r in caplog.records if "CPU kernels" in r.getMessage()]
    assert lines == [f"CPU kernels off: {why}; XLA's path runs"]
    with pytest.raises(UserError, match=f"^--use-experimental-kernels: {why}$"):
        choose_kernels(EngineConfig(use_experimental_kernels=True))


def test_a_failed_build_says_why_in_a_line(tmp_path):
    src = tmp_path / "broken.cc"
    src.write_text("int f() { return }\n")
    why = cpu_kernels._build("g++", [], [str(src)], str(tmp_path / "lib.so"))
    assert why.startswith("building it failed: ") and "error" in why and "\n" not in why
    assert cpu_kernels._build("false", [], [str(src)], str(tmp_path / "lib.so")) == \
        "building it failed: false exited with 1"


def test_off_on_a_mesh_and_for_another_platform(caplog):
    cfg = EngineConfig(devices="cpu:2")
    with caplog.at_level(logging.INFO, logger="maxjax.engine"):
        assert choose_kernels(cfg) is False
    assert "CPU kernels off: they run on one device per replica (--devices cpu:2)" in caplog.text
    with pytest.raises(UserError, match="--use-experimental-kernels: they run on one device"):
        choose_kernels(EngineConfig(devices="cpu:2", use_experimental_kernels=True))
    assert choose_kernels(EngineConfig(devices="cpu:4", data_parallel_degree=2)) is False
    assert choose_kernels(EngineConfig(), platforms=["cuda"]) is False
    with pytest.raises(UserError, match="they are for the CPU"):
        choose_kernels(EngineConfig(use_experimental_kernels=True), platforms=["cuda", "cpu"])


@needs_kernels
def test_default_engine_runs_the_kernels(tiny, want):
    from maxjax.engine.async_engine import kernels_info
    from maxjax.llm import LLM
    llm = LLM(tiny, **ENGINE)
    assert llm.engine_config.use_experimental_kernels is True
    assert cpu_kernels.kernels_of(llm.core.model.params) == [cpu_kernels.INT8_LINEAR]
    assert llm.core.layout.attention == "cpu_paged_kernel"
    assert llm.core.layout.kv_dtype == "bfloat16"     # quantized weights on the kernel
    assert kernels_info(llm.core) == {"isa": cpu_kernels.isa(), "extension": cpu_kernels.extension(),
                                      "linear": [cpu_kernels.INT8_LINEAR], "attention": True}
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_kv_format_defaults_to_bfloat16_only_for_quantized_weights_on_the_kernel(tiny,
                                                                                  tmp_path):
    from maxjax.engine.plan import plan_layout
    from maxjax.graphs.attention import choose_backend
    cfg = EngineConfig(**{k: v for k, v in ENGINE.items() if k != "compile_cache"})
    assert plan_layout(cfg.replace(use_experimental_kernels=True), tiny).kv_dtype == "bfloat16"
    assert plan_layout(cfg.replace(use_experimental_kernels=True,
                                   kv_cache_format="float32"), tiny).kv_dtype == "float32"
    assert plan_layout(cfg.replace(use_experimental_kernels=False), tiny).kv_dtype == "float32"
    float32 = load_model(write_tiny_llama(str(tmp_path / "f32")), "float32", progress=False)
    lay = plan_layout(cfg.replace(use_experimental_kernels=True), float32)
    assert lay.attention == "cpu_paged_kernel" and lay.kv_dtype == "float32"
    assert choose_backend("cpu", 64, 8, kernels=False).quantized_kv_format is None


def test_fallback_serves_the_same(tiny, want, monkeypatch):
    from maxjax.engine.async_engine import kernels_info
    from maxjax.llm import LLM
    monkeypatch.setenv("MAXJAX_CPU_ISA", "none")
    llm = LLM(tiny, **ENGINE)
    assert llm.engine_config.use_experimental_kernels is False
    assert cpu_kernels.kernels_of(llm.core.model.params) == []
    assert llm.core.layout.attention != "cpu_paged_kernel" and kernels_info(llm.core) is None
    assert llm.core.layout.kv_dtype == "float32"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


@pytest.mark.skipif(any(cpu_kernels.unavailable(isa) for isa in cpu_kernels.ISAS),
                    reason="needs every kernel ISA on this CPU")
def test_artifacts_record_the_isa(tiny, want, tmp_path, monkeypatch):
    from maxjax.aot.export import export_engine
    from maxjax.llm import LLM
    monkeypatch.setenv("MAXJAX_CPU_ISA", "avx512")
    llm = LLM(tiny, **ENGINE)
    export_engine(str(tmp_path / "art"), llm.core)
    pinned = mf.read_manifest(str(tmp_path / "art"), "x").data
    assert pinned["model"]["kernel_isa"] == pinned["engine"]["kernel_isa"] == "avx512"
    monkeypatch.setenv("MAXJAX_CPU_ISA", "avx2")
    with pytest.raises(UserError, match="kernel_isa: .*avx512, this run's for avx2"):
        LLM(tiny, precompiled_artifacts=[str(tmp_path / "art")], **ENGINE)
    # the compile cache keys on it: the other ISA's engine is another entry (compiled anew)
    assert mf.engine_fingerprint(llm.core.layout, llm.engine_config, "int8")["kernel_isa"] == \
        "avx2"
    avx2 = LLM(tiny, **ENGINE)
    assert [o.token_ids for o in avx2.generate(PROMPTS, GREEDY)] == want


@needs_kernels
def test_data_parallel_replicas_run_them_on_their_own_device(tiny, want, tmp_path,
                                                             monkeypatch):
    """--data-parallel-degree 2 over two devices: each replica's packed weights and KV pool sit
    on its own device; the second replica runs the executables the first compiled (one compile
    cache entry, loaded onto its device), and concurrent requests on both answer as one device
    does."""
    import asyncio

    import jax

    from maxjax.aot import cache
    from maxjax.engine import compile_counter
    from maxjax.engine.async_engine import AsyncEngine, kernels_info
    from maxjax.engine.build import build_core
    from maxjax.engine.replicas import ReplicatedEngine
    monkeypatch.setenv("MAXJAX_CACHE_DIR", str(tmp_path))
    flags = EngineConfig(devices="cpu:2", data_parallel_degree=2,
                         **{k: v for k, v in ENGINE.items() if k != "compile_cache"})
    assert choose_kernels(flags) is True
    cores, compiles = [], []
    for i in range(2):
        before = compile_counter.count()
        cores.append(build_core(tiny, flags, replica=i))
        compiles.append(compile_counter.count() - before)
    assert compiles[0] > 0 and compiles[1] == 0, compiles
    assert len(cache.entries(str(tmp_path), kind="graphs")) == 1
    for i, core in enumerate(cores):
        assert kernels_info(core)["linear"] == [cpu_kernels.INT8_LINEAR]
        assert {d for a in jax.tree.leaves(core.model.params) for d in a.devices()} == \
            {jax.devices()[i]}
    engine = ReplicatedEngine([AsyncEngine(c, c.model.tokenizer, "tiny", None) for c in cores])
    engine.start()

    async def one(i):
        ids = []
        async for out in engine.generate(f"r{i}", PROMPTS[i % 2], GREEDY):
            ids += out.new_token_ids
        return ids

    async def all_four():
        return await asyncio.gather(*(one(i) for i in range(4)))
    try:
        assert asyncio.run(all_four()) == [want[i % 2] for i in range(4)]
        assert min(s.routed for s in engine.stats().replicas) >= 1
    finally:
        engine.shutdown()
