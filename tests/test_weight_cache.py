"""Converted weights in the compile cache (maxjax/aot/weight_cache.py), through the engine's one
builder (maxjax.LLM -> build_core): the first start stores what it converted, the next reads it
back instead of converting (the same params leaf for leaf, the same tokenizer and config, the
same greedy tokens, nothing compiled); a flipped byte in any of its files is refused with a
warning, the checkpoint converted again and the entry rebuilt; the key follows the checkpoint's
files, the encoding and the kernels but not the engine's flags; weights over a quarter of the
cap are not stored; `maxjax cache list` names the entry; `maxjax warm-cache` stores them too.
A tiny random Llama (HF directory, float32) and a tiny q4_1 GGUF packed for the CPU kernels
(tests/tiny_llama.py)."""
from __future__ import annotations

import logging
import json
import os

import jax
import numpy as np
import pytest

import maxjax
from maxjax.aot import cache, weight_cache
from maxjax.cli.main import main
from maxjax.engine import build, compile_counter
from maxjax.graphs import cpu_kernels
from tiny_llama import write_tiny_gguf, write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

ENGINE = dict(max_batch_size=2, max_batch_input_tokens=8, max_length=32, num_kv_pages=8,
              kv_cache_page_size=8)
GREEDY = maxjax.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 7, 9], [40, 41, 42, 43]]


@pytest.fixture()
def root(seeded_cache):
    return seeded_cache


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


def _start(path, caplog, encoding="float32", **extra):
    caplog.clear()
    before = compile_counter.count()
    with caplog.at_level(logging.INFO):
        llm = maxjax.LLM(path, quantization_encoding=encoding, **{**ENGINE, **extra})
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return llm, tokens, compile_counter.count() - before, caplog.text


def _weights(root: str) -> str:
    (e,) = cache.entries(root, kind="weights")
    return e.path


def _same_params(a, b) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _no_conversion(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the checkpoint was converted")
    monkeypatch.setattr(build, "load", refuse)


def test_the_second_start_reads_what_the_first_converted(llama, root, caplog, monkeypatch):
    first, tokens, _, text = _start(llama, caplog)
    assert "stored the converted weights" in text
    path = _weights(root)
    with monkeypatch.context() as mp:
        _no_conversion(mp)
        second, again, compiles, text = _start(llama, caplog)
    assert "read the converted weights" in text
    assert again == tokens and compiles == 0
    a, b = first.core.model, second.core.model
    _same_params(a.params, b.params)
    assert b.config == a.config and b.dtype == a.dtype and b.name == a.name
    assert b.chat_template == a.chat_template and b.source == a.source
    assert type(b.tokenizer) is type(a.tokenizer)
    assert b.tokenizer.get_vocab() == a.tokenizer.get_vocab()
    assert b.tokenizer("hello world")["input_ids"] == a.tokenizer("hello world")["input_ids"]
    assert b.tokenizer.added_tokens_decoder == a.tokenizer.added_tokens_decoder
    # stored beside the config, so that a load need not parse tokenizer.json for them in Python
    with open(os.path.join(path, weight_cache.TOKENIZER, "tokenizer_config.json")) as f:
        stored = json.load(f)["added_tokens_decoder"]
    assert stored == {str(i): t.__getstate__() for i, t in a.tokenizer.added_tokens_decoder.items()}
    assert os.path.isdir(path)


def test_the_weights_read_are_the_entrys_pages_and_outlive_it(llama, root, caplog):
    """Read weights map params.bin (the page cache's pages, no copy); an entry removed while an
    engine runs from it (evicted, refused by another start) leaves that engine's weights whole."""
    _, tokens, _, _ = _start(llama, caplog)
    second, again, _, text = _start(llama, caplog)
    assert "read the converted weights" in text and again == tokens
    params = os.path.realpath(os.path.join(_weights(root), weight_cache.PARAMS))
    with open("/proc/self/maps") as f:
        assert any(line.rstrip().endswith(params) for line in f)
    cache.remove(_weights(root))
    assert not os.path.exists(params)
    assert [o.token_ids for o in second.generate(PROMPTS, GREEDY)] == tokens


@pytest.mark.skipif(cpu_kernels.unavailable() is not None, reason="no CPU kernels here")
def test_a_4bit_gguf_packed_for_the_kernels_round_trips(tmp_path, root, caplog, monkeypatch):
    from gguf import GGMLQuantizationType as T
    path = write_tiny_gguf(tmp_path / "tiny.gguf", T.Q4_1)
    first, tokens, _, _ = _start(path, caplog, encoding=None, use_experimental_kernels=True)
    assert cpu_kernels.kernels_of(first.core.model.params)
    with monkeypatch.context() as mp:
        _no_conversion(mp)
        second, again, compiles, _ = _start(path, caplog, encoding=None,
                                            use_experimental_kernels=True)
    assert again == tokens and compiles == 0
    _same_params(first.core.model.params, second.core.model.params)
    # XLA's path is another key: converted (not packed) for it
    third, _, _, text = _start(path, caplog, encoding=None, use_experimental_kernels=False)
    assert "stored the converted weights" in text and not cpu_kernels.kernels_of(
        third.core.model.params)
    assert len(cache.entries(root, kind="weights")) == 2


@pytest.mark.parametrize("damaged", [weight_cache.PARAMS, "tokenizer/tokenizer_config.json",
                                     "manifest.json"])
def test_a_flipped_byte_is_refused_and_the_entry_rebuilt(llama, root, caplog, damaged):
    _, tokens, _, _ = _start(llama, caplog)
    target = os.path.join(_weights(root), damaged)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    _, again, _, text = _start(llama, caplog)
    assert "WARNING" in text and "refused" in text and "converting the checkpoint" in text
    assert "stored the converted weights" in text       # rebuilt
    assert again == tokens
    _, _, _, text = _start(llama, caplog)
    assert "read the converted weights" in text and "WARNING" not in text


def test_the_key_follows_the_checkpoint_encoding_and_kernels(llama, tmp_path, monkeypatch):
    key = weight_cache.key(llama, {}, None, "float32", False)
    assert key == weight_cache.key(llama, {}, None, "float32", False)
    assert key != weight_cache.key(llama, {}, None, "int8", False)
    assert key != weight_cache.key(llama, {}, None, "float32", True)
    assert key != weight_cache.key(llama, {"rope_type": "neox"}, None, "float32", False)
    config = os.path.join(llama, "config.json")
    stat = os.stat(config)
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        assert key != weight_cache.key(llama, {}, None, "float32", False)
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # a --chat-template file is one entry however its path was typed
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    assert weight_cache.key(llama, {}, "t.jinja", "float32", False) == \
        weight_cache.key(llama, {}, str(tmp_path / "t.jinja"), "float32", False) != key


def test_another_engine_flag_reads_the_same_weights(llama, root, caplog):
    _start(llama, caplog)
    _, _, _, text = _start(llama, caplog, max_length=24)
    assert "read the converted weights" in text
    assert len(cache.entries(root, kind="weights")) == 1


def test_weights_over_a_quarter_of_the_cap_are_not_stored(llama, root, caplog, monkeypatch):
    monkeypatch.setenv("MAXJAX_CACHE_MAX_SIZE", "100K")
    _, _, _, text = _start(llama, caplog)
    assert "not stored: over a quarter of the cap" in text
    assert cache.entries(root, kind="weights") == []


def test_cache_list_names_the_entry(llama, root, caplog, capsys):
    _start(llama, caplog)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    name = os.path.basename(_weights(root))
    assert any(line.startswith(name) and "converted weights" in line for line in out.splitlines())
    assert main(["cache", "clear"]) == 0
    assert cache.entries(root) == []


def test_warm_cache_stores_what_serve_reads(llama, root, caplog, monkeypatch, capsys):
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    assert main(["warm-cache", "--model-path", llama, "--quantization-encoding", "float32",
                 *flags]) == 0
    assert "converted weights stored: " in capsys.readouterr().out
    _weights(root)
    with monkeypatch.context() as mp:
        _no_conversion(mp)
        _, _, compiles, text = _start(llama, caplog)
    assert "read the converted weights" in text and compiles == 0
