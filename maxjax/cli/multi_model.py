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
        if serve_cfg.max_loaded_models is not None:
            raise UserError("--max-loaded-models: serves several models (repeat --model or "
                            "give --models-file)")
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


def router_of(specs: list[ModelSpec], serve_cfg, start=start_model):
    from maxjax.server.router import ModelRouter, model_slots
    return ModelRouter(model_slots([(s.name, s, s.server) for s in specs], start, serve_cfg),
                       serve_cfg.max_loaded_models)


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
