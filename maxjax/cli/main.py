"""The `maxjax` command: serve, suggest, warm-cache, generate, cache, list, benchmark.

User errors (bad flag, model, checkpoint, artifact) print one line and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
import time

from maxjax import cache_home, transformers_index
from maxjax.cli import reference_flags
from maxjax.cli.args import (GenerateOptions, ModelOptions, SamplingFlags, add_dataclass_args,
                             build, grammar_spec, read_config_file,
                             sampling_params)
from maxjax.engine.config import EngineConfig
from maxjax.engine.distributed import DistributedOptions
from maxjax.errors import RequestError, UserError


def _setup(args, register: bool = True) -> tuple[ModelOptions, EngineConfig]:
    """The model options and engine config of a model command, JAX started on its platform;
    `register`: the --custom-architectures registered (suggest does it itself, to report)."""
    base = _config_file(args)
    reference_flags.check(build(reference_flags.ReferenceOnly, args, base))
    model_opts = build(ModelOptions, args, base)
    cache_home.check(model_opts.compile_cache)
    level = getattr(logging, model_opts.log_level.upper(), logging.INFO)
    prefix = (model_opts.log_prefix or "").replace("%", "%%")
    logging.basicConfig(level=level,
                        format=prefix + "%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries(level)
    engine_cfg = build(EngineConfig, args, base)
    if model_opts.precompiled_artifacts and args.command != "warm-cache":
        from maxjax.aot.load import adopt_chat_template, adopt_flags
        model_opts.model_path, engine_cfg = adopt_flags(model_opts.precompiled_artifacts,
                                                        model_opts.model_path, engine_cfg)
        model_opts.chat_template = adopt_chat_template(model_opts.precompiled_artifacts,
                                                       model_opts.chat_template)
    from maxjax.engine import devices, distributed
    group = build(distributed.DistributedOptions, args, base).resolved()
    if group is not None and args.command not in ("serve", "warm-cache"):
        raise UserError(f"--num-processes: multi-host runs `maxjax serve` and `maxjax "
                        f"warm-cache` only (not {args.command})")
    args.group = group
    devices.select_platform(engine_cfg.devices,
                            start=group and (lambda: distributed.initialize(group)),
                            draft=engine_cfg.draft_devices)
    if engine_cfg.draft_devices is not None:     # another platform, or devices it lacks: now
        from maxjax.engine.draft import draft_mesh
        draft_mesh(engine_cfg)
    from maxjax.models import registry
    for spec in model_opts.custom_architectures if register else ():
        registry.register_custom(spec)
    return model_opts, engine_cfg


def _quiet_libraries(level: int) -> None:
    """Above DEBUG, other libraries' start-up notes nobody can act on (jax's `Unable to
    initialize backend 'tpu'`) are not shown: only their warnings and errors."""
    if level > logging.DEBUG:
        for name in ("jax", "absl"):
            logging.getLogger(name).setLevel(max(level, logging.WARNING))


def _config_file(args) -> dict:
    """The --config-file's values as the command's own flags parse them ({} without one); read
    once per command (its model, engine and server settings are built apart)."""
    if "config_values" not in vars(args):
        path = getattr(args, "config_file", None)
        args.config_values = read_config_file(path, args.command_parser) if path else {}
    return args.config_values


def cmd_list(args) -> int:
    from maxjax.models import registry
    for spec in getattr(args, "custom_architectures", None) or []:
        registry.register_custom(spec)
    from maxjax.models import quantize
    archs = sorted(registry.architectures().values(), key=lambda a: a.name)

    def facts(a) -> dict:
        """What a family serves: its tasks, the loaders that read it, its encodings (4-bit
        blocks come from GGUF files only)."""
        return {"name": a.name, "tasks": ["text", "vision"] if a.vision else ["text"],
                "loaders": ["hf", "gguf"] if a.gguf_archs else ["hf"],
                "encodings": list(quantize.ENCODINGS if a.gguf_archs else
                                  (*quantize.FLOAT_ENCODINGS, "int8")),
                "gguf_archs": list(a.gguf_archs), "state": a.state,
                "request_state": a.request_state, "description": a.description}
    rows = [facts(a) for a in archs]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        gguf = f" [gguf: {', '.join(r['gguf_archs'])}]" if r["gguf_archs"] else ""
        print(f"{r['name']:<{width}}  {'+'.join(r['tasks']):<11}  {r['description']}{gguf}\n"
              f"{'':<{width}}  encodings: {', '.join(r['encodings'])}; state: {r['state']}"
              f"{' + ' + r['request_state'] + ' a request' if r['request_state'] else ''}")
    return 0


def _prompt_line(obj, chat: bool, where: str):
    """One --prompts-file line's prompt: a JSON string, or an object with a 'prompt' (a
    string or a list of token ids) or, with --chat, 'messages' (a list of messages)."""
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict):
        raise UserError(f"{where}: a JSON object with a 'prompt' field, or a JSON string")
    if chat and "messages" in obj:
        if not isinstance(obj["messages"], list):
            raise UserError(f"{where}: 'messages' must be a list of messages")
        return obj["messages"]
    if "messages" in obj and "prompt" not in obj:
        raise UserError(f"{where}: 'messages' is a chat: add --chat")
    item = obj.get("prompt")
    if item is None:
        raise UserError(f"{where}: needs a 'prompt' (or, with --chat, 'messages') field")
    tokens = isinstance(item, list) and item and all(
        isinstance(t, int) and not isinstance(t, bool) for t in item)
    if not (isinstance(item, str) or tokens and not chat):
        raise UserError(f"{where}: 'prompt' must be a string"
                        f"{'' if chat else ' or a non-empty list of token ids'}")
    return item


def _read_prompts(gen: GenerateOptions) -> list:
    prompts = list(gen.prompt)
    if gen.prompts_file:
        try:
            with open(gen.prompts_file) as f:
                lines = [ln for ln in f if ln.strip()]
        except OSError as e:
            raise UserError(f"--prompts-file {gen.prompts_file}: {e.strerror}") from e
        for i, line in enumerate(lines, 1):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"--prompts-file line {i}: not JSON ({e})") from e
            prompts.append(_prompt_line(obj, gen.chat, f"--prompts-file line {i}"))
    if not prompts:
        raise UserError("generate needs --prompt TEXT or --prompts-file FILE")
    return prompts


def cmd_generate(args) -> int:
    model_opts, engine_cfg = _setup(args)
    gen = build(GenerateOptions, args)
    from maxjax.engine.validate import check_params
    from maxjax.llm import LLM
    params = sampling_params(args)
    params.structured_output = grammar_spec(gen)
    try:
        check_params(params)
    except RequestError as e:
        raise UserError(f"--{e.param.replace('_', '-')}: {e.reason}") from e
    prompts = _read_prompts(gen)
    llm = LLM(model_opts.source(), chat_template=model_opts.chat_template,
              precompiled_artifacts=model_opts.precompiled_artifacts,
              require_compiled_artifacts=model_opts.require_compiled_artifacts,
              compile_cache=model_opts.compile_cache,
              compile_cache_max_size=model_opts.compile_cache_max_size,
              progress=not gen.json, **engine_cfg.given())
    if gen.chat:
        if not llm.model.chat_template:
            raise UserError("--chat: this model has no chat template; pass --chat-template FILE")
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        token_prompts = []
        for k, p in enumerate(prompts, 1):
            try:
                token_prompts.append(llm.apply_chat_template(p))
            except ValueError as e:
                raise UserError(f"chat {k}: {e}") from e
    else:
        token_prompts = prompts
    try:
        outs = llm.generate(token_prompts, params)
    except RequestError as e:
        raise UserError(f"{e.param}: {e.reason}" if e.param.startswith("--") else str(e)) from e
    except ValueError as e:
        raise UserError(str(e)) from e
    if model_opts.export_artifacts:
        from maxjax.aot import export as aot_export
        aot_export.export_engine(model_opts.export_artifacts, llm.core,
                                  model_opts.compile_cache, model_opts.chat_template)
    if gen.profile:
        print(llm.profile_report(), file=sys.stderr)
    stats = llm.stats()
    logging.getLogger("maxjax.generate").info(
        "xla compiles: %d total, %d since ready", stats.xla_compiles,
        stats.xla_compiles_since_ready)
    for prompt, out in zip(prompts, outs):
        if gen.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "usage": out.usage}))
        else:
            print(out.text if gen.chat else f"{prompt}{out.text}")
            print(f"--- [{out.finish_reason}; {out.usage['completion_tokens']} tokens]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    # A start allocates millions of objects that live as long as the server and frees few; the
    # collector's passes over them took ~0.4 s of a 2.8 s warm start. It is off until the
    # engine is built, which then collects once and freezes them (maxjax/cli/serve.py), and
    # so are glibc's fastbins (serve.fastbins).
    from maxjax.cli.serve import fastbins
    gc.disable()
    fastbins(False)
    try:
        return _serve(args)
    finally:
        gc.enable()
        fastbins(True)


def _serve(args) -> int:
    model_opts, engine_cfg = _setup(args)
    from maxjax.server.config import ServeConfig
    base = _config_file(args)
    serve_cfg = build(ServeConfig, args, base)
    from maxjax.cli import multi_model
    specs = multi_model.model_specs(args, model_opts, engine_cfg, serve_cfg)
    if specs is not None:
        if args.group is not None:
            raise UserError("--num-processes: a multi-host group serves one model")
        return multi_model.serve_models(specs, serve_cfg)
    prepared = None
    if args.group is None:
        from maxjax.engine.build import prefetch_early
        prepared = prefetch_early(model_opts.source(), engine_cfg, model_opts.chat_template,
                                  model_opts.compile_cache, model_opts.precompiled_artifacts)
    if args.pretty_print_config:
        print(json.dumps({"model": dataclasses.asdict(model_opts), "engine": dataclasses.asdict(engine_cfg),
                          "server": {k: ("***" if k == "api_key" and v else v)
                                     for k, v in dataclasses.asdict(serve_cfg).items()}}, indent=2))
    from maxjax.cli.serve import serve
    return serve(model_opts, engine_cfg, serve_cfg, args.group, prepared)


def _server_flags(args):
    """suggest and warm-cache take serve's server flags (a `maxjax serve` command line or
    config file as it is): checked as serve checks them; they shape no graph (suggest reads
    the several models' ones)."""
    from maxjax.server.config import ServeConfig
    return build(ServeConfig, args, _config_file(args))


def cmd_suggest(args) -> int:
    from maxjax.cli import suggest
    model_opts, engine_cfg = _setup(args, register=False)
    serve_cfg = _server_flags(args)
    from maxjax.cli import multi_model
    specs = multi_model.model_specs(args, model_opts, engine_cfg, serve_cfg)
    if specs is not None:
        return multi_model.suggest_models(specs, serve_cfg, args.json)
    return suggest.run(args, model_opts, engine_cfg)


def cmd_warm_cache(args) -> int:
    model_opts, engine_cfg = _setup(args)
    _server_flags(args)
    from maxjax.engine import warm
    return warm.warm_cache(model_opts, engine_cfg, args.artifacts_dir, args.target, args.jobs,
                                 args.store_weights)


def cmd_cache(args) -> int:
    from maxjax.aot import cache
    root = cache.directory()
    if args.action == "clear":
        n, size = cache.clear(root)
        print(f"removed {n} entries ({size / 1e6:.1f} MB) from {root}")
        return 0
    found = cache.entries(root)
    if args.json:
        print(json.dumps({"directory": root, "max_bytes": cache.max_bytes(), "entries": [
            {"name": e.name, "kind": e.kind, "bytes": e.bytes, "graphs": e.graphs,
             "model": e.model, "device": e.device, "last_used": e.last_used}
            for e in reversed(found)]}, indent=2))
        return 0
    print(f"compile cache: {root} ({len(found)} entries, "
          f"{sum(e.bytes for e in found) / 1e6:.1f} MB; cap {cache.max_bytes() / 2**30:.1f} GiB)")
    for e in reversed(found):       # most recently used first
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        what = f"{e.graphs:3d} graphs" if e.kind == "graphs" else "converted weights"
        print(f"{e.name}  {e.bytes / 1e6:8.1f} MB  {what}  {e.device}  last used {used}")
    return 0


def cmd_benchmark(args) -> int:
    from maxjax.bench import command as benchmark
    return benchmark.main(args)


class Parser(argparse.ArgumentParser):
    """A bad command line is one line on stderr (exit 2), not argparse's usage block."""

    def error(self, message):
        self.exit(2, f"{failure_line(self.prog.split()[-1], message)} (see {self.prog} --help)\n")


# What `max serve`'s users grep a start-up log for (reference/serve-model-skill.txt) to fail fast.
FAILURE_WORDS = ("Traceback", "CRASHED", "Error building", "cannot be found", "not found in registry")


def failure_line(command: str, message: str) -> str:
    """`maxjax: error: ...`; a failed start of a server or a model says `Error building` unless
    the message already holds one of the words a readiness loop watches for."""
    if command == "serve" and \
            not any(w.lower() in message.lower() for w in FAILURE_WORDS):
        message = f"Error building the server: {message}"
    return f"maxjax: error: {message}"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="maxjax", description="LLM inference on JAX/XLA with an "
               "OpenAI-compatible server.")
    p.add_argument("--version", action="version", version=f"maxjax {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def model_cmd(name, help_text):
        sp = sub.add_parser(name, help=help_text, description=help_text,
                            usage=f"maxjax {name} [flags]")
        add_dataclass_args(sp, ModelOptions, "model")
        add_dataclass_args(sp, EngineConfig, "engine")
        add_dataclass_args(sp, DistributedOptions, "multi-host")
        add_dataclass_args(sp, reference_flags.ReferenceOnly,
                           "max serve flags for what maxjax does not have (refused but at "
                           "their defaults)")
        sp.add_argument("--config-file", help="YAML or JSON file of flag values (the command line wins)")
        sp.set_defaults(command_parser=sp)
        return sp

    sp = model_cmd("serve", "Serve a model over the OpenAI API")
    from maxjax.server.config import ServeConfig
    add_dataclass_args(sp, ServeConfig, "server")
    sp.add_argument("--pretty-print-config", action="store_true", help="Print the resolved configuration")
    sp.set_defaults(func=cmd_serve)

    sp = model_cmd("generate", "Generate text offline")
    add_dataclass_args(sp, GenerateOptions, "generation")
    add_dataclass_args(sp, SamplingFlags, "sampling")
    sp.set_defaults(func=cmd_generate)

    sp = model_cmd("suggest", "Inspect a model and print the `maxjax serve` command for it: "
                   "architecture, parameters, encodings, this machine's memory plan, compile "
                   "cache, notes (reads the config only: no weights, no compile)")
    add_dataclass_args(sp, ServeConfig, "server (carried into the command)")
    sp.add_argument("--json", action="store_true", help="Print one JSON object")
    sp.set_defaults(func=cmd_suggest, log_level="WARNING")

    sp = model_cmd("warm-cache", "Compile every graph for a config and save the artifacts")
    add_dataclass_args(sp, ServeConfig, "server (serve's, so that its command line works here; "
                       "they shape no graph)")
    sp.add_argument("--artifacts-dir", help="Where to write (default: the compile cache, "
                    "which serve, generate and maxjax.LLM read)")
    sp.add_argument("--target", action="extend", nargs="+", default=None,
                    help="Platforms to export for: cpu, cuda, rocm, tpu (default: this machine's)")
    sp.add_argument("--jobs", type=int, default=None,
                    help="Parallel compilations (default: 2, or 1 on a one-core machine)")
    sp.add_argument("--store-weights", action=argparse.BooleanOptionalAction, default=None,
                    help="Store the converted weights in the artifacts (orbax), so that "
                    "serving from them converts no checkpoint (default: on; the compile "
                    "cache never stores them)")
    sp.set_defaults(func=cmd_warm_cache)

    sp = sub.add_parser("cache", help="Show or empty the compile cache ($MAXJAX_CACHE_DIR)")
    sp.add_argument("action", choices=["list", "clear"])
    sp.add_argument("--json", action="store_true", help="list: the entries as JSON")
    sp.set_defaults(func=cmd_cache)

    sp = sub.add_parser("list", help="List the supported architectures")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--custom-architectures", action="extend", nargs="+")
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("benchmark", help="Benchmark an OpenAI-compatible server")
    from maxjax.bench import flags as benchmark_flags
    benchmark_flags.add_args(sp)
    sp.set_defaults(func=cmd_benchmark)
    return p


def _version() -> str:
    from maxjax import __version__
    return __version__


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' "PyTorch was not found" advice: maxjax needs only its tokenizers
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        parser.error(f"unrecognized argument {argv[0]}: the command comes first "
                     f"(maxjax COMMAND [flags], e.g. maxjax serve {argv[0]} ...)")
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.exit(2, failure_line(args.command, f"unrecognized arguments: {' '.join(extra)} "
                                    f"(see maxjax {args.command} --help)") + "\n")
    transformers_index.install(getattr(args, "compile_cache", None))
    try:
        return args.func(args)
    except UserError as e:
        print(failure_line(args.command, " ".join(str(e).split())), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:     # `maxjax cache list | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
