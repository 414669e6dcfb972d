"""The newer families (MLA, group-routed MoE, the hybrids with request-state pools) round trip through AOT artifacts and the compile cache with 0 compiles:
`warm-cache` on machine A (a subprocess with its own HOME and caches), then `generate` on A with
the same flags (its compile cache) and on machine B from a copy of the artifacts with the JAX
cache off; both compile nothing and print the same tokens. Tiny random checkpoints made by
transformers (the families' parity tests check their arithmetic)."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from families import MAKERS
from test_aot import SIZES, compiles, machine_env, maxjax
from tiny_llama import write_word_tokenizer

pytestmark = pytest.mark.slow

FLAGS = [*SIZES, "--num-kv-pages", "16", "--no-use-experimental-kernels"]
GEN = ["generate", "--prompt", "w5 w7 w9", "--prompt", "w11 w3 w8 w20 w31 w4 w9 w100 w7 w2 w12",
       "--max-new-tokens", "8", "--ignore-eos", "--json"]


FAMILIES = {name: MAKERS[name] for name in ("deepseek_v3", "glm4_moe", "qwen3_next",
                                            "granitemoehybrid")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param]().eval().save_pretrained(path / "model", safe_serialization=True)
    write_word_tokenizer(path / "model", 256)
    return path


def test_artifacts_and_compile_cache_round_trip_with_0_compiles(model_dir):
    model = str(model_dir / "model")
    env, cwd = machine_env(model_dir, "machine-a", cache=True)
    env["MAXJAX_CACHE_DIR"] = os.path.join(model_dir, "machine-a", "compile-cache")
    r = maxjax(["warm-cache", "--model-path", model, *FLAGS, "--target", "cpu"], env, cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    directory = re.search(r"^artifacts: (.+)$", r.stdout, re.M).group(1)

    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    cached = maxjax([*GEN, "--model-path", model, *FLAGS], env, cwd)
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert f"graphs from {directory} " in cached.stderr
    assert compiles(cached.stderr) == (0, 0)

    copy = os.path.join(model_dir, "machine-b", "artifacts")
    shutil.copytree(directory, copy)
    env_b, cwd_b = machine_env(model_dir, "machine-b", cache=False)
    loaded = maxjax([*GEN, "--model-path", model, "--precompiled-artifacts", copy], env_b, cwd_b)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert compiles(loaded.stderr) == (0, 0)
    assert loaded.stdout == cached.stdout and len(loaded.stdout.splitlines()) == 2
