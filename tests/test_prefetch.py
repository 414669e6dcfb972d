"""The warm start's prefetch (maxjax/aot/prefetch.py): a start records which compile cache entry
its request loaded; the next start with the same request deserializes that entry's executables
while the weights load and the loader takes them (same greedy tokens, nothing compiled); another
request (a flag, the checkpoint's files) has another key; a damaged entry is never deserialized
early, and the loader then refuses and rebuilds it as before; a prefetch for another entry is
waited for and discarded. Tiny random Llama (tests/tiny_llama.py)."""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

import maxjax
from maxjax.aot import cache, prefetch
from maxjax.aot import manifest as mf
from maxjax.engine import build, compile_counter
from maxjax.engine.config import EngineConfig
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

ENGINE = dict(max_batch_size=2, max_batch_input_tokens=8, max_length=32, num_kv_pages=8,
              kv_cache_page_size=8)
GREEDY = maxjax.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def setup(tmp_path, seeded_cache):
    """(checkpoint, cache root): the root holds the graphs earlier tests compiled for the same
    tiny shapes (a graph entry's key is the model's shapes and flags, not its path), but no
    prefetch record, so each test's first start still records its request."""
    return str(write_tiny_llama(tmp_path / "tiny")), seeded_cache


def _start(path, caplog, **extra):
    caplog.clear()
    before = compile_counter.count()
    with caplog.at_level(logging.INFO):
        llm = maxjax.LLM(path, quantization_encoding="float32", **{**ENGINE, **extra})
    tokens = [o.token_ids for o in llm.generate([[5, 7, 9], [40, 41, 42, 43]], GREEDY)]
    return tokens, compile_counter.count() - before, caplog.text


def test_the_second_start_deserializes_while_the_weights_load(setup, caplog):
    path, root = setup
    first, _, _ = _start(path, caplog)
    (name,) = os.listdir(os.path.join(root, prefetch.REQUESTS))
    second, compiles, text = _start(path, caplog)
    assert second == first and compiles == 0
    n = len(mf.read_manifest(_entry(root), "x").data["graphs"])
    assert f"({n} executables, {n} deserialized while the weights loaded, 0 compiled" in text
    # another flag: another request key (and another entry)
    _, _, text = _start(path, caplog, max_length=24)
    assert "deserialized while the weights loaded" not in text
    assert len(os.listdir(os.path.join(root, prefetch.REQUESTS))) == 2


def test_the_executables_deserialize_on_several_threads(setup, caplog, monkeypatch):
    """A warm start's critical path is deserializing: the prefetch spreads it over the cores."""
    from maxjax.aot import graphs
    path, root = setup
    first, _, _ = _start(path, caplog)
    threads, real = set(), graphs.load_executable

    def recording(*a, **k):
        threads.add(threading.current_thread().name)
        time.sleep(0.05)            # each thread's first one still runs when the next starts
        return real(*a, **k)
    monkeypatch.setattr(graphs, "load_executable", recording)
    again, compiles, text = _start(path, caplog)
    assert again == first and compiles == 0 and "deserialized while the weights loaded" in text
    n = len(mf.read_manifest(_entry(root), "x").data["graphs"])
    assert len(threads) == min(4, os.cpu_count() or 1, n), threads
    assert all(t.startswith("maxjax-deserialize") for t in threads)


def test_a_damaged_entry_is_not_deserialized_early(setup, caplog):
    path, root = setup
    first, _, _ = _start(path, caplog)
    entry = _entry(root)
    exe = next(f for f in sorted(os.listdir(entry)) if f.endswith(".xlaexe"))
    with open(os.path.join(entry, exe), "r+b") as f:
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 0xFF]))
    again, compiles, text = _start(path, caplog)
    assert "deserialized while the weights loaded" not in text
    assert "refused" in text and again == first
    mf.check_files(mf.read_manifest(_entry(root), ""), "")     # rebuilt whole


def test_the_request_key_follows_the_checkpoint_and_the_flags(setup):
    path, _ = setup
    key = prefetch.request_key(path, EngineConfig(**ENGINE), None)
    assert key == prefetch.request_key(path, EngineConfig(**ENGINE), None)
    assert key != prefetch.request_key(path, EngineConfig(**{**ENGINE, "max_length": 16}), None)
    assert key != prefetch.request_key(path, EngineConfig(**ENGINE), "template.jinja")
    with open(os.path.join(path, "config.json"), "a") as f:
        f.write(" ")
    assert key != prefetch.request_key(path, EngineConfig(**ENGINE), None)


def test_a_prefetch_for_another_entry_is_waited_for_and_dropped(setup, caplog):
    path, root = setup
    _start(path, caplog)
    early = prefetch.Prefetch(_entry(root))
    assert early.take(os.path.join(root, "another")) == {}
    assert early._future.done()
    assert set(prefetch.Prefetch(_entry(root)).take(_entry(root))) == \
        {g["name"] for g in mf.read_manifest(_entry(root), "x").data["graphs"]}


def test_an_early_prefetch_is_taken_over_by_the_start_that_asks_for_it(setup, caplog):
    path, root = setup
    first, _, _ = _start(path, caplog)
    flags = EngineConfig(quantization_encoding="float32", **ENGINE)
    build.prefetch_early(path, flags)           # what `maxjax serve` does before its imports
    assert build._EARLY
    second, compiles, text = _start(path, caplog)
    assert not build._EARLY and second == first and compiles == 0
    assert "deserialized while the weights loaded" in text
    # one for other flags: waited for and dropped; the start prefetches its own
    _start(path, caplog, max_length=24)
    build.prefetch_early(path, flags.replace(max_length=24))
    (request, early), = build._EARLY.values()
    again, compiles, text = _start(path, caplog)
    assert not build._EARLY and early._future.done() and again == first and compiles == 0
    assert "deserialized while the weights loaded" in text


def test_artifacts_deserialize_while_the_weights_load(setup, caplog, tmp_path):
    """--precompiled-artifacts: its first directory's executables deserialize while the
    weights load, started by the start itself or by `maxjax serve` before its imports."""
    path, _ = setup
    first, _, _ = _start(path, caplog)
    art = str(tmp_path / "art")
    from maxjax.aot import export
    export.export_engine(art, maxjax.LLM(path, quantization_encoding="float32", **ENGINE).core)
    again, compiles, text = _start(path, caplog, precompiled_artifacts=[art])
    assert again == first and compiles == 0
    assert "deserialized while the weights loaded" in text
    build.prefetch_early(path, EngineConfig(quantization_encoding="float32", **ENGINE),
                         artifacts=[art])
    assert build._EARLY
    again, compiles, text = _start(path, caplog, precompiled_artifacts=[art])
    assert not build._EARLY and again == first and compiles == 0
    assert "deserialized while the weights loaded" in text


def _entry(root: str) -> str:
    """The graph entry the last start loaded (touched on use: the most recently used)."""
    return cache.entries(root, kind="graphs")[-1].path
