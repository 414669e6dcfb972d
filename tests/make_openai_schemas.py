"""Regenerates tests/openai_schemas.json: the response schemas the server tests validate against,
copied from the official OpenAI OpenAPI spec (with their transitive $refs) and turned into plain
JSON Schema (OpenAPI's `nullable: true` becomes `anyOf [..., null]`). Run by hand when the spec
changes:  python tests/make_openai_schemas.py ../shared/reference/openai-openapi.json"""
import json
import os
import sys

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "CreateChatCompletionRequest", "CreateCompletionRequest",
         "CreateCompletionResponse", "ListModelsResponse", "Model", "ErrorResponse",
         "CreateResponse", "Response", "ResponseStreamEvent",
         "CreateEmbeddingResponse"]
DROP = {"description", "example", "examples", "x-oaiMeta", "x-oaiTypeLabel", "x-stainless-const",
        "discriminator", "deprecated", "title", "x-oaiExpandable"}


def convert(node, defs, spec, todo, owner=None):
    """`owner`: the schema being converted (draft 2019's "$recursiveRef": "#" refers to it)."""
    if isinstance(node, list):
        return [convert(v, defs, spec, todo, owner) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in DROP or k == "$recursiveAnchor":
            continue
        if k == "$recursiveRef":
            out["$ref"] = f"#/$defs/{owner}"
            continue
        if k == "$ref":
            name = v.rsplit("/", 1)[1]
            if name not in defs:
                todo.append(name)
            out[k] = f"#/$defs/{name}"
        elif k in ("properties", "$defs"):
            out[k] = {p: convert(s, defs, spec, todo, owner) for p, s in v.items()}
        else:
            out[k] = convert(v, defs, spec, todo, owner)
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def main(spec_path):
    spec = json.load(open(spec_path))["components"]["schemas"]
    defs, todo = {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in defs:
            defs[name] = None
            defs[name] = convert(spec[name], defs, spec, todo, name)
    out = os.path.join(os.path.dirname(__file__), "openai_schemas.json")
    with open(out, "w") as f:
        json.dump({"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": defs}, f,
                  indent=1, sort_keys=True)
    print(f"wrote {out}: {len(defs)} schemas")


if __name__ == "__main__":
    main(sys.argv[1])
