"""The artifact code digest (maxjax/aot/manifest.py): computed from the package's own imports, it
changes with every file that can reach a graph and with no other, in a source tree and in an
installed package alike. Each test works on a copy of this package's sources."""
from __future__ import annotations

import os
import shutil
import tomllib

import pytest

from maxjax.aot import manifest as mf

IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def copy_sources(dest, installed: bool) -> str:
    """This package's sources under `dest`, in the installed layout (maxjax/graphs/) or the
    source-tree one (graphs/ beside maxjax/)."""
    root = mf.package_root()
    shutil.copytree(os.path.join(root, "maxjax"), os.path.join(dest, "maxjax"), ignore=IGNORE)
    for pkg, top in mf.SOURCE_DIRS.items():
        here = os.path.join(root, *pkg.split("."))
        if not os.path.isdir(here):                  # this package is a source tree
            target = os.path.join(dest, *pkg.split(".")) if installed else os.path.join(dest, top)
            shutil.copytree(os.path.join(root, top), target, ignore=IGNORE)
        elif not installed:
            shutil.move(os.path.join(dest, *pkg.split(".")), os.path.join(dest, top))
    return str(dest)


def source_file(src: str, module: str) -> str:
    parts = module.split(".")
    for pkg, top in mf.SOURCE_DIRS.items():
        if module.startswith(pkg + ".") and os.path.isdir(os.path.join(src, top)):
            parts = [top] + module[len(pkg) + 1:].split(".")
    return os.path.join(src, *parts) + ".py"


@pytest.fixture
def src(tmp_path):
    return copy_sources(tmp_path / "src", installed=False)


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_every_file_that_reaches_a_graph_changes_the_digest(src):
    code = mf.graph_code(src)
    for module in ("sampling", "step", "decoder", "config", "program", "llama", "gemma3"):
        assert f"maxjax.graphs.{module}" in code
    assert "maxjax.aot.graphs" in code
    # the C++ of the CPU kernels' custom calls counts too
    assert {f"maxjax.graphs.kernels/{f}" for f in ("quant_linear.cc", "paged_attention.cc")} \
        <= set(code)
    assert not any(m.startswith(("maxjax.server", "maxjax.cli")) for m in code)
    base = mf.code_digest(src)
    for module, path in code.items():
        with open(path, "rb") as f:
            original = f.read()
        _append(path, "\n# edited\n")
        assert mf.code_digest(src) != base, module
        with open(path, "wb") as f:
            f.write(original)
    assert mf.code_digest(src) == base


def test_files_that_reach_no_graph_leave_it(src):
    base = mf.code_digest(src)
    for module in ("maxjax.server.app", "maxjax.engine.scheduler", "maxjax.cli.main",
                   "maxjax.aot.load"):
        assert module not in mf.graph_code(src)
        _append(source_file(src, module), "\n# edited\n")
    assert mf.code_digest(src) == base


def test_imports_anywhere_join_it(src):
    """A new module of maxjax.graphs, and the imports in its functions, relative ones included,
    in every form a statement takes."""
    with open(source_file(src, "maxjax.graphs.extra"), "w") as f:
        f.write("def f():\n    from ..engine import scheduler\n    import maxjax.cli.main\n"
                "    from maxjax.server import (\n        app,  # a comment\n"
                "        metrics as m,\n    )\n"
                "import os, maxjax.engine.plan as plan; import maxjax.aot.load\n"
                "from maxjax import errors, \\\n    bench\nimport os, \\\n    maxjax.cli.__main__\n")
    code = mf.graph_code(src)
    assert {"maxjax.graphs.extra", "maxjax.engine.scheduler", "maxjax.cli.main",
            "maxjax.server.app", "maxjax.server.metrics", "maxjax.engine.plan",
            "maxjax.aot.load", "maxjax.bench", "maxjax.cli.__main__"} <= set(code)
    assert "maxjax.engine.block_manager" in code     # imported by the scheduler


def test_a_source_tree_and_an_installed_package_give_one_digest(tmp_path):
    tree = copy_sources(tmp_path / "tree", installed=False)
    installed = copy_sources(tmp_path / "site-packages", installed=True)
    assert os.path.isfile(os.path.join(installed, "maxjax", "graphs", "step.py"))
    assert mf.code_digest(tree) == mf.code_digest(installed) == mf.code_digest()


def test_source_dirs_are_pyprojects_package_dirs():
    path = os.path.join(mf.package_root(), "pyproject.toml")
    if not os.path.isfile(path):
        pytest.skip("an installed package has no pyproject.toml")
    with open(path, "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    assert {k: v for k, v in package_dir.items() if k != v} == mf.SOURCE_DIRS


def test_every_kernel_source_is_package_data():
    """A wheel holds what pyproject's package-data names: a kernel source or header left out
    turns the CPU kernels off on every non-editable install (the library fails to build)."""
    import fnmatch
    root = mf.package_root()
    path = os.path.join(root, "pyproject.toml")
    if not os.path.isfile(path):
        pytest.skip("an installed package has no pyproject.toml")
    with open(path, "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["maxjax.graphs"]
    kernels = os.path.join(root, mf.SOURCE_DIRS["maxjax.graphs"], "kernels")
    files = [f"kernels/{f}" for f in sorted(os.listdir(kernels)) if not f.startswith(".")]
    assert files and [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
