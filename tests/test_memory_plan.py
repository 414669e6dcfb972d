"""The KV pool planned from host RAM on the CPU (maxjax/engine/memory.py): every device of a mesh
and every data-parallel replica out of one MemAvailable; the one-line errors of a pool that does
not fit (`--num-kv-pages`, a pool of < 2 pages); and a GPU `--devices` on a CPU-only jax
(maxjax/engine/devices.py). No model compiles: a small config with abstract (or tiny) params and
a faked MemAvailable."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxjax.engine import devices, memory
from maxjax.engine.buckets import Bucket
from maxjax.engine.config import EngineConfig
from maxjax.engine.core import EngineCore
from maxjax.engine.plan import plan_layout
from maxjax.errors import UserError
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.decoder import abstract_params
from maxjax.graphs.sharding import mesh_over

GiB = 1 << 30
# 2 layers, 9 heads / 3 kv heads (SmolLM2's: over 4 devices attention and the pool stay whole)
SMALL = ModelConfig("LlamaForCausalLM", vocab_size=1024, hidden_size=144, intermediate_size=256,
                    num_layers=2, num_heads=9, num_kv_heads=3, head_dim=16,
                    max_position_embeddings=4096)
# 4 heads / 4 kv heads: over 4 devices the pool splits by kv heads
EVEN = ModelConfig("LlamaForCausalLM", vocab_size=1024, hidden_size=64, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                   max_position_embeddings=4096)
BUCKETS = [Bucket(1, 1), Bucket(256, 32)]
BIG = 1 << 40           # no cap: sized by memory


class FakeModel:
    """What plan_layout reads of a LoadedModel; params abstract, placed on `mesh` when given."""

    def __init__(self, cfg, mesh=None, dtype=jnp.float32):
        params = abstract_params(cfg, dtype)
        if mesh is not None:
            sh = NamedSharding(mesh, PartitionSpec())
            params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                  params)
        self.config, self.params, self.compute_dtype = cfg, params, dtype
        self.dtype = jnp.dtype(dtype).name


@pytest.fixture
def host(monkeypatch):
    """Set the host's MemAvailable the planner reads."""
    def set_free(free: int):
        monkeypatch.setattr(memory, "device_free_bytes", lambda device=None: free)
    set_free(16 * GiB)
    return set_free


def plan(cfg=SMALL, mesh=None, **kw):
    return memory.plan_pool(cfg, abstract_params(cfg, jnp.float32), 32, 0.9, BUCKETS, BIG,
                            mesh=mesh, **kw)


def mesh4():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 host devices (tests/conftest.py forces them)")
    return mesh_over(jax.devices()[:4])


def test_replicated_pool_on_a_4_device_mesh_is_a_quarter(host):
    """Every device's copy of a replicated pool is the same host RAM: a quarter of the pages."""
    one, four = plan(), plan(mesh=mesh4())
    assert one.host and four.host and (four.devices, four.pool_copies) == (4, 4)
    assert 0.24 < four.fit / one.fit <= 0.25
    assert 0.2 <= four.num_pages / one.num_pages <= 0.3
    assert four.weight_bytes == 4 * one.weight_bytes      # unplaced: a replica per device
    report = four.report()
    assert report.startswith(f"KV pool {four.num_pages * four.page_bytes / GiB:.2f} GiB on cpu "
                             "(replicated): host MemAvailable 16.0 GiB")
    for part in ("x 0.90 utilization", "weights ", "x 4 devices + pool", "activations of "
                 "step_t256_r32", "compiler allowance 1.00 GiB"):
        assert part in report


def test_pool_split_by_kv_heads_is_one_copy(host):
    """kv heads that divide by the devices split the pool: one copy in all, about the
    one-device pool (less the other devices' weights and activations)."""
    one, four = plan(EVEN), plan(EVEN, mesh=mesh4(), kv_shards=4)
    assert four.pool_copies == 1 and 0.9 < four.fit / one.fit < 1.0
    assert "(split by kv heads)" in four.report()


def test_plan_layout_counts_the_mesh_and_its_placement(host):
    """plan_layout reads the mesh off the placed params, and the kv-head rule off the config."""
    mesh = mesh4()
    host(400 << 20)        # sized by memory, under the cap of 256 rows at max length

    def cfg(**kw):
        return EngineConfig(max_length=4096, max_batch_size=256, **kw)
    alone = plan_layout(cfg(), FakeModel(SMALL))
    tp = plan_layout(cfg(devices="cpu:4"), FakeModel(SMALL, mesh))
    split = plan_layout(cfg(devices="cpu:4"), FakeModel(EVEN, mesh))
    assert alone.num_pages < 256 * 128
    assert tp.mesh is mesh and 0.2 <= tp.num_pages / alone.num_pages <= 0.3
    assert "(replicated)" in tp.memory_report and "(split by kv heads)" in split.memory_report


def test_resident_weights_by_their_shards():
    mesh = mesh4()
    x = np.zeros((8, 16), np.float32)
    replicated = jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    split = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "model")))
    assert memory.resident_weight_bytes({"a": replicated}, 4) == 4 * x.nbytes
    assert memory.resident_weight_bytes({"a": split}, 4) == x.nbytes
    assert memory.resident_weight_bytes({"a": x}, 4) == 4 * x.nbytes      # host: as replicated
    assert memory.resident_weight_bytes({"a": jnp.asarray(x)}, 1) == x.nbytes


def test_data_parallel_replicas_divide_the_host(host):
    one, three = plan(), plan(replicas=3)
    assert three.engines == 3 and 0.25 < three.fit / one.fit < 1 / 3

    def taken(p):       # the pool and what else one engine holds
        return p.fit * p.page_bytes + p.weight_bytes + p.activation_bytes + p.allowance
    assert abs(3 * taken(three) - taken(one)) < 3 * one.page_bytes + 3
    assert "/ 3 replicas = " in three.report()
    # a later replica: the earlier ones are out of MemAvailable already, it shares what is left
    assert plan(replicas=3, replica=2).engines == 1


def test_plan_layout_finds_which_replica(host):
    """--devices cpu:2 --data-parallel-degree 2: the second replica's mesh is device 1."""
    mesh1 = mesh_over(jax.devices()[1:2])
    cfg = EngineConfig(max_length=4096, devices="cpu:2", data_parallel_degree=2)
    first = plan_layout(cfg, FakeModel(SMALL, mesh_over(jax.devices()[:1])))
    second = plan_layout(cfg, FakeModel(SMALL, mesh1))
    assert "/ 2 replicas" in first.memory_report and "replicas" not in second.memory_report
    assert devices.replica_index("cpu:2", 2, mesh1) == 1


def test_num_kv_pages_beyond_the_host_is_refused_before_the_pool(host, monkeypatch):
    host(400 << 20)

    def cfg(**kw):
        return EngineConfig(max_length=4096, max_batch_size=256, **kw)
    fits = plan_layout(cfg(), FakeModel(SMALL))
    assert fits.num_pages < 256 * 128          # sized by memory
    ok = plan_layout(cfg(num_kv_pages=fits.num_pages), FakeModel(SMALL))
    assert ok.num_pages == fits.num_pages
    from maxjax.engine import core
    monkeypatch.setattr(core, "ModelRunner", lambda *a, **k: pytest.fail("pool allocated"))
    with pytest.raises(UserError) as e:
        EngineCore(FakeModel(SMALL), cfg(num_kv_pages=10 ** 8))
    msg = str(e.value)
    assert msg.startswith("--num-kv-pages 100000000 needs ") and "\n" not in msg
    assert "GiB of host memory" in msg and "GiB available" in msg
    assert re.search(r"lower it \(at most \d+ pages fit\)$", msg)
    # x the devices of a replicated pool: what fits one device does not fit four
    with pytest.raises(UserError, match="--num-kv-pages .* x 4 devices"):
        plan_layout(cfg(devices="cpu:4", num_kv_pages=fits.num_pages), FakeModel(SMALL, mesh4()))
    # x the replicas
    with pytest.raises(UserError, match="--num-kv-pages .* x 2 replicas"):
        plan_layout(cfg(data_parallel_degree=2, num_kv_pages=fits.num_pages), FakeModel(SMALL))
    # a later replica's pages were pinned by the first, whose memory is already taken
    later = cfg(devices="cpu:2", data_parallel_degree=2, num_kv_pages=10 ** 8)
    assert plan_layout(later, FakeModel(SMALL, mesh_over(jax.devices()[1:2]))).num_pages == 10 ** 8


def test_num_kv_pages_for_another_platform_is_not_checked_here(host):
    host(GiB // 64)
    cfg = EngineConfig(num_kv_pages=10 ** 6)
    cfg = cfg.for_platform("cuda")
    assert plan_layout(cfg, FakeModel(SMALL), "cuda").num_pages == 10 ** 6


def test_a_pool_under_two_pages_names_the_flags(host):
    host(2 << 20)
    with pytest.raises(UserError) as e:
        plan_layout(EngineConfig(), FakeModel(SMALL))
    msg = str(e.value)
    assert msg.startswith("the KV pool would have 0 pages; it needs at least 2: KV pool ")
    for flag in ("--max-batch-size", "--max-length", "--device-memory-utilization"):
        assert flag in msg
    with pytest.raises(UserError, match="--num-kv-pages 1: the KV pool needs at least 2 pages"):
        plan_layout(EngineConfig(num_kv_pages=1), FakeModel(SMALL))


def test_allowance_is_capped_on_a_small_host(host):
    big, small = plan(), (host(80 << 20), plan())[1]
    assert big.allowance == memory.COMPILER_ALLOWANCE
    assert small.allowance == ((80 << 20) + small.weight_bytes) // memory.ALLOWANCE_SHARE


# ---- the CLI, in real processes --------------------------------------------------------------

def run_cli(*args, timeout=240):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "maxjax.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("maxjax: error:")]


def test_cli_num_kv_pages_beyond_the_host_is_one_line(tmp_path):
    from tiny_llama import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    proc = run_cli("generate", "--model-path", model, "--num-kv-pages", "100000000",
                   "--prompt", "hi", "--max-new-tokens", "1", "--log-level", "WARNING",
                   "--no-compile-cache")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "--num-kv-pages 100000000 needs" in line and "lower it" in line
    assert proc.stderr.strip().splitlines() == [line]


@pytest.mark.skipif(bool(devices._gpu_plugins()), reason="a jax GPU plugin is installed")
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_gpu_on_a_cpu_only_jax_is_one_line(command):
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    proc = run_cli(command, "--devices", "gpu:0", *extra, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = error_lines(proc.stderr)
    # serve's start-up failures say `Error building`, which max serve's readiness loop watches for
    prefix = "maxjax: error: " + ("Error building the server: " if command == "serve" else "")
    assert line.startswith(prefix + "--devices gpu:0: this jax has no GPU backend")
    assert "maxjax[cuda]" in line and proc.stderr.strip().splitlines() == [line]


class FakeGpu:
    platform = "gpu"


def test_gpu_ids_beyond_the_gpus_name_the_count(monkeypatch):
    """With a GPU backend (faked: two GPUs), an ID or count past them is one line naming it."""
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [FakeGpu(), FakeGpu()])
    devices.select_platform("gpu:0,1")
    with pytest.raises(UserError, match=r"--devices gpu:2: no device 2 \(this machine has 2 GPUs "
                                        r"\(IDs 0-1\)\)"):
        devices.select_platform("gpu:2")
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [FakeGpu()])
    with pytest.raises(UserError, match=r"--devices gpu:0,1: no device 1 \(this machine has 1 "
                                        r"GPU \(ID 0\)\)"):
        devices.select_platform("gpu:0,1")


def test_gpu_plugin_without_a_gpu(monkeypatch):
    monkeypatch.setattr(devices, "_gpu_plugins", lambda: ["jax-cuda12-plugin"])
    msg = devices._no_backend(devices.parse("gpu"), AssertionError())
    assert msg == "--devices gpu: jax-cuda12-plugin is installed but finds no GPU on this machine"
    monkeypatch.setattr(devices, "_gpu_plugins", lambda: [])
    assert "pip install 'maxjax[cuda]'" in devices._no_backend(devices.parse("gpu:0"),
                                                               AssertionError())


def test_max_length_defaults_to_max_position_embeddings(host):
    """--max-length unset: the model's max_position_embeddings (not capped at 4096), while the
    default pool holds every row at up to 4096 tokens (and at least one at the model's length),
    not every row at the model's length."""
    import dataclasses
    long = dataclasses.replace(SMALL, max_position_embeddings=32768)
    layout = plan_layout(EngineConfig(max_batch_size=4), FakeModel(long))
    assert layout.max_length == 32768
    assert layout.max_pages_per_row == 32768 // 32
    assert layout.num_pages == 32768 // 32 + 1          # one row at max length
    wide = plan_layout(EngineConfig(max_batch_size=32), FakeModel(long))
    assert wide.max_length == 32768 and wide.num_pages == 32 * 4096 // 32 + 1
    given = plan_layout(EngineConfig(max_batch_size=4, max_length=1024), FakeModel(long))
    assert given.max_length == 1024 and given.num_pages == 4 * 1024 // 32 + 1


def test_max_length_default_lowered_to_the_pool_with_a_log_line(host, caplog):
    import dataclasses
    import logging
    long = dataclasses.replace(SMALL, max_position_embeddings=32768)
    with caplog.at_level(logging.INFO, logger="maxjax.engine"):
        layout = plan_layout(EngineConfig(max_batch_size=4, num_kv_pages=101), FakeModel(long))
    assert layout.max_length == 100 * 32 and layout.max_pages_per_row == 100
    (line,) = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert line.startswith("max length 3200 (the model's max_position_embeddings is 32768)")
    # given explicitly, --max-length is the user's: not lowered
    assert plan_layout(EngineConfig(max_batch_size=4, num_kv_pages=101, max_length=8192),
                       FakeModel(long)).max_length == 8192
