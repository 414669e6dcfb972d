"""The request forms of structured output -> one GrammarSpec (maxjax/structured/spec.py), for
chat and completions alike: OpenAI `response_format` (text, json_object, json_schema with
`strict`), vLLM `structured_outputs` {json, regex, choice, grammar, json_object} and the older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. A request may use one form;
the spec's `param` is the request field an error names. A schema that is not `strict` is served
with what the grammar cannot enforce let go, and named in the response's
X-Structured-Output-Warnings header; a strict one that asks for it is a 400 naming the keyword."""
from __future__ import annotations

from maxjax.errors import RequestError
from maxjax.structured.backend import unenforced
from maxjax.structured.spec import GrammarSpec

from .protocol import APIError

_VLLM = {"json": GrammarSpec.json_schema, "regex": GrammarSpec.regex,
         "choice": GrammarSpec.choice, "grammar": GrammarSpec.lark}


def _response_format(rf: dict) -> GrammarSpec | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object("response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError("response_format.json_schema", "required with type 'json_schema' "
                                                              "(an object with a 'schema')")
        if "schema" not in js:
            raise RequestError("response_format.json_schema.schema", "required")
        return GrammarSpec.json_schema(js["schema"], "response_format.json_schema.schema",
                                       strict=js.get("strict") is True)
    raise RequestError("response_format.type", f"{kind!r} is not supported (text, json_object, "
                                               "json_schema)")


def _structured_outputs(so: dict) -> GrammarSpec | None:
    given = [k for k in (*_VLLM, "json_object") if so.get(k) not in (None, False)]
    unknown = sorted(set(so) - {*_VLLM, "json_object", "disable_any_whitespace",
                                "disable_additional_properties", "whitespace_pattern"})
    if unknown:
        raise RequestError(f"structured_outputs.{unknown[0]}", "unknown field")
    if len(given) > 1:
        raise RequestError("structured_outputs", f"give one of json, regex, choice, grammar, "
                                                 f"json_object (got {', '.join(given)})")
    if not given:
        return None
    k = given[0]
    if k == "json_object":
        return GrammarSpec.json_object("structured_outputs.json_object")
    return _VLLM[k](so[k], f"structured_outputs.{k}")


def grammar_spec(req) -> GrammarSpec | None:
    """The request's grammar (None: unconstrained); APIError 400 naming the field."""
    try:
        forms = []
        if req.response_format:
            forms.append(("response_format", _response_format(req.response_format)))
        if req.structured_outputs:
            forms.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
        for k, build in _VLLM.items():
            value = getattr(req, f"guided_{k}")
            if value is not None:
                forms.append((f"guided_{k}", build(value, f"guided_{k}")))
        forms = [(name, spec) for name, spec in forms if spec is not None]
        if len(forms) > 1:
            raise RequestError(forms[1][0], f"only one structured-output form per request "
                                            f"(got {' and '.join(n for n, _ in forms)})")
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    return forms[0][1] if forms else None


WARNINGS_HEADER = "X-Structured-Output-Warnings"


def unenforced_notes(spec: GrammarSpec | None, tools=None) -> list[str]:
    """What the request's schemas (response format, non-strict tool parameters) ask that the
    grammar does not enforce, each prefixed with the field."""
    notes = []
    if spec is not None and spec.kind == "json_schema":
        notes += [f"{spec.param}: {n}" for n in unenforced(spec.source)]
    for i, t in enumerate(tools.tools if tools else []):
        fn = t["function"]
        if "parameters" in fn and not fn.get("strict"):
            notes += [f"tools[{i}].function.parameters: {n}" for n in unenforced(fn["parameters"])]
    return notes


def warning_headers(notes: list[str]) -> dict[str, str]:
    text = "; ".join(notes).encode("ascii", "replace").decode()
    return {WARNINGS_HEADER: text} if notes else {}
