"""Nothing outside the planner writes or derives a resolved start-up value (maxjax/engine/plan.py:
`prepare` + `plan_engine`), checked over the source with `ast` (no model, no JAX).

The argument: a resolved value can enter an engine in two ways only, by writing it into an
object or by computing it. Writing: EngineConfig (the user's flags), ResolvedConfig (their
resolved values), EnginePlan, EngineLayout and Prepared are frozen dataclasses, so a plain
assignment raises; the one way around that is `object.__setattr__(obj, ...)`, never used on
any of them, nor anywhere in the planner's modules (a resolved value is a new object,
`for_platform` / `replace`), and elsewhere only on `self` inside a class's own construction
(another frozen value's __post_init__). Computing: every
derivation of a resolved value is a function of the planner (the names in DERIVATIONS: platform
defaults, flag checks that resolve speculation depth and LoRA adapters, the kernels' choice, the
weights' encoding, the layout, the draft's sub-plan); a call to one of them outside the planner's
modules is a second place deciding what the plan decided. The entry points (serve, LLM,
warm-cache, suggest, a group's processes: tests/test_plan.py shows they build equal Plans) call
`prepare`, `Prepared.with_header` (the encoding, once the checkpoint's header is read: the
loader is given it) and `plan_engine` only.
"""
from __future__ import annotations

import ast
import os

from test_import_cycles import ROOT, module_files

PLANNER = {"maxjax.engine.plan", "maxjax.engine.spec_flags", "maxjax.engine.config",
           "maxjax.engine.encoding", "maxjax.engine.state_plan", "maxjax.engine.overlap_plan",
           "maxjax.engine.pins"}
DERIVATIONS = {"for_platform", "_resolved", "_resolved_for", "choose_kernels", "plan_layout", "draft_tokens",
               "lora_path_items", "resolve_max_length", "default_kv_format", "draft_plan",
               "lora_shape", "check_model_flags", "weights_encoding", "draft_encoding",
               "default_dtype", "gguf_encoding", "plan_state_pools", "check_hybrid_flags"}
# check_flags is also the name of other modules' own checks (step_policy, structured.backend),
# which the planner calls: only the planner's, imported from maxjax.engine.plan, counts.
PLANNER_ONLY_IMPORTS = {"check_flags"}
# The start-up values' types: no object.__setattr__ inside them, on `self` or not.
CONFIG_TYPES = {"EngineConfig", "ResolvedConfig", "EnginePlan", "EngineLayout", "Prepared", "Pins"}
# Not yet decided inside the Plan, listed so the list can only shrink: the draft model's
# sub-plan and encoding need the draft's own facts (head size, attention sinks, mesh; its
# checkpoint's header), read today when the draft loads; `draft_plan` and `draft_encoding` are
# the planner's functions, called where the draft is loaded.
KNOWN = {("maxjax.engine.draft", "draft_plan"), ("maxjax.engine.warm", "draft_plan"),
         ("maxjax.engine.draft", "draft_encoding")}


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def violations(source: str, module: str) -> list[str]:
    tree = ast.parse(source)
    out = []
    in_config_type = {id(n) for c in ast.walk(tree)
                      if isinstance(c, ast.ClassDef) and c.name in CONFIG_TYPES
                      for n in ast.walk(c)}
    planner_imports = {a.asname or a.name for n in ast.walk(tree)
                       if isinstance(n, ast.ImportFrom) and n.module == "maxjax.engine.plan"
                       for a in n.names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _called_name(node)
        if name == "__setattr__" and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func.value) == "object":
            target = ast.unparse(node.args[0]) if node.args else "?"
            if target != "self" or module in PLANNER or id(node) in in_config_type:
                out.append(f"{module}:{node.lineno}: object.__setattr__({target}, ...)")
        elif module not in PLANNER and name in DERIVATIONS and (module, name) not in KNOWN:
            out.append(f"{module}:{node.lineno}: {name}(...) outside the planner")
        elif module not in PLANNER and name in PLANNER_ONLY_IMPORTS and (
                name in planner_imports or ast.unparse(node.func).startswith("plan.")):
            out.append(f"{module}:{node.lineno}: the planner's {name}(...) outside it")
    return out


def test_the_check_can_fail():
    bad = ("from maxjax.engine.plan import check_flags\n"
           "def f(cfg, plan):\n"
           "    object.__setattr__(cfg, 'max_length', 9)\n"
           "    cfg.for_platform(None)\n"
           "    check_flags(cfg)\n"
           "    draft_tokens(cfg)\n")
    assert len(violations(bad, "maxjax.engine.build")) == 4
    assert violations("def f(self):\n    object.__setattr__(self, 'a', 1)\n", "m") == []
    # a config writing itself, even on construction
    fill = "class EngineConfig:\n    def __post_init__(self):\n        object.__setattr__(self, 'a', 1)\n"
    assert len(violations(fill, "maxjax.engine.other")) == 1
    assert len(violations("def f(self):\n    object.__setattr__(self, 'a', 1)\n",
                          "maxjax.engine.config")) == 1
    assert violations("def f(cfg):\n    cfg.for_platform('cuda')\n",
                      "maxjax.engine.plan") == []
    # the weights' encoding chosen again where they load (as the loader once did)
    again = "def f(ckpt):\n    return quantize.gguf_encoding(ckpt.types) or default_dtype('cpu')\n"
    assert len(violations(again, "maxjax.models.loader")) == 2
    assert violations(again, "maxjax.engine.encoding") == []


def test_nothing_outside_the_planner_writes_or_derives_a_resolved_value():
    found, known = [], set()
    for module, path in module_files().items():
        with open(path) as f:
            source = f.read()
        found += violations(source, module)
        known |= {(module, name) for m, name in KNOWN if m == module and f"{name}(" in source}
    assert not found, "\n".join(found)
    assert known == KNOWN, f"no longer needed, drop from KNOWN: {KNOWN - known}"


def test_the_resolved_types_are_frozen():
    import dataclasses

    from maxjax.engine.config import EngineConfig, ResolvedConfig
    from maxjax.engine.plan import EngineLayout, EnginePlan, Prepared
    for cls in (EngineConfig, ResolvedConfig, EngineLayout, EnginePlan, Prepared):
        assert cls.__dataclass_params__.frozen, cls.__name__
    assert os.path.isfile(os.path.join(ROOT, "maxjax", "engine", "plan.py"))
    assert all(f.name != "buckets" or f.type in ("tuple", tuple)
               for f in dataclasses.fields(EngineLayout))
