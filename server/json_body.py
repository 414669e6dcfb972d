"""JSON from clients, within one set of limits: the request body (server/state.py read_json) and
the JSON that travels inside it as text (a tool call's `arguments`) are parsed here, so a value
nesting deeper than MAX_JSON_DEPTH, a NaN or a lone surrogate is the same 400 naming the field
on every route."""
from __future__ import annotations

import json
from typing import Any

from .protocol import APIError

MAX_JSON_DEPTH = 64


def loads(text: str | bytes, param: str | None = None) -> Any:
    """`text` as JSON. ValueError (UnicodeDecodeError, JSONDecodeError) for what is not JSON;
    APIError 400 naming `param` for a value nesting deeper than MAX_JSON_DEPTH or holding
    invalid Unicode (param None: a body object names its top-level field)."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except RecursionError:      # far deeper than the limit: the C parser's stack ran out first
        raise _too_deep(param) from None
    check_values(value, param)
    return value


def _not_json(name: str):
    """Python's json reads NaN and Infinity; JSON has no such numbers."""
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(param: str | None) -> APIError:
    return APIError(400, f"{param or 'the request body'}: nests deeper than {MAX_JSON_DEPTH} "
                         "levels", param=param)


def check_values(value: Any, param: str | None = None) -> None:
    """400 for a value nesting deeper than MAX_JSON_DEPTH or holding a string that is not valid
    Unicode (JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer, regex or
    grammar engine takes). `param`: the field the value is; None with an object: each
    top-level field names itself."""
    if param is None and isinstance(value, dict):
        todo = [(v, 2, k) for k, v in value.items()] + [(k, 1, k) for k in value]
    else:
        todo = [(value, 1, param)]
    while todo:
        o, depth, top = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(top)
        if isinstance(o, str) and not o.isascii():
            try:
                o.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{top or 'the request body'}: holds a lone surrogate "
                                    f"(\\u{ord(o[e.start]):04x}), not valid Unicode",
                               param=top) from None
        elif isinstance(o, dict):
            todo.extend((v, depth + 1, top) for v in o.values())
            todo.extend((k, depth + 1, top) for k in o)
        elif isinstance(o, list):
            todo.extend((v, depth + 1, top) for v in o)
