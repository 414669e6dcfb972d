"""Tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls` checked, the tool
prompt for templates that ignore `tools`, the grammar that forces a call in the model's own
format (`tool_choice` required or named, `--enable-tool-call-constrained-decode`), and the parsers
that find calls in the output (`--tool-parser`), whole or streamed (server/chat_output.py).

Formats: hermes `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>` (Qwen2.5/Qwen3,
ChatML models), llama3_json `{"name": N, "parameters": {...}}` separated by "; " (optionally after
<|python_tag|>), mistral `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`, pythonic
`[f(a=1), g(b="x")]`.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass

import pydantic_core

from maxjax.structured.spec import GrammarSpec

from . import json_body
from .chat_events import ToolCall
from .protocol import APIError

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
MAX_PARALLEL_CALLS = 8
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def default_parser(chat_template: str | None) -> str:
    """The tool-call format a chat template speaks (ChatML and unknown ones: hermes)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def _bad(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", param=param)


DROPPED_TOOLS_HEADER = "X-Dropped-Tools"


def dropped_tools_header(dropped: list[str]) -> dict[str, str]:
    """The header naming the built-in tools (web search and the like: the provider runs them)
    a request listed and this server left out, as `tools[i] (type)`; none: no header."""
    return {DROPPED_TOOLS_HEADER: ", ".join(dropped)} if dropped else {}


@dataclass
class ToolSetup:
    parser: str
    tools: list[dict]            # the request's tools, {"type": "function", "function": {...}}
    choice: str                  # "auto" | "required" | a function name
    parallel: bool

    @property
    def functions(self) -> list[dict]:
        fns = [t["function"] for t in self.tools]
        return fns if self.choice in ("auto", "required") else \
            [f for f in fns if f["name"] == self.choice]

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def grammar(self, tokenizer=None) -> GrammarSpec | None:
        """The call's grammar: forced (required, named) or triggered by the format's opening
        tag (auto); None where the format has no tag to trigger on."""
        tokens = single_tokens(tokenizer)
        if self.forced:
            return GrammarSpec.lark(tool_grammar(self.parser, self.functions,
                                                 self.parallel and self.choice == "required",
                                                 tokens), "tools")
        lazy = lazy_tool_grammar(self.parser, self.functions, self.parallel, tokens)
        return GrammarSpec.lark(lazy, "tools") if lazy else None


def _check_schema(schema, param: str) -> None:
    if not isinstance(schema, dict):
        raise _bad(param, "must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise _bad(f"{param}.type", f"must be 'object' (got {schema.get('type')!r})")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise _bad(f"{param}.properties", "must map names to schemas")
    req = schema.get("required", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise _bad(f"{param}.required", "must be a list of property names")


def _check_strict(schema: dict, param: str) -> None:
    """A strict tool's parameters compile alone as they would inside the call grammar, so that
    what cannot be enforced is refused naming the tool, not the whole grammar (`tools`)."""
    import llguidance
    try:
        error, notes = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                          defaults=json_options(True)))
    except ValueError as e:
        error, notes = True, [str(e)]
    if error:
        raise _bad(param, f"strict: {' '.join(notes[0].split())} (drop the keyword, or strict)")


def tool_setup(req, parser: str | None) -> ToolSetup | None:
    """The request's tool calling (None: none asked, or tool_choice "none"); APIError 400 naming
    the field for a malformed tool, an unknown tool in tool_choice, or a parser that is off."""
    if req.functions or req.function_call:
        raise _bad("functions" if req.functions else "function_call",
                   "deprecated; use tools and tool_choice")
    tools, choice = req.tools or [], req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("function"), dict) \
                or not isinstance(choice["function"].get("name"), str):
            raise _bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}")
        choice = choice["function"]["name"]
    elif choice is None:
        choice = "auto"
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", f"{choice!r}: must be none, auto, required or a function")
    if choice == "none":
        return None
    if not tools:
        if choice != "auto":
            raise _bad("tools", f"required with tool_choice {choice!r}")
        return None
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}].type", "only function tools are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not name or not name.replace("_", "a").replace(
                "-", "a").replace(".", "a").isalnum() or len(name) > 64:
            raise _bad(f"tools[{i}].function.name", "must be 1-64 letters, digits, _ - or .")
        if name in names:
            raise _bad(f"tools[{i}].function.name", f"duplicate tool name {name!r}")
        names.append(name)
        if "parameters" in fn:
            _check_schema(fn["parameters"], f"tools[{i}].function.parameters")
            if fn.get("strict"):
                _check_strict(fn["parameters"], f"tools[{i}].function.parameters")
    if choice not in ("auto", "required") and choice not in names:
        raise _bad("tool_choice", f"names no tool of this request: {choice!r} (tools: "
                                  f"{', '.join(names)})")
    if parser is None:
        raise _bad("tools", "tool calling is off on this server (--tool-parser none)")
    return ToolSetup(parser, tools, choice, req.parallel_tool_calls is not False)


# ---- prompts ----------------------------------------------------------------------------------

def tool_prompt(parser: str, tools: list[dict]) -> str:
    """The instructions a server adds for a template that ignores `tools`."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    fmt = {"hermes": "return a json object with function name and arguments within "
                     "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                     "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
           "llama3_json": "respond with a JSON object {\"name\": <function-name>, "
                          "\"parameters\": <args-json-object>}; separate several with \"; \"",
           "mistral": "respond with [TOOL_CALLS] followed by a JSON list of {\"name\": "
                      "<function-name>, \"arguments\": <args-json-object>}",
           "pythonic": "respond with a Python list of calls: [func_name(arg=value, ...)]"}[parser]
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\nFor each function call, {fmt}")


def format_calls(parser: str, calls: list[dict]) -> str:
    """An assistant message's tool_calls as the model writes them (for templates that ignore
    tools)."""
    parsed = [(c["function"]["name"], arguments(c["function"].get("arguments"))) for c in calls]
    if parser == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
                         for n, a in parsed)
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in parsed)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in parsed])
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items())
                           + ")" for n, a in parsed) + "]"


def arguments(args, param: str | None = None):
    """OpenAI sends arguments as a JSON string; templates want the object (text that is not
    JSON: {}; JSON nesting too deep: a 400 naming `param`)."""
    if isinstance(args, str):
        try:
            return json_body.loads(args, param)
        except ValueError:
            return {}
    return args or {}


def template_tool_calls(calls: list[dict]) -> list[dict]:
    return [{**c, "function": {**c["function"], "arguments": arguments(
        c["function"].get("arguments"))}} for c in calls]


# ---- the tool-call grammar ------------------------------------------------------------------

def _params(fn: dict) -> dict:
    """The tool's parameters schema. No `parameters`: the function takes none (OpenAI's meaning),
    so its arguments are `{}`."""
    if "parameters" not in fn:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return closed(fn["parameters"])


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples")      # JSON data, not schemas


def closed(schema):
    """The schema with every object that lists properties but says nothing of others closed
    (additionalProperties false, nested ones and $defs too): its outputs still validate against
    the open schema, and a small model cannot add keys until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: sub if k in _VALUES else {n: closed(v) for n, v in sub.items()}
           if k in _SCHEMA_MAPS and isinstance(sub, dict) else closed(sub)
           for k, sub in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def rebase_refs(schema, prefix: str):
    """The schema with its local `$ref`s ("#/$defs/X") pointing under `prefix` ("/properties/
    arguments"): nested inside another schema, its pointers must name the same places."""
    if isinstance(schema, list):
        return [rebase_refs(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: ("#" + prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else rebase_refs(v, prefix)) for k, v in schema.items()}


def json_options(strict: bool) -> dict:
    """llguidance's JSON options: compact separators; unless strict, keywords it cannot enforce
    (uniqueItems, dependencies, unknown formats) are ignored and oneOf is matched as anyOf
    (server/structured.py reports what was not enforced)."""
    return {**_COMPACT, **({} if strict else {"lenient": True, "coerce_one_of": True})}


TAGS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")


def single_tokens(tokenizer) -> dict[str, int]:
    """The format's tags that are one added token of the tokenizer (Qwen's <tool_call>)."""
    added = tokenizer.get_added_vocab() if tokenizer is not None else {}
    return {t: added[t] for t in TAGS if t in added}


def _lit(text: str, tokens: dict[str, int]) -> str:
    """A Lark literal; a tag the tokenizer has as one token is that token (llguidance treats
    added tokens as special: a text literal would match them in the mask but not in the
    matcher)."""
    return f"<[{tokens[text]}]>" if text in tokens else json.dumps(text)


def _call_rules(parser: str, functions: list[dict]) -> tuple[list[str], str]:
    """(rules, the alternative of one call's body) for `functions` in the parser's format."""
    rules, alts = [], []
    key = "parameters" if parser == "llama3_json" else "arguments"
    for i, fn in enumerate(functions):
        params = _params(fn)
        opts = json_options(bool(fn.get("strict")))
        if parser == "pythonic":
            props, defs = params.get("properties", {}), {
                k: params[k] for k in ("$defs", "definitions") if k in params}
            req = [k for k in props if k in params.get("required", [])]
            rules += [f"v{i}_{j}: %json " + json.dumps({
                **(props[k] if isinstance(props[k], dict) else {}), **defs, "x-guidance": opts})
                for j, k in enumerate(req)]
            args = [f'"{k}=" v{i}_{j}' for j, k in enumerate(req)]
            rules.append(f'f{i}: "{fn["name"]}(" ' + ' ", " '.join(args or ['""']) + ' ")"')
        else:
            schema = {"type": "object", "properties": {
                "name": {"const": fn["name"]}, key: rebase_refs(params, f"/properties/{key}")},
                "required": ["name", key], "additionalProperties": False, "x-guidance": opts}
            rules.append(f"f{i}: %json " + json.dumps(schema))
        alts.append(f"f{i}")
    return rules, "(" + " | ".join(alts) + ")"


def tool_grammar(parser: str, functions: list[dict], parallel: bool,
                 tokens: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance, with %json) accepting only calls of `functions`, in the
    parser's format, one or (parallel) up to MAX_PARALLEL_CALLS. `tokens`: single_tokens().
    Between calls only the format's separator goes, and after the last call whitespace may
    follow: a model ends a call with a newline before its end-of-turn token, and a separator
    that commits to another call turns that newline into a repeat of the call."""
    tokens = tokens or {}
    rules, call = _call_rules(parser, functions)
    sep = {"hermes": 'WS', "llama3_json": '"; "'}.get(parser, '", "')
    calls = f"call ({sep} call)~0..{MAX_PARALLEL_CALLS - 1}" if parallel else "call"
    open_, close = _lit("<tool_call>", tokens), _lit("</tool_call>", tokens)
    head = {"hermes": f'start: {calls} WS?\ncall: {open_} "\\n" {call} "\\n" {close}',
            "llama3_json": f"start: {calls} WS?\ncall: {call}",
            "mistral": f'start: {_lit("[TOOL_CALLS]", tokens)} "[" {calls} "]" WS?\n'
                       f'call: {call}',
            "pythonic": f'start: "[" {calls} "]" WS?\ncall: {call}'}[parser]
    return head + "\nWS: /[ \\t\\n]{1,2}/\n" + "\n".join(rules)


def lazy_tool_grammar(parser: str, functions: list[dict], parallel: bool,
                      tokens: dict[str, int] | None = None) -> str | None:
    """`tool_choice: auto`: text is free until the format's opening tag; from there the call is
    held to `functions` and their schemas, so a model cannot name an unknown tool or write
    arguments that do not match. None for formats without an opening tag (pythonic)."""
    tokens = tokens or {}
    trigger = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]",
               "llama3_json": '{"name": '}.get(parser)
    if trigger is None:
        return None
    rules, call = _call_rules(parser, functions)
    if parser == "llama3_json":      # the rest of {"name": N, "parameters": {...}}
        rules = []
        for i, fn in enumerate(functions):
            rest = json.dumps(fn["name"]) + ', "parameters": '
            opts = json_options(bool(fn.get("strict")))
            rules += [f'f{i}: {json.dumps(rest)} p{i} "}}"',
                      f"p{i}: %json " + json.dumps({**_params(fn), "x-guidance": opts})]
        body = call
    elif parser == "hermes":
        body = f'"\\n" {call} "\\n" {_lit("</tool_call>", tokens)}'
    else:
        body = f'"[" {call} ("," " "? {call})~0..{MAX_PARALLEL_CALLS - 1} "]"' if parallel \
            else f'"[" {call} "]"'
    if trigger in tokens:
        head = f"tagged: TEXT {_lit(trigger, tokens)} {body}"
    else:
        head = f"tagged: opened {body}\nopened[lazy]: TEXT {json.dumps(trigger)}"
    # One call: nothing but whitespace after it (free text there could open another, unheld).
    start = "tagged* TEXT" if parallel else "TEXT | tagged WS?"
    return ("%llguidance {}\n" f"start: {start}\n{head}\nTEXT: /(.|\\n)*/\n"
            "WS: /[ \\t\\n]{1,2}/\n" + "\n".join(rules))


# ---- parsing the output ------------------------------------------------------------------------

def _json_calls(items, key: str) -> list[ToolCall] | None:
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        args = it.get(key, it.get("arguments", it.get("parameters", {})))
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall.new(it["name"], args))
    return calls


def _pythonic_value(node):
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [_pythonic_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_pythonic_value(k): _pythonic_value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_calls(parser: str, text: str) -> list[ToolCall] | None:
    """The calls in `text`, which starts at the parser's marker; None: not well-formed calls."""
    text = text.strip()
    try:
        if parser == "hermes":
            bodies, rest = [], text
            while rest.startswith("<tool_call>"):
                end = rest.find("</tool_call>")
                if end < 0:
                    return None
                bodies.append(json.loads(rest[len("<tool_call>"):end]))
                rest = rest[end + len("</tool_call>"):].strip()
            return _json_calls(bodies, "arguments") if bodies else None
        if parser == "llama3_json":
            text = text.removeprefix("<|python_tag|>").strip()
            dec, items, i = json.JSONDecoder(), [], 0
            while i < len(text):
                obj, i = dec.raw_decode(text, i)
                items.append(obj)
                while i < len(text) and text[i] in " ;\n":
                    i += 1
            return _json_calls(items, "parameters")
        if parser == "mistral":
            items = json.loads(text.removeprefix("[TOOL_CALLS]").strip())
            return _json_calls(items if isinstance(items, list) else [items], "arguments")
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for c in tree.elts:
            if not isinstance(c, ast.Call) or not isinstance(c.func, ast.Name) or c.args:
                return None
            calls.append(ToolCall.new(c.func.id, {k.arg: _pythonic_value(k.value)
                                              for k in c.keywords}))
        return calls
    except (ValueError, SyntaxError):
        return None


def _partial_json(text: str):
    """`text` as JSON cut off at its end: the complete values (a cut string is left out)."""
    try:
        return pydantic_core.from_json(text, allow_partial=True)
    except ValueError:
        return None


def _cut_objects(text: str) -> list:
    """llama3_json's objects (separated by ";" or spaces), the last one cut off."""
    dec, items, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return items + [_partial_json(text[i:])]
        items.append(obj)
        while i < len(text) and text[i] in " ;\n":
            i += 1
    return items


def partial_calls(parser: str, text: str, names: set[str] | None) -> list[ToolCall] | None:
    """The calls in `text` (from the parser's marker) when the output was cut off inside one:
    the last call's arguments as far as they parse, its name the only function there is when
    the cut came inside the name; calls naming no known function are left out. JSON formats
    only (pythonic: None)."""
    text = text.strip()
    if parser == "hermes":
        items = [_partial_json(b.split("</tool_call>")[0]) for b in text.split("<tool_call>")[1:]]
    elif parser == "mistral":
        items = _partial_json(text.removeprefix("[TOOL_CALLS]").strip())
        items = items if isinstance(items, list) else [items]
    elif parser == "llama3_json":
        items = _cut_objects(text.removeprefix("<|python_tag|>").strip())
    else:
        return None
    calls = []
    for it in items:
        if not isinstance(it, dict):
            continue
        name = it.get("name")
        if not isinstance(name, str) and names is not None and len(names) == 1:
            name = next(iter(names))
        if not isinstance(name, str) or (names is not None and name not in names):
            continue
        args = it.get("arguments", it.get("parameters", {}))
        calls.append(ToolCall.new(name, args if isinstance(args, dict) else {}))
    return calls or None


def marker(parser: str) -> str:
    return {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]",
            "pythonic": "["}[parser]


def starts_anywhere(parser: str) -> bool:
    """hermes and mistral calls may follow some content; the others are the whole output."""
    return parser in ("hermes", "mistral")
