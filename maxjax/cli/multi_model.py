"""`maxjax serve` with several models (`--model A --model B`, or --models-file): each its own
engine, built by `start_model` when a request first names it (server/router.py decides when).

A models file is YAML or JSON: a list (or {"models": [...]}) of entries, each `name` (what
requests send as "model"; default: its model path as given) and any model or engine flag of
`serve` (`model`, `max_length`, `quantization_encoding`, `precompiled_artifacts`, `lora_modules`,
`draft_model_path`...), plus the per-model server flags in SERVER_KEYS. An entry's flags go over
the command line's, which every model shares."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from maxjax.cli.args import ModelOptions, config_values, read_yaml_or_json
from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError

GiB = float(1 << 30)

# the server flags that are a model's own (the rest are the server's: host, port, api_key...)
SERVER_KEYS = ("tool_parser", "reasoning_parser", "enable_tool_call_constrained_decode",
               "emit_reasoning_content", "temperature", "top_k")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model: ModelOptions
    engine: EngineConfig
    server: dict            # SERVER_KEYS this model sets


def start_model(spec: ModelSpec, serve_cfg):
    """The started engine of one model: the one line to change when start-up becomes
    plan + build."""
    from maxjax.cli.serve import build_engine
    return build_engine(spec.model, spec.engine, serve_cfg)


def model_specs(args, model_opts: ModelOptions, engine_cfg: EngineConfig,
                serve_cfg) -> list[ModelSpec] | None:
    """The models `serve` was given, each with its flags over the command line's; None: one
    model (`--model` at most once and no --models-file), served as it always was."""
    paths = getattr(args, "model_path_all", [])
    if serve_cfg.models_file:
        if len(paths) > 1:
            raise UserError("--models-file: give the models there, not also as --model")
        entries = _read_models_file(serve_cfg.models_file)
        where = f"--models-file {serve_cfg.models_file}"
    elif len(paths) > 1:
        entries, where = [{"model": p} for p in paths], "--model"
    else:
        for flag in ("max_loaded_models", "models_memory_budget"):
            if getattr(serve_cfg, flag) is not None:
                raise UserError(f"--{flag.replace('_', '-')}: serves several models (repeat "
                                "--model or give --models-file)")
        return None
    from maxjax.models.loader import EMBEDDED_NAME
    specs = []
    for i, entry in enumerate(entries):
        entry = dict(entry)
        name = entry.pop("name", None)
        values = config_values(entry, args.command_parser, f"{where}: model {i + 1}")
        model_keys = {f.name for f in dataclasses.fields(ModelOptions)}
        engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
        other = sorted(set(values) - model_keys - engine_keys - set(SERVER_KEYS))
        if other:
            raise UserError(f"{where}: model {i + 1}: {', '.join(other)} is the server's, not a "
                            f"model's: give it on the command line")
        opts = dataclasses.replace(model_opts, **{k: v for k, v in values.items()
                                                  if k in model_keys})
        cfg = engine_cfg.replace(**{k: v for k, v in values.items() if k in engine_keys})
        if opts.precompiled_artifacts:
            from maxjax.aot.load import adopt_chat_template, adopt_flags
            opts.model_path, cfg = adopt_flags(opts.precompiled_artifacts, opts.model_path, cfg)
            opts.chat_template = adopt_chat_template(opts.precompiled_artifacts,
                                                     opts.chat_template)
        name = str(name) if name else (opts.model_path or EMBEDDED_NAME)
        if any(s.name == name for s in specs):
            raise UserError(f"{where}: two models are named {name!r}: give each a `name`")
        specs.append(ModelSpec(name, opts, cfg, {k: v for k, v in values.items()
                                                 if k in SERVER_KEYS}))
    if serve_cfg.served_model_name:
        raise UserError("--served-model-name: with several models each has its `name` "
                        "(--models-file)")
    return specs


def _read_models_file(path: str) -> list[dict]:
    data = read_yaml_or_json(path, "--models-file")
    if isinstance(data, dict) and set(data) == {"models"}:
        data = data["models"]
    if not isinstance(data, list) or not data or not all(isinstance(e, dict) for e in data):
        raise UserError(f"--models-file {path}: expected a list of models, each a mapping "
                        "of `name` and flags")
    return data


@dataclass(frozen=True)
class PlannedModel:
    spec: ModelSpec                 # its flags, a default KV pool pinned at its share
    memory: object | None           # its ModelMemory; None: its plan failed (`error`)
    error: str | None = None


def plan_memory(specs: list[ModelSpec], serve_cfg):
    """(each model's PlannedModel, the MemoryBudget): maxjax/engine/model_memory.py, each
    model planned as `maxjax suggest` plans it; a model whose plan fails keeps its flags (its
    load will say why)."""
    from maxjax.aot.cache import size_bytes
    from maxjax.cli.suggest import empty_report, plan_into
    from maxjax.engine import model_memory
    from maxjax.models import source
    flag = serve_cfg.models_memory_budget
    budget = model_memory.budget(
        None if flag is None else size_bytes(flag, "--models-memory-budget"),
        [s.engine.device_memory_utilization for s in specs], len(specs),
        serve_cfg.max_loaded_models)
    out = []
    for spec in specs:
        cfg = model_memory.share_flags(spec.engine, budget)
        shared = cfg is not spec.engine
        opts = dataclasses.replace(spec.model, compile_cache=False)  # no lookup: bytes only
        try:
            files = source.resolve(opts.source(), cfg.quantization_encoding)
            report = empty_report(opts, files.config, [])
            plan_into(report, opts, cfg, {}, set(), files)
        except UserError as e:
            out.append(PlannedModel(spec, None, f"{e}{SHARE_ADVICE.format(budget.share / GiB)}"
                                    if shared else str(e)))
            continue
        need = model_memory.model_memory(report, shared)
        out.append(PlannedModel(dataclasses.replace(
            spec, engine=model_memory.pinned(spec.engine, need.num_kv_pages)), need))
    return out, budget


SHARE_ADVICE = (" (its KV pool was planned from {:.3f} GiB, its share of the models' memory "
                "budget: give it --num-kv-pages, raise --models-memory-budget or lower "
                "--max-loaded-models)")


def plan_lines(planned: list[PlannedModel], budget) -> list[tuple[bool, str]]:
    """The memory plan as the start-up log and `maxjax suggest --models-file` give it: (a
    warning, the line)."""
    lines = [(False, budget.line())]
    for p in planned:
        if p.memory is None:
            lines.append((True, f"model {p.spec.name}: no memory plan: {p.error}"))
        elif p.memory.bytes > budget.bytes:
            lines.append((True, f"model {p.spec.name}: {p.memory.line()} (over the budget "
                                "alone: its requests get a 503)"))
        else:
            lines.append((False, f"model {p.spec.name}: {p.memory.line()}"))
    return lines


def suggest_models(specs: list[ModelSpec], serve_cfg, as_json: bool) -> int:
    """`maxjax suggest --models-file` (or --model repeated): each model's planned bytes and the
    budget they share; 1 when a model has no plan or the first is over the budget (serve
    refuses to start)."""
    import json
    planned, budget = plan_memory(specs, serve_cfg)
    if as_json:
        print(json.dumps({"budget_bytes": budget.bytes, "budget": budget.how,
                          "loaded_at_once": budget.loaded_at_once, "models": [
                              {"name": p.spec.name, "error": p.error} if p.memory is None else
                              {"name": p.spec.name, "planned_bytes": p.memory.bytes,
                               **dataclasses.asdict(p.memory),
                               "fits_budget": p.memory.bytes <= budget.bytes}
                              for p in planned]}, indent=2))
    else:
        print("\n".join(line for _, line in plan_lines(planned, budget)))
    first = planned[0].memory
    bad = any(p.memory is None for p in planned) or first.bytes > budget.bytes
    return 1 if bad else 0


def router_of(specs: list[ModelSpec], serve_cfg, start=start_model):
    import logging

    from maxjax.server.router import ModelRouter, model_slots
    planned, budget = plan_memory(specs, serve_cfg)
    log = logging.getLogger("maxjax.server.router")
    for warn, line in plan_lines(planned, budget):
        log.log(logging.WARNING if warn else logging.INFO, "%s", line)
    slots = model_slots([(p.spec.name, p.spec, p.spec.server) for p in planned], start,
                        serve_cfg)
    for slot, p in zip(slots, planned):
        slot.memory = p.memory
    return ModelRouter(slots, serve_cfg.max_loaded_models, budget.bytes)


def serve_models(specs: list[ModelSpec], serve_cfg) -> int:
    """Serve until SIGTERM/SIGINT: the first model loads at start (/health turns 200 when it
    serves), the others on their first request."""
    import asyncio

    from maxjax.cli.serve import settle_heap
    from maxjax.server.app import run_server
    router = router_of(specs, serve_cfg)
    failure: list[BaseException] = []
    held: dict = {}

    def load():
        try:
            router.start_first()
            settle_heap()
        except BaseException as e:  # reported on the main thread
            failure.append(e)
            held["loop"].call_soon_threadsafe(held["stop"].set)

    async def main():
        held.update(loop=asyncio.get_running_loop(), stop=asyncio.Event())
        loader = threading.Thread(target=load, name="maxjax-load", daemon=True)
        await run_server(router, serve_cfg, stop=held["stop"], on_listen=loader.start)

    try:
        asyncio.run(main())
    finally:
        router.shutdown()
    if failure:
        if isinstance(failure[0], (UserError, ValueError)):
            raise UserError(str(failure[0]))
        raise failure[0]
    return 0
