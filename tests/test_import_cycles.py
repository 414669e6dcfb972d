"""No import cycle between maxjax's modules (maxjax/, graphs/ as maxjax.graphs, server/ as
maxjax.server: pyproject.toml's package map), read with the standard library alone (`ast`).

What counts as an edge, and why:
- every `import` and `from ... import` in a module, at its top AND inside its functions. A
  function-local import written to dodge a circular import at load time is still two modules
  that each need the other: neither can be understood, tested or moved alone, which is the
  design fault the rule is about (STYLE.md, "Import knots"). So the lazy ones count too.
- `from pkg import name` is an edge to the submodule `pkg.name` when that is a module, else to
  `pkg` itself (a name defined in its __init__).
- importing `a.b.c` also runs a/__init__ and a/b/__init__, but those parent-package edges are
  not counted: every module would then depend on maxjax/__init__.py, and its one lazy
  `__getattr__` (maxjax.LLM) would tie the whole tree into one knot that no layering fixes.
  The package's own imports (maxjax/__init__.py -> maxjax.llm) do count, as for any module.
- `if TYPE_CHECKING:` blocks would not count (nothing runs them); there are none today.
A cycle is a strongly connected component of two or more modules (Tarjan); the failure names
each one with the edges inside it and the line of each import.
"""
from __future__ import annotations

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_dirs() -> dict[str, str]:
    """pyproject.toml's [tool.setuptools] package-dir: package -> directory (read with a regex:
    tomllib is 3.11+, and the one line is enough)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    line = re.search(r"^package-dir\s*=\s*\{(.*)\}\s*$", text, re.M)
    assert line, "pyproject.toml has no [tool.setuptools] package-dir line"
    return dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w./]+)"', line.group(1)))


def module_files() -> dict[str, str]:
    """Every module of the map: dotted name -> file. A directory that is its own package in the
    map (graphs/ is maxjax.graphs, not maxjax.graphs under maxjax/) is walked once, as its own."""
    dirs = package_dirs()
    mapped = {os.path.normpath(os.path.join(ROOT, d)) for d in dirs.values()}
    out = {}
    for pkg, d in dirs.items():
        top = os.path.normpath(os.path.join(ROOT, d))
        for here, subdirs, files in os.walk(top):
            subdirs[:] = [s for s in subdirs if not s.startswith((".", "__"))
                          and os.path.normpath(os.path.join(here, s)) not in mapped]
            rel = os.path.relpath(here, top)
            parts = [] if rel == "." else rel.split(os.sep)
            for f in files:
                if f.endswith(".py"):
                    name = f[:-3]
                    out[".".join([pkg, *parts, *([] if name == "__init__" else [name])])] = \
                        os.path.join(here, f)
    return out


def _under_type_checking(node, parents) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(module: str, path: str, modules: dict) -> dict[str, int]:
    """The maxjax modules `module` imports: name -> line of the first such import."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or \
                _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [known(a.name) for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base)
                       for a in node.names]
        for t in targets:
            if t and t != module:
                out.setdefault(t, node.lineno)
    return out


def import_graph() -> tuple[dict, dict]:
    modules = module_files()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}, modules


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_map_covers_the_three_trees():
    modules = module_files()
    for name in ("maxjax.engine.plan", "maxjax.graphs.decoder", "maxjax.server.app",
                 "maxjax.aot.cache", "maxjax.models.loader"):
        assert name in modules, name
    assert not any(m.startswith("maxjax.maxjax") for m in modules)


def test_the_checker_finds_a_cycle_and_counts_function_level_imports():
    # the checker itself must be able to fail: a two-module knot through a lazy import, and a
    # three-module ring
    assert cycles({"a": {"b": 1}, "b": {"a": 9}, "c": {"a": 1}}) == [["a", "b"]]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    graph, _ = import_graph()
    # a function-level import is an edge: engine/build.py imports the aot package lazily
    assert "maxjax.aot.cache" in graph["maxjax.engine.build"]


def test_no_import_cycle_between_modules():
    graph, modules = import_graph()
    found = cycles(graph)
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        for m in comp:
            for target, line in sorted(graph[m].items()):
                if target in comp:
                    rel = os.path.relpath(modules[m], ROOT)
                    lines.append(f"    {m} -> {target}  ({rel}:{line})")
    assert not found, "import cycles:\n" + "\n".join(lines)


if __name__ == "__main__":       # a listing for refactoring: python tests/test_import_cycles.py
    g, _ = import_graph()
    for c in cycles(g):
        print(" <-> ".join(c))
    sys.exit(0)
