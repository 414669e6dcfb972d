"""The weights' encoding is the planner's one choice (maxjax/engine/encoding.py, made in
`Prepared.with_header`): `maxjax suggest` reports the encoding the built engine then serves, for
the embedded SmolLM2 GGUF (Q4_1 blocks: int8 by default, its own q4_1 where the CPU kernels
run) with and without --quantization-encoding, the kernels on and off."""
from __future__ import annotations

import json

import pytest

from maxjax import cli
from maxjax.cli.main import _setup, build_parser
from maxjax.engine.build import build_core
from maxjax.models.source import embedded_model_path

pytestmark = pytest.mark.slow
# conftest.py's smollm2_chat engine: the kernels' default, no --quantization-encoding
SHARED = ["--max-length", "512", "--max-batch-size", "16", "--max-batch-input-tokens", "128",
          "--kv-cache-page-size", "16", "--num-kv-pages", "300"]
SMALL = ["--max-length", "512", "--max-batch-size", "1", "--max-batch-input-tokens", "4",
         "--num-kv-pages", "64"]       # three step graphs
OFF = "--no-use-experimental-kernels"


def suggested(capsys, argv: list[str]) -> tuple[dict, object]:
    """`maxjax suggest --json`'s report and the EnginePlan it made for `argv`."""
    from maxjax.cli.suggest import suggested_plan
    assert cli.main(["suggest", "--json", *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    model_opts, flags = _setup(build_parser().parse_args(["suggest", *argv]))
    return report, suggested_plan(model_opts, flags)


def built(argv: list[str]):
    model_opts, flags = _setup(build_parser().parse_args(["serve", *argv]))
    return build_core(model_opts.source(), flags)


def check(report: dict, plan, core, want: str) -> None:
    assert report["path"] == embedded_model_path()
    assert report["encodings"]["serving"] == core.model.dtype == want
    assert report["weights"]["encoding"] == want
    assert plan == core.plan and core.plan.config.quantization_encoding == want


def test_default_with_the_kernels_default(capsys, smollm2_chat):
    core = smollm2_chat[0].core
    report, plan = suggested(capsys, SHARED)
    want = "q4_1" if core.plan.kernels else "int8"
    assert report["encodings"]["default"] == want and report["plan"]["cpu_kernels"] == \
        core.plan.kernels
    check(report, plan, core, want)


@pytest.mark.parametrize("extra,want", [
    ([OFF], "int8"),                                         # the default without the kernels
    ([OFF, "--quantization-encoding", "q4_1"], "q4_1"),      # the blocks asked for, XLA's path
    (["--quantization-encoding", "int8"], "int8"),           # int8 asked for, kernels' default
])
def test_asked_or_default_with_the_kernels_on_and_off(capsys, extra, want):
    report, plan = suggested(capsys, [*SMALL, *extra])
    core = built([*SMALL, *extra])
    assert not (OFF in extra and core.plan.kernels)
    check(report, plan, core, want)
