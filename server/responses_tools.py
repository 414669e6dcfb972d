"""The tools of a Responses request as the model sees them: function tools, a namespace's
functions flattened to the names Codex gives them, built-in tools (the provider runs them) left
out and named for the X-Dropped-Tools header. Used by server/responses_request.py and
server/responses_api.py."""
from __future__ import annotations

from .protocol import APIError


def _bad(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", param=param)


# The tools OpenAI runs itself: a request's are left out here (X-Dropped-Tools says so), unless
# its tool_choice names one.
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26",
                  "web_search_preview_2025_03_11", "file_search", "code_interpreter",
                  "image_generation", "computer_use_preview", "computer_use", "mcp")


def flat_name(namespace: str, name: str) -> str:
    """A namespace's function as the model sees it: Codex's flat name (ToolName's
    canonical_flat_name), `namespace__name`."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def function_tools(tools: list | None) -> tuple[list[dict], dict[str, tuple[str, str]]]:
    """The request's tools as the function tools the model sees (a namespace's functions
    flattened, built-in tools left out), and each flattened name -> (namespace, name): a call
    goes back as its namespace's. Any other kind of tool is a 400."""
    out, namespaced = [], {}
    for i, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in BUILT_IN_TOOLS:
            continue
        if kind == "namespace":
            if not isinstance(t.get("name"), str) or not isinstance(t.get("tools"), list):
                raise _bad(f"tools[{i}]", "a namespace needs a string name and a list of tools")
            for j, f in enumerate(t["tools"]):
                if not isinstance(f, dict) or f.get("type") != "function":
                    raise _bad(f"tools[{i}].tools[{j}].type", "only function tools are "
                                                              "supported in a namespace")
                if not isinstance(f.get("name"), str):
                    raise _bad(f"tools[{i}].tools[{j}].name", "required (a string)")
                namespaced[flat_name(t["name"], f["name"])] = (t["name"], f["name"])
                out.append({**f, "name": flat_name(t["name"], f["name"])})
        elif kind == "function":
            out.append(t)
        else:
            raise _bad(f"tools[{i}].type", f"only function, namespace and built-in tools are "
                                           f"supported (got {kind!r})")
    return out, namespaced


def dropped_tools(tools: list | None) -> list[str]:
    """The built-in tools a request listed, left out: `tools[i] (type)`."""
    return [f"tools[{i}] ({t['type']})" for i, t in enumerate(tools or [])
            if isinstance(t, dict) and t.get("type") in BUILT_IN_TOOLS]
