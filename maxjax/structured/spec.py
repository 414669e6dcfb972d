"""What a request's output must match: `GrammarSpec`, built from the request forms (OpenAI
`response_format`, vLLM `structured_outputs` / `guided_*`, `maxjax generate`'s flags) and carried
on SamplingParams. Pure data: compiling it is maxjax/structured/backend.py's job.

`param` is the request field an error names (e.g. "response_format"); it is not part of the
grammar's identity, so two requests asking the same grammar through different fields share one
compilation. `start_after`: text that must appear in the output before the grammar applies (the
end of a reasoning block, "</think>"); until then sampling is unconstrained.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from maxjax.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
LENIENT = {"lenient": True, "coerce_one_of": True}    # llguidance's JSON options


@dataclass(frozen=True)
class GrammarSpec:
    kind: str             # one of KINDS
    source: str           # the schema as canonical JSON, the regex, the choices as JSON, the grammar
    param: str = field(default="structured_output", compare=False)
    start_after: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source

    def after(self, marker: str | None) -> "GrammarSpec":
        return replace(self, start_after=marker)

    @classmethod
    def json_schema(cls, schema, param: str = "structured_output",
                    strict: bool = False) -> "GrammarSpec":
        """Unless `strict`, keywords the grammar engine cannot enforce (uniqueItems,
        dependencies, an unknown format) are ignored and oneOf is matched as anyOf, so a
        real-world schema is served; `unenforced()` (backend.py) lists what was let go."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise RequestError(param, f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise RequestError(param, f"a JSON schema must be an object (got "
                                      f"{type(schema).__name__})")
        if not isinstance(schema.get("x-guidance", {}), dict):
            raise RequestError(param, "x-guidance: llguidance's options must be an object (got "
                                      f"{type(schema['x-guidance']).__name__})")
        if not strict:
            schema = {**schema, "x-guidance": {**LENIENT, **schema.get("x-guidance", {})}}
        return cls("json_schema", json.dumps(schema), param)

    @classmethod
    def json_object(cls, param: str = "structured_output") -> "GrammarSpec":
        return cls("json_object", '{"type": "object"}', param)

    @classmethod
    def regex(cls, pattern, param: str = "structured_output") -> "GrammarSpec":
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(param, "a regex must be a non-empty string")
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices, param: str = "structured_output") -> "GrammarSpec":
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise RequestError(param, "choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)), param)

    @classmethod
    def lark(cls, grammar, param: str = "structured_output") -> "GrammarSpec":
        if not isinstance(grammar, str) or not grammar.strip():
            raise RequestError(param, "a grammar must be a non-empty string (Lark or EBNF)")
        return cls("lark", grammar, param)
