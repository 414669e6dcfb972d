"""Every flag of `max serve` (docs/reference/max-serve-flags.txt, its flag reference) against
`maxjax serve`: each one parses; each is either served, with a test elsewhere that fails when it
does nothing (FLAG_TESTS: the flag -> those tests), or refused beyond its default with one line
naming it (maxjax/cli/reference_flags.py, checked here); a `max serve` config file of reference
names loads."""
from __future__ import annotations

import importlib
import os
import re

import pytest
from flag_tests import FLAG_TESTS

from maxjax import cli
from maxjax.cli import reference_flags
from maxjax.cli.main import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(ROOT, "docs", "reference", "max-serve-flags.txt")


def reference() -> dict[str, list[str]]:
    """First name -> all names of each `• --name[, --other] [<value>]` entry."""
    flags = {}
    for line in open(REFERENCE, encoding="utf-8"):
        if line.startswith("• --"):
            names = re.findall(r"--[a-z0-9-]+", line.split("<")[0])
            flags[names[0]] = [n for n in names if not n.startswith("--no-")]
    return flags


FLAGS = reference()
REFUSED = {f"--{r.name}": r for r in reference_flags.REFUSED}


def test_the_reference_is_whole():
    assert len(FLAGS) == 152 and "--model" in FLAGS and "--weight-path" in FLAGS


def serve_options() -> set[str]:
    sp = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {s for a in sp._actions for s in a.option_strings}


def test_every_reference_flag_parses():
    known = serve_options()
    missing = [n for names in FLAGS.values() for n in names if n not in known]
    assert not missing, f"maxjax serve does not parse: {missing}"


def test_every_flag_is_served_with_a_behaviour_test_or_refused():
    both = sorted(set(FLAG_TESTS) & set(REFUSED))
    neither = sorted(set(FLAGS) - set(FLAG_TESTS) - set(REFUSED))
    assert not both, f"refused and said to be served: {both}"
    assert not neither, f"neither refused nor pointed at a behaviour test: {neither}"
    assert set(FLAG_TESTS) | set(REFUSED) <= set(FLAGS)


def test_behaviour_tests_exist():
    for flag, node_ids in FLAG_TESTS.items():
        assert node_ids, flag
        for node in node_ids:
            path, name = node.split("::")
            module = importlib.import_module(os.path.basename(path).removesuffix(".py"))
            assert callable(getattr(module, name, None)), f"{flag}: no test {node}"


def refused_value(r) -> list[str]:
    """A command-line value of flag `r` that maxjax does not serve."""
    if r.kind is bool:
        return [f"--{r.name}", "false" if True in r.accept else "true"]
    if r.choices:
        return [f"--{r.name}", next(c for c in r.choices if c not in r.accept)]
    return [f"--{r.name}", "7" if r.kind in (int, float) else "x"]


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_are_one_line_naming_the_flag(flag, capsys):
    code = cli.main(["serve", *refused_value(REFUSED[flag])])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"maxjax: error: Error building the server: {flag}") or \
        line.startswith(f"maxjax: error: Error building the server: --no-{flag[2:]}"), line
    assert "not supported: " in line


def test_refused_flags_at_their_defaults_are_accepted():
    for r in reference_flags.REFUSED:
        for value in r.accept:
            if value is None:
                continue
            argv = [f"--{r.name}"] if value is True else [f"--{r.name}", str(value).lower()]
            args = build_parser().parse_args(["serve", *argv])
            reference_flags.check(reference_flags.ReferenceOnly(
                **{reference_flags._dest(r.name): getattr(args, reference_flags._dest(r.name))}))


def test_a_max_serve_config_file_loads(tmp_path):
    """Reference names (dashes), the refused ones at their defaults, in YAML."""
    from maxjax.cli.args import build, read_config_file
    from maxjax.engine.config import EngineConfig
    path = tmp_path / "max.yaml"
    path.write_text("max-batch-size: 8\nmax-length: 512\nenable-prefix-caching: false\n"
                    "kv-cache-hash-algo: sha256\ndevice-graph-capture: false\nep-size: 1\n"
                    "pipeline-role: prefill_and_decode\nenable-in-flight-batching: true\n"
                    "max-batch-total-tokens: 4096\nserved-model-name: my-model\nport: 8100\n")
    args = build_parser().parse_args(["serve", "--config-file", str(path)])
    data = read_config_file(str(path), args.command_parser)
    reference_flags.check(build(reference_flags.ReferenceOnly, args, data))
    cfg = build(EngineConfig, args, data)
    assert (cfg.max_batch_size, cfg.max_length, cfg.enable_prefix_caching,
            cfg.kv_cache_hash_algo, cfg.max_batch_total_tokens) == (8, 512, False, "sha256", 4096)
    path.write_text("cascade: true\n")
    code = cli.main(["serve", "--config-file", str(path)])
    assert code == 2
