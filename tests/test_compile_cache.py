"""The compile cache (maxjax/aot/cache.py) through the engine's one builder (maxjax.LLM ->
build_core), on a tiny random Llama: a second start loads every graph (no compilation, same
greedy tokens); a graph-shaping flag, the model's config or tokenizer, a recorded version or
the device kind give another entry; a corrupt, truncated or incomplete entry is refused with a
warning and rebuilt; two processes filling it at once leave one valid entry; --no-compile-cache
and MAXJAX_NO_COMPILE_CACHE write nothing; LRU eviction under the size cap; `maxjax cache`."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import OrderedDict

import pytest

import maxjax
from maxjax.aot import cache, export, prefetch, weight_cache
from maxjax.aot import manifest as mf
from maxjax.aot.manifest import MANIFEST
from maxjax.cli.main import build_parser, main
from maxjax.engine import compile_counter
from maxjax.engine.config import EngineConfig
from maxjax.engine.plan import plan_layout
from maxjax.errors import UserError
from maxjax.models.loader import load_model
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

# Two step graphs, their two samplers and the KV initializer: a start that misses compiles five
ENGINE = dict(max_batch_size=2, max_batch_input_tokens=2, max_length=64, num_kv_pages=24,
              kv_cache_page_size=8)
PROMPTS = [[5, 7, 9], [11, 3, 8, 20, 31, 4, 9, 100, 7, 2, 12]]
GREEDY = maxjax.SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


def start(model, root, **options):
    """(LLM, XLA compilations its start took, how each graph was obtained) with the compile
    cache in `root`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAXJAX_CACHE_DIR", str(root))
        before = compile_counter.count()
        llm = maxjax.LLM(model, **{**ENGINE, **options})
        compiles = compile_counter.count() - before
    sources = {getattr(e, "source", "jit") for e in llm.core.runner.executables.values()}
    return llm, compiles, sources


def tokens(llm) -> list:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def entries_in(root) -> list[str]:
    """The compiled entries and temp directories (not the prefetch's request pointers, the
    converted weights, tests/test_weight_cache.py, nor transformers' index file,
    tests/test_transformers_index.py)."""
    return sorted(n for n in os.listdir(root)
                  if n != prefetch.REQUESTS and not n.startswith(weight_cache.PREFIX)
                  and not n.startswith(".transformers-index-"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, "float32", progress=False)


@pytest.fixture(scope="module")
def filled(model, tmp_path_factory):
    """A cache filled by one start: (root, entry path, that start's greedy tokens)."""
    root = tmp_path_factory.mktemp("compile-cache")
    llm, _, sources = start(model, root)
    assert sources == {"compiled"}          # a miss: compiled here, stored
    (name,) = entries_in(root)
    return root, os.path.join(root, name), tokens(llm)


def copy_of(filled, tmp_path) -> tuple[str, str]:
    root, entry, _ = filled
    shutil.copytree(root, tmp_path / "c")
    return str(tmp_path / "c"), str(tmp_path / "c" / os.path.basename(entry))


def test_second_start_loads_every_graph(model, filled):
    root, entry, first = filled
    llm, compiles, sources = start(model, root)
    assert compiles == 0 and sources == {"executable"}
    assert len(llm.core.runner.executables) == len(llm.core.layout.buckets)
    assert tokens(llm) == first
    assert llm.stats().xla_compiles_since_ready == 0
    assert entries_in(root) == [os.path.basename(entry)]


def test_graph_shaping_flag_misses_and_the_cap_evicts(model, filled, tmp_path):
    root, entry = copy_of(filled, tmp_path)
    os.utime(entry, (time.time() - 60, time.time() - 60))
    llm, _, sources = start(model, root, max_batch_input_tokens=4, compile_cache_max_size="1")
    assert sources == {"compiled"}
    (name,) = entries_in(root)      # the new entry is kept, the older one over the cap went
    assert name != os.path.basename(entry)
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == filled[2][:1]


def test_a_new_entry_takes_the_graphs_another_entry_compiled(model, filled, tmp_path,
                                                             monkeypatch):
    """A bucket set that adds one bucket compiles that graph alone: the buckets, samplers and
    KV initializer it shares with the filled entry are byte-identical exports, whose executables
    are copied from there or from this process's memory (cache.Donors). Under other XLA flags
    nothing is taken. Artifacts exported from an engine take every graph the same way."""
    monkeypatch.setattr(cache.Donors, "_memory", OrderedDict())    # this test's compiles alone
    root, entry = copy_of(filled, tmp_path)
    old = {g["name"] for g in mf.read_manifest(entry, "").data["graphs"]}
    llm, compiles, _ = start(model, root, max_batch_input_tokens=4)
    (new_entry,) = set(entries_in(root)) - {os.path.basename(entry)}
    graphs = mf.read_manifest(os.path.join(root, new_entry), "").data["graphs"]
    reused = {g["name"] for g in graphs if g.get("reused")}
    assert reused == old & {g["name"] for g in graphs} and "kv_init" in reused
    assert compiles == len(graphs) - len(reused) > 0
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == filled[2]
    # the copies are files of the new entry: it loads with the donor gone
    cache.remove(entry)
    again, compiles, sources = start(model, root, max_batch_input_tokens=4)
    assert compiles == 0 and sources == {"executable"}
    # artifacts of that engine take every graph from the cache (or memory): nothing compiled
    with monkeypatch.context() as mp:
        mp.setenv("MAXJAX_CACHE_DIR", str(root))
        before = compile_counter.count()
        export.export_engine(str(tmp_path / "artifacts"), again.core)
        assert compile_counter.count() == before
    arts = mf.read_manifest(str(tmp_path / "artifacts"), "").data["graphs"]
    assert all(g.get("reused") for g in arts) and len(arts) == len(graphs)
    with monkeypatch.context() as mp:       # --no-compile-cache: the cache is not read
        mp.setenv("MAXJAX_CACHE_DIR", str(root))
        mp.setattr(cache.Donors, "_memory", OrderedDict())
        before = compile_counter.count()
        export.export_engine(str(tmp_path / "uncached"), again.core, compile_cache=False)
        assert compile_counter.count() - before == len(graphs)
    served, compiles, sources = start(model, tmp_path / "none", max_batch_input_tokens=4,
                                      precompiled_artifacts=[str(tmp_path / "artifacts")])
    assert compiles == 0 and sources == {"executable"}
    assert [o.token_ids for o in served.generate(PROMPTS, GREEDY)] == filled[2]
    # an empty cache in this process: every graph was compiled (or taken) here before
    _, compiles, sources = start(model, tmp_path / "fresh", max_batch_input_tokens=4)
    assert compiles == 0 and sources == {"compiled"}
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX2")
    root, entry = copy_of(filled, tmp_path / "isa")
    start(model, root)
    (isa_entry,) = set(entries_in(root)) - {os.path.basename(entry)}
    assert not any(g.get("reused") for g in
                   mf.read_manifest(os.path.join(root, isa_entry), "").data["graphs"])


def test_model_tokenizer_version_device_and_xla_flags_change_the_entry(model, filled, tmp_path,
                                                                      monkeypatch):
    from maxjax.engine.plan import plan_engine
    plan = plan_engine(EngineConfig(**ENGINE, quantization_encoding="float32"), model)
    here = cache.entry_path(model, plan, filled[0])
    assert here == filled[1]
    other_model = load_model(write_tiny_llama(tmp_path / "eps", rms_norm_eps=1e-6), "float32",
                             progress=False)
    other_template = dataclasses.replace(model, chat_template="{{ messages }}")
    paths = {here, cache.entry_path(other_model, plan, filled[0]),
             cache.entry_path(other_template, plan, filled[0])}
    with monkeypatch.context() as mp:
        real = mf.versions()
        mp.setattr(mf, "versions", lambda: {**real, "jax": "0.0.1"})
        paths.add(cache.entry_path(model, plan, filled[0]))
        # the loader checks the manifest's versions too: an entry from other versions is refused
        root, entry = copy_of(filled, tmp_path)
        assert cache.load(entry, model, plan) is None
        assert not os.path.exists(entry)
    flags = os.environ.get("XLA_FLAGS", "")
    # XLA flags that shape the code (an ISA cap) give another entry; the device count does not
    monkeypatch.setenv("XLA_FLAGS", flags + " --xla_force_host_platform_device_count=7")
    assert cache.entry_path(model, plan, filled[0]) == here
    monkeypatch.setenv("XLA_FLAGS", flags + " --xla_cpu_max_isa=AVX2")
    paths.add(cache.entry_path(model, plan, filled[0]))
    monkeypatch.setenv("XLA_FLAGS", flags)
    device = mf.local_device()
    monkeypatch.setattr(mf, "local_device", lambda: {**device, "device_kind": "other-cpu"})
    paths.add(cache.entry_path(model, plan, filled[0]))
    assert len(paths) == 6


def _truncate(path):
    name = next(f for f in sorted(os.listdir(path)) if f.endswith(".xlaexe") and "step" in f)
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)


def _garbage_manifest(path):
    with open(os.path.join(path, MANIFEST), "w") as f:
        f.write('{"format": "maxjax-artifacts", "graphs": [')


def _missing_file(path):
    os.remove(os.path.join(path, next(f for f in sorted(os.listdir(path)) if f.endswith(".xlaexe"))))


def _flipped_byte(path):
    name = next(f for f in sorted(os.listdir(path)) if f.endswith(".xlaexe") and "step" in f)
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def _flipped_manifest_byte(path):
    """Damage that keeps the JSON valid: one digit of the creation time (the seal catches it)."""
    p = os.path.join(path, MANIFEST)
    text = open(p).read()
    i = text.index('"created": "') + len('"created": "') + 3
    open(p, "w").write(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])


@pytest.mark.parametrize("damage", [_truncate, _garbage_manifest, _missing_file, _flipped_byte,
                                    _flipped_manifest_byte])
def test_a_bad_entry_is_refused_and_rebuilt(model, filled, tmp_path, caplog, damage):
    root, entry = copy_of(filled, tmp_path)
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="maxjax.cache"):
        llm, _, sources = start(model, root)
    assert sources == {"compiled"}
    refused = [r.getMessage() for r in caplog.records
               if "refused" in r.getMessage() and r.levelno == logging.WARNING]
    assert refused and refused[0].endswith("; removing it and compiling again"), caplog.text
    assert "warm-cache" not in refused[0], refused     # the artifacts' advice is not the cache's
    assert tokens(llm) == filled[2]
    assert entries_in(root) == [os.path.basename(entry)]      # rebuilt, and whole again
    again, compiles, sources = start(model, root)
    assert compiles == 0 and sources == {"executable"}


def test_no_compile_cache_writes_nothing(model, tmp_path, monkeypatch):
    root = tmp_path / "none"
    llm, _, sources = start(model, root, compile_cache=False)
    assert sources == {"jit"} and not root.exists()
    monkeypatch.setenv("MAXJAX_NO_COMPILE_CACHE", "1")
    start(model, root)
    assert not root.exists()
    opts = build_parser().parse_args(["serve", "--no-compile-cache"])
    assert opts.compile_cache is False


def test_two_processes_filling_at_once_leave_one_valid_entry(model, model_dir, tmp_path):
    root = tmp_path / "shared"
    env = {**os.environ, "MAXJAX_CACHE_DIR": str(root), "JAX_ENABLE_COMPILATION_CACHE": "false"}
    cmd = [sys.executable, "-m", "maxjax.cli", "generate", "--model-path", model_dir,
           *[x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))],
           "--prompt", "w5 w7 w9", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "xla compiles: 5 total, 0 since ready" in err      # both compiled and stored
    assert outs[0][0] == outs[1][0]
    (name,) = entries_in(root)          # one entry, no temp directory left
    assert len(cache.entries(root, kind="weights")) == 1    # both stored them: one stays
    _, compiles, sources = start(model, root)
    assert compiles == 0 and sources == {"executable"}


def _fake_entry(root, name, size, used):
    path = os.path.join(root, name)
    os.makedirs(path)
    mf.write_manifest(path, {"model": {"name": name}, "graphs": [{}], "compiled_for": None})
    with open(os.path.join(path, "blob"), "wb") as f:
        f.write(b"\0" * size)
    os.utime(path, (used, used))
    return path


def test_lru_eviction_and_stale_temp_dirs(tmp_path):
    now = time.time()
    a = _fake_entry(tmp_path, "a", 1000, now - 30)
    b = _fake_entry(tmp_path, "b", 1000, now - 20)
    c = _fake_entry(tmp_path, "c", 1000, now - 10)
    cache.touch(a)                                   # a hit: a is now the most recent
    stale, fresh = tmp_path / ".tmp-old", tmp_path / ".tmp-writing"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (now - 2 * 86400, now - 2 * 86400))
    assert cache.evict(2500, keep=None, root=str(tmp_path)) == ["b"]
    assert cache.evict(0, keep=c, root=str(tmp_path)) == ["a"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-writing", "c"]


def test_size_cap_values(monkeypatch):
    assert cache.max_bytes("500M") == 500 << 20 and cache.max_bytes("1.5G") == 3 << 29
    assert cache.max_bytes("4096") == 4096
    monkeypatch.setenv("MAXJAX_CACHE_MAX_SIZE", "2G")
    assert cache.max_bytes() == 2 << 30
    with pytest.raises(UserError, match="--compile-cache-max-size 'lots': expected a size"):
        cache.max_bytes("lots")


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("MAXJAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.directory() == str(tmp_path / "maxjax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.directory() == str(tmp_path / "home" / ".cache" / "maxjax")


def test_cache_list_and_clear(filled, tmp_path, monkeypatch, capsys):
    root, entry = copy_of(filled, tmp_path)
    monkeypatch.setenv("MAXJAX_CACHE_DIR", root)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert f"compile cache: {root} (1 entries" in out
    assert os.path.basename(entry) in out and "5 graphs" in out
    index = os.path.join(root, ".transformers-index-0.pickle")     # transformers_index.py's
    with open(index, "wb") as f:
        f.write(b"index")
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert entries_in(root) == [] and not os.path.exists(index)


def test_pool_sized_from_memory_is_stable_across_starts(model, monkeypatch):
    """The pool shapes every graph: a few % more or less free memory keeps the same entry."""
    from maxjax.engine import memory
    cfg = EngineConfig(max_batch_size=256, quantization_encoding="float32")
    sizes = set()
    for free in (30_000_000, 29_100_000, 30_900_000):
        monkeypatch.setattr(memory, "device_free_bytes", lambda device=None, free=free: free)
        sizes.add(plan_layout(cfg, model).num_pages)
    assert len(sizes) == 1 and max(sizes) < 256 * 16 + 1    # sized by memory, not by the cap


def test_compile_jobs_from_the_environment(monkeypatch):
    from maxjax.aot import export
    monkeypatch.setenv("MAXJAX_COMPILE_JOBS", "3")
    assert export.default_jobs() == 3
    monkeypatch.setenv("MAXJAX_COMPILE_JOBS", "none")
    with pytest.raises(UserError, match="MAXJAX_COMPILE_JOBS 'none'"):
        export.default_jobs()
