"""Converted weights stored in the artifacts with orbax (maxjax/aot/weights.py): a 2-device
mesh's bfloat16 store and a one-device int8 store (QuantizedWeight pytrees) restore the params
bit for bit, in the declared shardings, without converting the checkpoint or compiling
anything, and serve the same greedy tokens as the converted params; a store for another
encoding, mesh or checkpoint falls back to the normal load; a damaged one is a one-line
UserError (every file sha256-checked: one flipped byte in any is refused). Tiny random Llama
(tests/tiny_llama.py) on the 4 host devices tests/conftest.py forces."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.aot import export, weights
from maxjax.aot import manifest as mf
from maxjax.engine import compile_counter
from maxjax.engine.build import on_devices
from maxjax.engine.config import EngineConfig
from maxjax.engine.plan import EnginePlan, plan_layout
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from maxjax.graphs.quant import QuantizedWeight
from maxjax.graphs.sharding import mesh_over, params_mesh
from maxjax.llm import LLM
from maxjax.models import loader
from test_tensor_parallel import assert_declared_shardings
from tiny_llama import write_tiny_llama

ENGINE = dict(max_batch_size=1, max_batch_input_tokens=2, max_length=32, num_kv_pages=8,
              kv_cache_page_size=8)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 33, 7, 100], [40, 41]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny4w"), num_kv_heads=4)


def warm(path, directory, encoding: str, devices: str | None = None, store=None):
    """What `maxjax warm-cache --artifacts-dir DIR` does, in this process; the placed model."""
    cfg = EngineConfig(devices=devices, quantization_encoding=encoding, **ENGINE)
    placed = on_devices(loader.load_model(path, encoding, progress=False), cfg)
    export.write_artifacts(str(directory), placed, EnginePlan(cfg, plan_layout(cfg, placed)), ["cpu"],
                           progress=False, store_weights=store)
    return placed


@pytest.fixture(scope="module")
def bf16_mesh(tiny_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16-tp2") / "art"
    return str(d), warm(tiny_path, d, "bfloat16", "cpu:2")   # stored by default on a mesh


@pytest.fixture(scope="module")
def int8_one(tiny_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("int8") / "art"
    return str(d), warm(tiny_path, d, "int8", store=True)


def forbid_conversion(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the checkpoint was converted")
    monkeypatch.setattr(loader, "load_params", refuse)


def assert_same_params(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_mesh_artifacts_restore_the_weights_into_their_shardings(tiny_path, bf16_mesh,
                                                                 monkeypatch):
    d, placed = bf16_mesh
    data = json.loads(open(os.path.join(d, mf.MANIFEST)).read())
    assert data["weights"]["degree"] == 2 and data["weights"]["dtype"] == "bfloat16"
    forbid_conversion(monkeypatch)
    before = compile_counter.count()
    # the converted params against the restored ones, on the same executables
    ref = LLM(placed, devices="cpu:2", precompiled_artifacts=[d], **ENGINE).generate(PROMPTS,
                                                                                     GREEDY)
    llm = LLM(tiny_path, quantization_encoding="bfloat16", devices="cpu:2",
              precompiled_artifacts=[d], require_compiled_artifacts=True, **ENGINE)
    assert_same_params(llm.core.model.params, placed.params)
    assert llm.core.model.config == placed.config and placed.config.qkv_shards == 2
    assert_declared_shardings(llm.core, 2)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref]
    assert compile_counter.count() == before      # restoring, loading and serving compiled nothing


def test_int8_store_on_one_device(tiny_path, int8_one, monkeypatch):
    d, placed = int8_one
    assert isinstance(placed.params["layers"][0]["wqkv"], QuantizedWeight)
    forbid_conversion(monkeypatch)
    ref = LLM(placed, precompiled_artifacts=[d], **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(tiny_path, quantization_encoding="int8", precompiled_artifacts=[d], **ENGINE)
    assert_same_params(llm.core.model.params, placed.params)
    assert params_mesh(llm.core.model.params) is None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref]


def test_describe_and_abstract_round_trip_4bit_nodes():
    w = QuantizedWeight(jnp.zeros((16, 8), jnp.uint8), jnp.ones((1, 8)), None, jnp.ones(8), bits=4)
    tree = {"layers": [{"w": w, "b": jnp.zeros(3, jnp.bfloat16)}], "t": (jnp.zeros(2),)}
    desc = json.loads(json.dumps(weights.describe(tree)))
    back = weights.abstract(desc, None)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert back["layers"][0]["w"].bits == 4 and back["layers"][0]["w"].offset is None
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(back)] == \
        [(a.shape, a.dtype) for a in jax.tree.leaves(tree)]


def test_mismatched_or_damaged_stores(tiny_path, int8_one, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(int8_one[0], d)
    placed = int8_one[1]
    hook = weights.params_source([str(d)])
    arch, cfg = placed.arch, placed.config
    _, params = hook(arch, cfg, "int8", tiny_path)
    assert_same_params(params, placed.params)
    # another encoding, another mesh, another checkpoint: the normal load
    assert hook(arch, cfg, "float32", tiny_path) is None
    mesh = mesh_over(jax.devices()[:2])
    assert weights.params_source([str(d)], mesh)(arch, cfg, "int8", tiny_path) is None
    other = tmp_path / "other-checkpoint"
    shutil.copytree(tiny_path, other)
    with open(other / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    assert hook(arch, cfg, "int8", str(other)) is None
    # every file is hashed: one flipped byte in any of them is refused, naming the file
    files = json.loads((d / mf.MANIFEST).read_text())["weights"]["files"]
    assert all(len(f["sha256"]) == 64 for f in files.values())
    for name in files:
        path = d / weights.WEIGHTS_DIR / name
        blob = path.read_bytes()
        path.write_bytes(blob[:len(blob) // 2] + bytes([blob[len(blob) // 2] ^ 1]) +
                         blob[len(blob) // 2 + 1:])
        with pytest.raises(UserError, match=f"stored weights file weights/{name} fails its "
                                            "sha256 check") as e:
            hook(arch, cfg, "int8", tiny_path)
        assert "\n" not in str(e.value)
        path.write_bytes(blob)
    # a data file cut short, then gone: one-line errors
    biggest = max(files, key=lambda n: files[n]["bytes"])
    path = d / weights.WEIGHTS_DIR / biggest
    blob = path.read_bytes()
    path.write_bytes(blob[:-10])
    with pytest.raises(UserError, match=f"stored weights file weights/{biggest} is of another "
                                        "size; recreate the artifacts") as e:
        hook(arch, cfg, "int8", tiny_path)
    assert "\n" not in str(e.value)
    path.unlink()
    with pytest.raises(UserError, match="is missing"):
        hook(arch, cfg, "int8", tiny_path)
    # the same size, other bytes: the sha256 names the file, whatever orbax made of it
    path.write_bytes(b"\xff" * len(blob))
    with pytest.raises(UserError, match=f"weights/{biggest} fails its sha256 check") as e:
        hook(arch, cfg, "int8", tiny_path)
    assert "\n" not in str(e.value)


def test_a_damaged_store_is_one_line_from_a_real_process(tiny_path, int8_one, tmp_path):
    """orbax's reads that were still running when another failed report into a closed event
    loop: hundreds of tracebacks around the error line, before the restore quieted them."""
    import subprocess
    import sys
    d = tmp_path / "damaged"
    shutil.copytree(int8_one[0], d)
    with open(d / weights.WEIGHTS_DIR / "manifest.ocdbt", "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 1]))
    env = dict(os.environ, PYTHONWARNINGS="ignore", MAXJAX_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "maxjax.cli", "generate", "--model", tiny_path,
                           "--precompiled-artifacts", str(d), "--prompt", "hi"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "weights/manifest.ocdbt fails its sha256 check" in proc.stderr.splitlines()[-1]
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, \
        proc.stderr[-3000:]


def test_an_artifact_directory_takes_the_umask_not_mkdtemps_0700(int8_one):
    """Artifacts are built to be copied to and served by others (another machine, a service
    account): the directory is as open as the user's umask makes new ones."""
    import stat
    from maxjax.aot import group
    assert stat.S_IMODE(os.stat(int8_one[0]).st_mode) == 0o777 & ~group._umask()
    assert group._umask() == os.umask(group._umask())
