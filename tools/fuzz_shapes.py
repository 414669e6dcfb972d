"""Route-shaped cases for tools/fuzz.py: bodies of each generation route's real shape with
hostile values at their leaves, so a case gets past the first field check into what lies behind
it (the Responses and Messages translations, the chat template, tool-call arguments, the
grammar compiler, image decoding, the engine). The schema-driven cases draw from the routes'
request models, whose `dict[str, Any]` fields (items, content blocks, tools, schemas) they fill
with noise; these fill them with what clients send, and break it a little.

  shaped_cases(n, seed) -> [(route, body)]

Routes: /v1/chat/completions (content parts with images, tool calls and their outputs, tools,
tool_choice, response_format, structured_outputs), /v1/completions (structured_outputs),
/v1/responses (+ /input_tokens: items, tools, tool_choice, text.format), /v1/messages
(+ /count_tokens: content blocks, tools, tool_choice, thinking, output_config) and
/v1/embeddings."""
from __future__ import annotations

import base64
import io
import json
import warnings

from hypothesis import HealthCheck, given, seed as seed_of, settings, strategies as st
from hypothesis.errors import HypothesisWarning

ODD = [None, True, -1, 0, 2**63, 1e308, "", "\x00", "\ud800", "A" * 5000, [], {}, [[[[]]]],
       {"": None}, "<|im_end|>", "{{ raise_exception('x') }}", "../../etc/passwd", "[", "{"]
_SCALAR = (st.none() | st.booleans() | st.integers(-2**65, 2**65)
           | st.floats(allow_nan=False) | st.text(max_size=12))
ANY = st.recursive(_SCALAR, lambda c: st.lists(c, max_size=3)
                   | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)
odd = st.sampled_from(ODD) | ANY


def sometimes(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly `good`, one time in 25 a hostile value (a body has dozens of leaves: most
    bodies should still break no more than one)."""
    return st.integers(0, 24).flatmap(lambda i: odd if i == 0 else good)


def maybe_fields(required: dict, optional: dict) -> st.SearchStrategy:
    """A dict of `required`'s fields and a few of `optional`'s."""
    names = sorted(optional)
    return st.lists(st.sampled_from(names), max_size=min(4, len(names)), unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({**required, **{k: optional[k] for k in chosen}}))


# ---- leaves ----------------------------------------------------------------------------------

def _png(size: int) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


_PNG = _png(8)
IMAGE_URLS = [f"data:image/png;base64,{_PNG}", f"data:image/jpeg;base64,{_PNG}",
              f"data:image/png;base64,{_PNG[:40]}", "data:image/png;base64,!!!!",
              "data:image/png;base64," + base64.b64encode(b"GIF89a" + b"\0" * 64).decode(),
              "data:image/png," + _PNG, "data:,", "data:image/png;base64,",
              "https://example.com/cat.png", "file:///etc/passwd", "/etc/passwd",
              "ftp://x/y.png", "", "data:image/svg+xml;base64," + base64.b64encode(
                  b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode()]
image_url = sometimes(st.sampled_from(IMAGE_URLS))
text = sometimes(st.text(max_size=40) | st.sampled_from(["hi", "Say hi", "{\"a\": 1}"]))
name = sometimes(st.sampled_from(["get_weather", "lookup", "f", "a.b", "x" * 80, "ümlaut"]))
call_id = sometimes(st.sampled_from(["call_1", "call_2", "toolu_1", ""]))


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


arguments = st.one_of(
    st.builds(json.dumps, ANY), st.sampled_from(['{"city": "Oslo"}', "{}", "", "{", "null",
                                                 "5", '"x"', "[1, 2]", '{"a": NaN}']),
    st.sampled_from([10, 63, 65, 200, 3000]).map(_nested), odd)

_TYPES = ["object", "string", "integer", "number", "boolean", "array", "null", "strnig"]
_KEYWORDS = {"pattern": st.sampled_from(["^a+$", "(", "[", "\\", "a{99999}", ".*"]),
             "format": st.sampled_from(["date-time", "email", "uuid", "nope"]),
             "minLength": st.integers(-3, 10 ** 12), "maxLength": st.integers(-3, 10 ** 12),
             "minimum": st.integers() | st.floats(allow_nan=False),
             "minItems": st.integers(-3, 10 ** 9), "maxItems": st.integers(-3, 10 ** 9),
             "enum": st.lists(ANY, max_size=3), "const": ANY,
             "required": st.lists(st.text(max_size=4), max_size=3),
             "x-guidance": odd, "$ref": st.sampled_from(["#/$defs/a", "#/nope", "http://x", ""]),
             "uniqueItems": st.booleans(), "multipleOf": st.sampled_from([0, -1, 0.1, 3])}


def _schema_step(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
            st.text(max_size=6), children, max_size=3)},
            optional={"required": st.lists(st.text(max_size=6), max_size=2),
                      "additionalProperties": st.booleans() | children}),
        st.fixed_dictionaries({"type": st.just("array"), "items": children}),
        st.fixed_dictionaries({"anyOf": st.lists(children, max_size=3)}),
        st.fixed_dictionaries({"oneOf": st.lists(children, max_size=3)}),
        st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"a": children}),
                               "$ref": st.sampled_from(["#/$defs/a", "#/$defs/b"])}),
        st.tuples(children, st.sampled_from(sorted(_KEYWORDS))).flatmap(
            lambda ck: st.builds(lambda v: {**ck[0], ck[1]: v} if isinstance(ck[0], dict)
                                 else {ck[1]: v}, _KEYWORDS[ck[1]])))


schema = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(_TYPES)}) | st.booleans() | st.just({})
    | st.sampled_from(ODD), _schema_step, max_leaves=6)


# ---- /v1/chat/completions and /v1/completions -----------------------------------------------

_part = sometimes(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
        st.fixed_dictionaries({"url": image_url}, optional={"detail": st.sampled_from(
            ["auto", "low", "high", "x"])}), image_url)}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "file", "refusal", "x"])})))
_content = st.one_of(text, st.lists(_part, max_size=3))
_tool_call = st.fixed_dictionaries({"id": call_id, "type": sometimes(st.just("function")),
                                    "function": sometimes(st.fixed_dictionaries(
                                        {"name": name, "arguments": arguments}))})
_chat_message = sometimes(st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": _content}),
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer"]), "content": text}),
    st.fixed_dictionaries({"role": st.just("assistant")}, optional={
        "content": sometimes(st.none() | text), "tool_calls": st.lists(_tool_call, max_size=2),
        "reasoning_content": text}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": call_id,
                           "content": _content})))
_chat_tool = st.fixed_dictionaries({"type": sometimes(st.just("function")),
                                    "function": sometimes(maybe_fields(
                                        {"name": name}, {"description": text,
                                                         "parameters": schema,
                                                         "strict": st.booleans()}))})
_chat_choice = st.one_of(st.sampled_from(["auto", "none", "required"]),
                         st.fixed_dictionaries({"type": st.just("function"), "function":
                                                sometimes(st.fixed_dictionaries({"name": name}))}),
                         odd)
_response_format = st.one_of(
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": sometimes(
        maybe_fields({"name": st.just("out"), "schema": schema}, {"strict": st.booleans()}))}),
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "regex", "x"])}), odd)
_structured = st.one_of(
    st.fixed_dictionaries({"json": schema}), st.fixed_dictionaries({"regex": text}),
    st.fixed_dictionaries({"choice": st.lists(text, max_size=3)}),
    st.fixed_dictionaries({"grammar": st.sampled_from(['start: "a"+', "start:", "%%%", ""])}),
    odd)
_few = st.integers(1, 4)

chat = maybe_fields({"messages": st.lists(_chat_message, min_size=1, max_size=4),
                     "max_tokens": _few},
                    {"tools": st.lists(_chat_tool, max_size=3), "tool_choice": _chat_choice,
                     "response_format": _response_format, "structured_outputs": _structured,
                     "stream": st.booleans(), "n": st.integers(1, 2),
                     "parallel_tool_calls": st.booleans(), "logprobs": st.booleans()})
completions = maybe_fields({"prompt": sometimes(st.text(max_size=20)), "max_tokens": _few},
                           {"structured_outputs": _structured, "stream": st.booleans(),
                            "response_format": _response_format, "echo": st.booleans()})


# ---- /v1/responses ---------------------------------------------------------------------------

_r_part = sometimes(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]),
                           "text": text}),
    st.fixed_dictionaries({"type": st.just("input_image")}, optional={
        "image_url": image_url, "file_id": text, "detail": text}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_file", "input_audio",
                                                    "refusal"])})))
_r_item = sometimes(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system",
                                                    "developer", "tool"]),
                           "content": st.one_of(text, st.lists(_r_part, max_size=3))},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": call_id,
                           "name": name, "arguments": arguments}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": call_id,
                           "output": st.one_of(text, st.lists(_r_part, max_size=2))}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call",
                                                    "item_reference", "x"])},
                          optional={"summary": ANY, "id": text})))
_r_tool = st.one_of(
    maybe_fields({"type": st.just("function"), "name": name},
                 {"parameters": schema, "strict": st.booleans(), "description": text}),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "namespace",
                                                    "custom", "mcp"])},
                          optional={"name": name, "tools": st.lists(ANY, max_size=2)}),
    odd)
_r_choice = st.one_of(
    st.sampled_from(["auto", "none", "required"]),
    st.fixed_dictionaries({"type": st.just("function"), "name": name}),
    st.fixed_dictionaries({"type": st.just("allowed_tools"),
                           "mode": sometimes(st.sampled_from(["auto", "required"])),
                           "tools": sometimes(st.lists(st.fixed_dictionaries(
                               {"type": sometimes(st.just("function")), "name": name}),
                               max_size=3))}),
    odd)
_r_format = st.one_of(
    maybe_fields({"type": st.just("json_schema"), "name": st.just("out")},
                 {"schema": schema, "strict": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}), odd)

responses = maybe_fields(
    {"input": st.one_of(text, st.lists(_r_item, min_size=1, max_size=4)),
     "max_output_tokens": _few},
    {"instructions": text, "tools": st.lists(_r_tool, max_size=3), "tool_choice": _r_choice,
     "text": st.fixed_dictionaries({"format": _r_format}), "stream": st.booleans(),
     "store": st.booleans(), "previous_response_id": sometimes(st.just("resp_0")),
     "truncation": sometimes(st.sampled_from(["auto", "disabled"])),
     "reasoning": st.fixed_dictionaries({"effort": sometimes(st.sampled_from(
         ["low", "high"]))})})


# ---- /v1/messages ----------------------------------------------------------------------------

_source = st.one_of(
    st.fixed_dictionaries({"type": st.just("base64"), "media_type": sometimes(
        st.sampled_from(["image/png", "image/jpeg", "image/gif", "text/plain"])),
        "data": sometimes(st.sampled_from([_PNG, _PNG[:30], "!!", ""]))}),
    st.fixed_dictionaries({"type": st.just("url"), "url": image_url}), odd)
_block = sometimes(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text},
                          optional={"cache_control": ANY}),
    st.fixed_dictionaries({"type": st.just("image"), "source": _source}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": call_id, "name": name,
                           "input": sometimes(st.dictionaries(st.text(max_size=4), ANY,
                                                              max_size=3))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": call_id},
                          optional={"content": st.one_of(text, st.lists(st.fixed_dictionaries(
                              {"type": st.sampled_from(["text", "image"]), "text": text}),
                              max_size=2)), "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking",
                                                    "document", "x"])},
                          optional={"thinking": text, "signature": text})))
_a_message = st.fixed_dictionaries({"role": sometimes(st.sampled_from(["user", "assistant"])),
                                    "content": st.one_of(text, st.lists(_block, max_size=3))})
_a_tool = st.one_of(maybe_fields({"name": name}, {"input_schema": schema,
                                                  "description": text}),
                    st.fixed_dictionaries({"type": st.sampled_from(
                        ["web_search_20250305", "bash_20250124", "x"]), "name": name}), odd)
_a_choice = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])}),
    st.fixed_dictionaries({"type": st.just("tool"), "name": name}), odd)
_a_optional = {
    "system": st.one_of(text, st.lists(st.fixed_dictionaries(
        {"type": sometimes(st.just("text")), "text": text}), max_size=2)),
    "tools": st.lists(_a_tool, max_size=3), "tool_choice": _a_choice,
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.just("enabled"),
                                                 "budget_tokens": st.integers(-1, 10**6)}),
                          st.fixed_dictionaries({"type": st.sampled_from(
                              ["disabled", "adaptive", "x"])}), odd),
    "output_config": st.fixed_dictionaries({"format": st.one_of(st.fixed_dictionaries(
        {"type": st.just("json_schema"), "schema": schema}), odd)}),
}
_last = st.fixed_dictionaries({"role": st.just("user"),
                               "content": st.one_of(text, st.lists(_block, max_size=3))})
_messages = st.tuples(st.lists(_a_message, max_size=3), _last).map(lambda t: t[0] + [t[1]])
SERVED = "<the served model>"      # shaped_cases() puts the server's model id here
messages = maybe_fields({"model": st.just(SERVED), "max_tokens": _few, "messages": _messages},
                        {**_a_optional, "stream": st.booleans(),
                         "stop_sequences": st.lists(text, max_size=2),
                         "temperature": st.floats(0, 1)})
count_tokens = maybe_fields({"model": st.just(SERVED), "messages": _messages}, _a_optional)


# ---- /v1/embeddings --------------------------------------------------------------------------

embeddings = maybe_fields(
    {"input": st.one_of(text, st.lists(text, min_size=1, max_size=3),
                        st.lists(st.integers(-5, 2**40), min_size=1, max_size=5),
                        st.lists(st.lists(st.integers(-5, 300), max_size=4), max_size=3), odd)},
    {"encoding_format": sometimes(st.sampled_from(["float", "base64"])),
     "dimensions": sometimes(st.integers(-1, 10**6)),
     "pooling_type": sometimes(st.sampled_from(["last", "mean"]))})


ROUTES = {"/v1/chat/completions": (chat, 4), "/v1/responses": (responses, 4),
          "/v1/messages": (messages, 4), "/v1/embeddings": (embeddings, 2),
          "/v1/completions": (completions, 1), "/v1/responses/input_tokens": (responses, 1),
          "/v1/messages/count_tokens": (count_tokens, 1)}


def shaped_cases(cases: int, seed: int, model: str = "m") -> list[tuple[str, dict]]:
    """About `cases` (route, body) pairs, shared among ROUTES by their weights; `model`: the
    served model's id, which /v1/messages requires."""
    warnings.simplefilter("ignore", HypothesisWarning)
    total = sum(w for _, w in ROUTES.values())
    out: list[tuple[str, dict]] = []
    for route, (strategy, weight) in ROUTES.items():
        @seed_of(seed)
        @settings(max_examples=max(1, cases * weight // total), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=["generate"])
        @given(strategy)
        def draw(body):
            if body.get("model") == SERVED:
                body["model"] = model
            out.append((route, body))
        draw()
    return out
