"""JSON schemas for the structured-output tests and benchmark (tools/bench_structured.py): the
kinds the issue lists (nested objects, arrays with min/maxItems, enums, patterns, bounded numbers,
anyOf/oneOf, optional fields, additionalProperties: false, $ref, const, nullable), each with a
prompt that invites it. Strings carry maxLength and arrays maxItems, so a 135M model cannot run
on inside one until max_tokens."""

S = {"type": "string", "maxLength": 24}


def obj(props: dict, required=None, **kw) -> dict:
    """An object; closed (additionalProperties: false, as OpenAI's strict mode requires) unless
    told otherwise: an open object lets a model add keys until max_tokens."""
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS = [
    ("a person", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a person with an address", obj({"name": S, "address": obj({"street": S, "city": S})})),
    ("three colors", {"type": "array", "items": S, "minItems": 1, "maxItems": 3}),
    ("a weekday", obj({"day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday",
                                        "Friday"]}})),
    ("a product code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}})),
    ("a temperature", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 50}})),
    ("a rating", obj({"stars": {"type": "integer", "exclusiveMinimum": 0,
                                "exclusiveMaximum": 6}})),
    ("an id", obj({"id": {"anyOf": [S, {"type": "integer", "minimum": 0, "maximum": 9999}]}})),
    ("a book", obj({"title": S, "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                    "subtitle": S}, required=["title"])),
    ("a point", obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                     "y": {"type": "integer", "minimum": -100, "maximum": 100}})),
    ("a task", obj({"title": S, "done": {"type": "boolean"}})),
    ("two users", {"type": "array", "minItems": 2, "maxItems": 2,
                   "items": obj({"name": S, "admin": {"type": "boolean"}})}),
    ("a 2x2 matrix", {"type": "array", "minItems": 2, "maxItems": 2,
                      "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("a version", obj({"schema_version": {"const": 2}, "name": S})),
    ("a nickname", obj({"nickname": {"type": ["string", "null"], "maxLength": 16}})),
    ("a dice roll", obj({"roll": {"enum": [1, 2, 3, 4, 5, 6]}})),
    ("an order", {"$defs": {"item": obj({"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                            "maximum": 9}})},
                  **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                   "minItems": 1, "maxItems": 2}})}),
    ("a username", obj({"username": {"type": "string", "minLength": 3, "maxLength": 12,
                                     "pattern": "^[a-z0-9_]+$"}})),
    ("a company", obj({"name": S, "ceo": obj({"name": S, "contact": obj({"email": S})})})),
    ("a shape", {"oneOf": [obj({"kind": {"const": "circle"},
                                "radius": {"type": "integer", "minimum": 1, "maximum": 99}}),
                           obj({"kind": {"const": "square"},
                                "side": {"type": "integer", "minimum": 1, "maximum": 99}})]}),
    ("a list of scores", {"type": "array", "maxItems": 4,
                          "items": {"type": "number", "minimum": 0, "maximum": 1}}),
    ("a color", {"enum": ["red", "green", "blue"]}),
    ("a date", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("settings", obj({"theme": {"enum": ["dark", "light"]}, "volume": {
        "type": "integer", "minimum": 0, "maximum": 10}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        required=["theme"])),
]


def prompt(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with {what} as JSON."}]
