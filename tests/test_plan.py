"""One plan (maxjax/engine/plan.py): `maxjax serve`, `maxjax warm-cache`, maxjax.LLM and both
processes of a multi-host group plan the same engine from the same flags; the flags are frozen
and the plan is made once, without writing into any config."""
from __future__ import annotations

import dataclasses

import pytest

from maxjax.cli.args import build
from maxjax.cli.main import _setup, build_parser
from maxjax.engine.config import EngineConfig, ResolvedConfig
from maxjax.engine.plan import EnginePlan, plan_engine
from maxjax.errors import UserError
from tiny_llama import write_tiny_llama

FLAGS = ["--max-batch-size", "4", "--max-batch-input-tokens", "16", "--max-length", "64",
         "--kv-cache-page-size", "8", "--quantization-encoding", "float32"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("plan") / "tiny")


def parsed(command: str, model_dir: str, *extra: str):
    args = build_parser().parse_args([command, "--model-path", model_dir, *FLAGS, *extra])
    return args, *_setup(args)


@pytest.fixture(scope="module")
def llm_plan(model_dir):
    from maxjax.llm import LLM
    _, model_opts, flags = parsed("generate", model_dir)
    llm = LLM(model_opts.source(), **dataclasses.asdict(flags))
    return llm.core.plan


def test_engine_config_is_frozen():
    cfg = EngineConfig(max_batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_length = 128
    cuda = cfg.for_platform("cuda")
    assert (cfg.max_batch_input_tokens, cuda.max_batch_input_tokens) == (None, 4096)
    assert type(cfg) is EngineConfig and type(cuda) is ResolvedConfig and not cfg.is_default(
        "max_batch_input_tokens")
    assert cuda.given() == cfg.given() and cuda.for_platform("cpu").max_batch_input_tokens == 256
    assert cuda.max_batch_size == 8 and not cuda.is_default("max_batch_size")
    assert cuda.replace(num_kv_pages=9).max_batch_input_tokens == 4096    # still cuda's default
    assert cuda.replace(num_kv_pages=9).is_default("max_batch_input_tokens")


def test_the_plan_leaves_the_flags_as_given(model_dir, llm_plan):
    from maxjax.models.loader import load_model
    flags = EngineConfig(max_batch_size=4, max_batch_input_tokens=16, max_length=64,
                         kv_cache_page_size=8)
    before = dataclasses.asdict(flags)
    plan = plan_engine(flags, load_model(model_dir, "float32", progress=False),
                       kernels=llm_plan.kernels)
    assert dataclasses.asdict(flags) == before and flags.num_kv_pages is None
    assert plan.flags is flags and type(plan.config) is ResolvedConfig
    assert plan.config.num_kv_pages == plan.layout.num_pages
    assert plan.config.quantization_encoding == "float32"
    assert plan == llm_plan


def test_serve_and_llm_plan_the_same(model_dir, llm_plan):
    from maxjax.cli.serve import build_engine
    from maxjax.server.config import ServeConfig
    args, model_opts, flags = parsed("serve", model_dir)
    engine = build_engine(model_opts, flags, build(ServeConfig, args), progress=False)
    try:
        assert isinstance(engine.core.plan, EnginePlan)
        assert engine.core.plan == llm_plan
        assert engine.core.cfg is engine.core.plan.config
    finally:
        engine.shutdown()


def test_warm_cache_plans_what_llm_serves(model_dir, llm_plan, monkeypatch, tmp_path):
    from maxjax.engine import warm
    seen = []

    def record(directory, model, plan, platforms, *a, **k):
        seen.append(plan)
        return {"graphs": [], "compiled_for": None}
    monkeypatch.setattr(warm, "write_artifacts", record)
    args, model_opts, flags = parsed("warm-cache", model_dir)
    assert warm.warm_cache(model_opts, flags, str(tmp_path / "art"), None, 1) == 0
    assert seen == [llm_plan]


def test_a_groups_processes_plan_the_same(model_dir, llm_plan, monkeypatch):
    """Process 0 plans and sends the pool size and max length; a follower builds with them."""
    from maxjax.engine import distributed
    sent = []
    leader = distributed.Leader.__new__(distributed.Leader)
    leader.send_layout = lambda pins, artifacts=False: sent.append((pins, artifacts))
    follower = distributed.Follower.__new__(distributed.Follower)
    follower.receive_layout = lambda artifacts=False: dict(sent[0][0])
    monkeypatch.setattr(distributed, "LeaderExecutor", lambda channel, local: local)
    _, model_opts, flags = parsed("serve", model_dir)
    cores = [distributed.build_group_core(model_opts, flags, c, progress=False)
             for c in (leader, follower)]
    assert sent == [({"num_kv_pages": llm_plan.layout.num_pages,
                      "max_length": llm_plan.layout.max_length}, False)]
    assert cores[0].plan == cores[1].plan == llm_plan


def test_flag_errors_come_before_the_weights(model_dir, monkeypatch):
    from maxjax.engine import build as engine_build
    monkeypatch.setattr(engine_build, "load", lambda *a, **k: pytest.fail("weights loaded"))
    for flags, match in ((EngineConfig(kv_cache_page_size=0), "--kv-cache-page-size"),
                         (EngineConfig(lora_paths=["a=/x"]), "--lora-paths needs --enable-lora"),
                         (EngineConfig(enable_lora=True, lora_paths=["a=/nonexistent"]),
                          "--lora-paths a: /nonexistent: no adapter_config.json"),
                         (EngineConfig(enable_lora=True, lora_paths=["=/x"]),
                          "--lora-paths '=/x': expected PATH or NAME=PATH"),
                         (EngineConfig(chunked_prefill_min_chunk_size=999),
                          "--chunked-prefill-min-chunk-size 999"),
                         # the Python API's values come unparsed
                         (EngineConfig(max_length="big"), "--max-length: must be an integer"),
                         (EngineConfig(enable_prefix_caching="no"),
                          "--enable-prefix-caching: must be true or false"),
                         (EngineConfig(device_memory_utilization="0.5"),
                          "--device-memory-utilization: must be a number")):
        with pytest.raises(UserError, match=match):
            engine_build.build_core(model_dir, flags)


def test_suggest_plans_what_llm_serves(model_dir, llm_plan):
    """`maxjax suggest` plans from the checkpoint's header (an abstract model, no weight read)
    the same Plan that LLM builds from the loaded weights."""
    from maxjax.cli.suggest import suggested_plan
    _, model_opts, flags = parsed("suggest", model_dir)
    assert suggested_plan(model_opts, flags) == llm_plan


def test_pins_are_adopted_once_in_the_planner_over_what_the_user_left_unset():
    """Pins (artifacts, a group's process 0, replica 0) meet the flags in `prepare` alone: a
    value the user left unset takes the pinned one, platform defaults included; a value the
    user chose and the pins differ from is refused, even one equal to the platform default;
    another plan's pins (no refusal) are the same flags planned, adopted."""
    from maxjax.engine.pins import Pins
    from maxjax.engine.plan import prepare
    pins = Pins({"max_length": 32, "max_batch_size": 2},
                lambda k, have, want: f"--{k} {have}: pinned {want}")
    p = prepare(EngineConfig(), pins=pins, kernels=False)
    assert (p.config.max_length, p.config.max_batch_size) == (32, 2)
    assert p.flags == EngineConfig() and p.flags.max_length is None
    for chosen, line in (({"max_length": 64}, "--max_length 64: pinned 32"),
                         ({"max_batch_size": 32}, "--max_batch_size 32: pinned 2")):
        with pytest.raises(UserError, match=f"^{line}$"):
            prepare(EngineConfig(**chosen), pins=pins, kernels=False)
    assert prepare(EngineConfig(max_length=64), pins={"max_length": 32},
                   kernels=False).config.max_length == 32
    assert prepare(EngineConfig(max_length=32), pins=pins, kernels=False).config.max_length == 32


def test_a_serve_start_checks_the_flags_once(model_dir, llm_plan, monkeypatch):
    """`maxjax serve`'s early prefetch makes the plan's first half and the engine is built from
    it: the flags are checked (and the kernels chosen) once per start, not once per step of it."""
    from maxjax.cli.serve import build_engine
    from maxjax.engine import plan
    from maxjax.engine.build import prefetch_early
    from maxjax.server.config import ServeConfig
    calls = []
    check = plan.check_flags
    monkeypatch.setattr(plan, "check_flags", lambda cfg: calls.append(cfg) or check(cfg))
    args, model_opts, flags = parsed("serve", model_dir)
    prepared = prefetch_early(model_opts.source(), flags, compile_cache=False)
    engine = build_engine(model_opts, flags, build(ServeConfig, args), progress=False,
                          prepared=prepared)
    try:
        assert len(calls) == 1 and engine.core.plan == llm_plan
    finally:
        engine.shutdown()
