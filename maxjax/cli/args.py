"""Flags from dataclasses: each config dataclass field becomes `--field-name`, its help from the
field's metadata, so config, CLI help and README come from one place.

argparse-dataclass cannot express `--x/--no-x` with a default or PEP 604 optionals (`int | None`),
which every max-serve-style flag needs, so this is a small adapter of our own.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field

from maxjax.engine.types import SamplingParams, param_specs
from maxjax.errors import UserError, read_user_file


def _unwrap(t):
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else (str, None)
    if origin in (list, tuple):
        return (typing.get_args(t)[0], "list")
    return (t, None)


TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_bool(text: str) -> bool:
    word = str(text).strip().lower()
    if word in TRUE_WORDS + FALSE_WORDS:
        return word in TRUE_WORDS
    raise argparse.ArgumentTypeError(f"expected true or false (got {text!r})")


class BoolFlag(argparse.Action):
    """`--x`, `--x true|false` (max serve's value form) and `--no-x`."""

    def __init__(self, option_strings, dest, **kw):
        names = list(option_strings)
        names += [f"--no-{n[2:]}" for n in option_strings if n.startswith("--")]
        super().__init__(names, dest, nargs="?", type=parse_bool, metavar="true|false", **kw)

    def __call__(self, parser, namespace, value, option_string=None):
        negated = option_string is not None and option_string.startswith("--no-")
        if negated and value is not None:
            parser.error(f"{option_string} takes no value")
        setattr(namespace, self.dest, False if negated else (True if value is None else value))


class RepeatedFlag(argparse.Action):
    """A flag whose last value is its value, as a plain one's, with every value given kept in
    `{dest}_all` (`serve --model A --model B`: several models)."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        setattr(namespace, f"{self.dest}_all", [*getattr(namespace, f"{self.dest}_all", []), value])


def add_dataclass_args(parser: argparse.ArgumentParser, cls, title: str | None = None) -> None:
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title or cls.__name__)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        names = f.metadata.get("args") or [f"--{f.name.replace('_', '-')}"]
        base, kind = _unwrap(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "")
        if default not in (None, [], ()) and not isinstance(default, bool):
            help_text += f" (default: {default})"
        kw = dict(dest=f.name, help=help_text, default=argparse.SUPPRESS)
        if base is bool:
            kw["action"] = BoolFlag
        elif f.metadata.get("repeatable"):
            kw.update(action=RepeatedFlag, type=base)
        elif kind == "list":
            kw.update(action="extend", nargs="+", type=base)
        else:
            kw["type"] = base
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
            if f.metadata.get("any_case"):
                kw["type"] = str.lower
        if "parse" in f.metadata:       # the value's text as the reference spells it
            kw["type"] = f.metadata["parse"]
        group.add_argument(*names, **kw)


def build(cls, ns: argparse.Namespace, base: dict | None = None):
    """The dataclass from (config-file values, then) the flags the user actually gave."""
    values = dict(base or {})
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in values.items() if k in names}
    values.update({k: v for k, v in vars(ns).items() if k in names})
    return cls(**values)


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """A YAML or JSON --config-file as the command line would give it: {dest: value}. A key is
    any of a flag's names (dashes or underscores, `model` as `model-path`); a value goes through
    the flag's own parsing (its type, choices, true/false words; a single value is a one-item
    list). A key no flag of `parser` has, or a value its flag refuses, is one line naming it."""
    data = read_yaml_or_json(path, "--config-file")
    if not isinstance(data, dict):
        raise UserError(f"--config-file {path}: expected a mapping of flag names to values")
    return config_values(data, parser, f"--config-file {path}")


def read_yaml_or_json(path: str, flag: str):
    """The file's data (JSON when it ends in .json, else YAML); a UserError naming `flag`."""
    text = read_user_file(path, flag)
    try:
        if path.endswith(".json"):
            return json.loads(text)
        import yaml
        return yaml.safe_load(text)
    except Exception as e:
        raise UserError(f"{flag} {path}: cannot parse: {e}") from e


def config_values(data: dict, parser: argparse.ArgumentParser, where: str) -> dict:
    """{flag name: value} (YAML's or JSON's) as `parser`'s flags parse them: {dest: value}."""
    flags = {}
    for a in parser._actions:
        for opt in a.option_strings:
            negated = isinstance(a, BoolFlag) and opt.startswith("--no-")
            if opt.startswith("--") and not negated and a.dest not in ("help", "config_file"):
                flags[opt[2:].replace("-", "_")] = a
    unknown = sorted(str(k) for k in data if str(k).replace("-", "_") not in flags)
    if unknown:
        raise UserError(f"{where}: unknown settings: {', '.join(unknown)}")
    out = {}
    for key, value in data.items():
        a = flags[str(key).replace("-", "_")]
        try:
            out[a.dest] = _flag_value(a, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise UserError(f"{where}: {key}: {e}") from None
    return out


def _flag_value(a: argparse.Action, value):
    """`value` (YAML's) as flag `a` parses its text on the command line."""
    def one(v):
        if isinstance(v, list):
            raise TypeError("expected one value (got a list)")
        text = v if isinstance(v, str) else json.dumps(v)
        if a.nargs == 0 or isinstance(a, argparse.BooleanOptionalAction):
            got = parse_bool(text)                  # store_true and --x/--no-x switches
        elif a.type is not None:
            try:
                got = a.type(text)
            except (ValueError, TypeError):     # as argparse says it of a command line's
                raise ValueError(f"invalid {getattr(a.type, '__name__', 'value')} value: "
                                 f"{text!r}") from None
        else:
            got = text
        if a.choices is not None and got not in a.choices:
            raise ValueError(f"invalid choice {got!r} (choose from "
                             f"{', '.join(map(str, a.choices))})")
        return got
    if value is None:
        return None
    if a.nargs == "+":
        return [one(v) for v in (value if isinstance(value, list) else [value])]
    return one(value)


@dataclass
class ModelOptions:
    model_path: str | None = field(default=None, metadata={
        "args": ["--model-path", "--model"], "repeatable": True,
        "help": "HF repo id, HF directory or GGUF file (default: the embedded SmolLM2-135M-Instruct); "
                "`serve` given it more than once serves each (docs/serving.md)"})
    # The rest of the model's source (maxjax/models/source.py; the draft's twins in EngineConfig).
    huggingface_model_revision: str | None = field(default=None, metadata={
        "help": "Branch, tag or commit of the Hugging Face repo (config, tokenizer and weights)"})
    huggingface_weight_revision: str | None = field(default=None, metadata={
        "help": "Branch, tag or commit of the Hugging Face repo to take the weights from"})
    force_download: bool = field(default=False, metadata={
        "help": "Download the Hugging Face repo's files again even when they are cached"})
    subfolder: str | None = field(default=None, metadata={
        "help": "Subdirectory of the model holding config.json and the weights "
                "({model_path}/{subfolder}/)"})
    weight_path: str | None = field(default=None, metadata={
        "help": "Weights from this local safetensors file or directory instead of the model's "
                "(a URL is refused: nothing is fetched at run time)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Allow a checkpoint that names custom code (auto_map) and pass trust_remote_code "
                "to its tokenizer; the model still runs maxjax's own JAX architecture"})
    rope_type: str | None = field(default=None, metadata={
        "choices": ["none", "normal", "neox", "longrope", "yarn"],
        "help": "A GGUF's rope layout: only its own is accepted (llama: normal, others: neox)"})
    sliding_window: int | None = field(default=None, metadata={
        "help": "Sliding-window attention of this many tokens on the layers the architecture "
                "windows (Mistral: all, Gemma3: its local ones), replacing the config's"})
    chat_template: str | None = field(default=None, metadata={
        "help": "Jinja chat template file, or JSON with a chat_template key, overriding the model's"})
    custom_architectures: list[str] = field(default_factory=list, metadata={
        "help": "Architecture packages to register: a directory or IMPORT_PATH:ATTR exposing "
                "ARCHITECTURES. This imports and runs that code: pass only code you trust"})
    precompiled_artifacts: list[str] = field(default_factory=list, metadata={
        "args": ["--precompiled-artifacts", "--precompiled-mefs"],
        "help": "Artifact directories from `maxjax warm-cache` to load instead of compiling"})
    require_compiled_artifacts: bool = field(default=False, metadata={
        "help": "With --precompiled-artifacts: fail instead of compiling a portable export"})
    export_artifacts: str | None = field(default=None, metadata={
        "args": ["--export-artifacts", "--export-mefs"],
        "help": "Write artifacts for every graph this run compiles into this directory"})
    compile_cache: bool = field(default=True, metadata={
        "help": "Keep compiled graphs in $MAXJAX_CACHE_DIR (default ~/.cache/maxjax) and load them "
                "on the next start with the same model and flags (--no-compile-cache or "
                "MAXJAX_NO_COMPILE_CACHE=1: compile, store nothing)"})
    compile_cache_max_size: str | None = field(default=None, metadata={
        "help": "Size cap of the compile cache, e.g. 500M or 20G; least recently used entries "
                "go first (default: $MAXJAX_CACHE_MAX_SIZE, else 10G)"})
    log_level: str = field(default="INFO", metadata={
        "choices": ["debug", "info", "warning", "error", "critical"], "any_case": True,
        "help": "DEBUG, INFO, WARNING, ERROR or CRITICAL"})
    log_prefix: str | None = field(default=None, metadata={
        "help": "Text put before every log line of this process (e.g. a replica's name)"})

    def source(self):
        """The model's ModelSource (maxjax/models/source.py)."""
        from maxjax.models.source import ModelSource
        return ModelSource.of(self)


@dataclass
class GenerateOptions:
    prompt: list[str] = field(default_factory=list, metadata={"help": "A prompt (repeatable)"})
    prompts_file: str | None = field(default=None, metadata={
        "help": "JSONL file: one {\"prompt\": ...} (or {\"messages\": [...]} with --chat) per line"})
    chat: bool = field(default=False, metadata={"help": "Apply the chat template to each prompt"})
    json: bool = field(default=False, metadata={
        "help": "Print one JSON object per prompt: text, token_ids, finish_reason, usage"})
    profile: bool = field(default=False, metadata={
        "help": "Print where step time went: scheduling, input building, device step + transfer, "
                "update, detokenization"})
    json_schema: str | None = field(default=None, metadata={
        "help": "JSON schema file every output must match"})
    regex: str | None = field(default=None, metadata={
        "help": "Regular expression every output must match"})
    grammar: str | None = field(default=None, metadata={
        "help": "Lark (or GBNF) grammar file every output must match"})


def _sampling_flags():
    """The SamplingParams fields declared with a flag default (maxjax/engine/types.py), as a
    dataclass that add_dataclass_args and build read like the others."""
    hints = typing.get_type_hints(SamplingParams)
    fields = []
    for name, spec in param_specs().items():
        if not spec.has_flag:
            continue
        d, meta = spec.flag_default, {"help": spec.help}
        fields.append((name, hints[name], field(default_factory=lambda d=d: list(d), metadata=meta)
                       if isinstance(d, list) else field(default=d, metadata=meta)))
    return dataclasses.make_dataclass("SamplingFlags", fields)


SamplingFlags = _sampling_flags()


def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    """`generate`'s SamplingParams: the flags given, the declared flag defaults for the rest."""
    return SamplingParams(**dataclasses.asdict(build(SamplingFlags, ns)))


def grammar_spec(gen: GenerateOptions):
    """The GrammarSpec of `generate`'s --json-schema / --regex / --grammar (None: none)."""
    from maxjax.errors import RequestError
    from maxjax.structured import GrammarSpec
    given = [k for k in ("json_schema", "regex", "grammar") if getattr(gen, k) is not None]
    if len(given) > 1:
        raise UserError(f"give one of --json-schema, --regex, --grammar (got "
                        f"{', '.join('--' + k.replace('_', '-') for k in given)})")
    try:
        if gen.json_schema is not None:
            return GrammarSpec.json_schema(read_user_file(gen.json_schema, "--json-schema"),
                                           "--json-schema")
        if gen.regex is not None:
            return GrammarSpec.regex(gen.regex, "--regex")
        if gen.grammar is not None:
            return GrammarSpec.lark(read_user_file(gen.grammar, "--grammar"), "--grammar")
    except RequestError as e:
        raise UserError(f"{e.param}: {e.reason}") from None
    return None
