"""The seams of the compiled step (graphs/program.py), each alone on a tiny random Llama: sample
slots, the token mask, and the one `linear` through which every projection goes."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.engine.types import SamplingParams
from maxjax.graphs import layers, sampling
from maxjax.graphs.decoder import init_kv
from maxjax.graphs.program import sampled_step
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.models.loader import load_model
from tiny_llama import write_tiny_llama

PAGE, MAX_PAGES, HISTORY = 8, 8, 64
sample = jax.jit(sampling.sample_logits, static_argnames=("num_top_logprobs",))
PROMPT = [3, 17, 99, 4, 250, 8, 61, 12, 5, 300]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_llama(str(tmp_path_factory.mktemp("tiny"))), "float32")


@pytest.fixture(scope="module")
def run(model):
    """run(kv, rows, T, S, params) -> (SampleOutput as numpy, kv): one greedy step of one row."""
    fn = jax.jit(partial(sampled_step, model.arch, model.config, 5), donate_argnums=(1,))
    V = model.config.vocab_size

    def go(kv, rows, T, S, params=None):
        step = build_step_inputs(rows, T, len(rows), MAX_PAGES, PAGE, S)
        slots = [(SamplingParams(temperature=0.0, logprobs=True), PROMPT, [], 0, j)
                 for j in range(S)]
        samp = sampling.build_sampling_arrays(slots, S, HISTORY, vocab_size=V)
        (out, *_), kv = fn(params or model.params, kv, step, samp)
        return jax.tree.map(np.asarray, out), kv
    return go


def _prefilled(model, run):
    kv = init_kv(model.config, 4, PAGE, jnp.float32)
    out, kv = run(kv, [RowSlice(PROMPT, 0, [1, 2, 3])], 16, 1)
    return int(out.token_ids[0]), kv


def test_three_sample_slots_equal_three_single_steps(model, run):
    first, kv = _prefilled(model, run)
    fed = [first, 7, 11]          # any tokens: slot j samples after fed[j]
    out, kv = run(kv, [RowSlice(fed, len(PROMPT), [1, 2, 3], num_samples=3)], 4, 3)
    singles = []
    for j, tok in enumerate(fed):
        one, kv = run(kv, [RowSlice([tok], len(PROMPT) + j, [1, 2, 3])], 1, 1)
        singles.append(one)
    assert list(out.token_ids) == [int(s.token_ids[0]) for s in singles]
    np.testing.assert_allclose(out.logprobs, [s.logprobs[0] for s in singles], rtol=1e-4, atol=1e-5)


def test_slots_of_two_rows_are_flattened_in_row_order(model, run):
    first, kv = _prefilled(model, run)
    rows = [RowSlice([first, 7], len(PROMPT), [1, 2, 3], num_samples=2),
            RowSlice(PROMPT[:3], 0, [3], num_samples=1), RowSlice(PROMPT[:2], 0, [3], num_samples=0)]
    step = build_step_inputs(rows, 8, 4, MAX_PAGES, PAGE, 4)
    assert list(step.sample_idx) == [0, 1, 4, 0]          # the unused slot points at token 0
    out, _ = run(kv, rows[:1], 4, 2)
    assert out.token_ids.shape == (2,)


def _logits(R, V, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 3, (R, V)).astype(np.float32))


def _arrays(V, masks, temperature):
    rows = [(SamplingParams(temperature=temperature, seed=11 + r, logprobs=True), [1], [], 0, 0, m)
            for r, m in enumerate(masks)]
    return sampling.build_sampling_arrays(rows, len(rows), 16, vocab_size=V)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_ones_mask_changes_nothing(temperature):
    V = 1000
    words = sampling.mask_words(V)
    logits = _logits(4, V)
    ones = np.full(words, 0xFFFFFFFF, np.uint32)
    free = sample(logits, _arrays(V, [None] * 4, temperature), num_top_logprobs=3)
    masked = sample(logits, _arrays(V, [ones] * 4, temperature), num_top_logprobs=3)
    for a, b in zip(free, masked):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_token_mask_forces_that_token(temperature):
    V = 1000
    words = sampling.mask_words(V)
    forced = [0, 31, 32, V - 1]            # word edges and the last, partly used word
    masks = []
    for t in forced:
        m = np.zeros(words, np.uint32)
        m[t // 32] = np.uint32(1) << np.uint32(t % 32)
        masks.append(m)
    out = sample(_logits(4, V, seed=1), _arrays(V, masks, temperature), num_top_logprobs=2)
    assert list(np.asarray(out.token_ids)) == forced
    np.testing.assert_allclose(np.asarray(out.logprobs), 0.0, atol=1e-6)   # the only choice


def _with_deltas(params, make):
    layers_ = [{k: (make(w) if w.ndim == 2 else w) for k, w in p.items()} for p in params["layers"]]
    return {**params, "layers": layers_}


def test_linear_with_a_zero_delta_leaves_logits_unchanged(model, run):
    rank, T = 2, 16
    one_slot = jnp.ones((T, 1), jnp.float32)      # every token in the one adapter slot
    zero = _with_deltas(model.params, lambda w: layers.LowRankDelta(
        w, jnp.zeros((w.shape[0], 1, rank), w.dtype), (jnp.zeros((1, rank, w.shape[1]), w.dtype),),
        one_slot))
    step = build_step_inputs([RowSlice(PROMPT, 0, [1, 2, 3])], T, 1, MAX_PAGES, PAGE)
    fwd = jax.jit(partial(model.arch.forward, model.config))
    kv = init_kv(model.config, 4, PAGE, jnp.float32)
    base, _ = fwd(model.params, kv, step)
    same, _ = fwd(zero, kv, step)
    np.testing.assert_allclose(np.asarray(same), np.asarray(base), rtol=1e-6, atol=1e-6)

    rng = np.random.default_rng(0)

    def delta(w):
        a = jnp.asarray(rng.normal(0, 0.05, (w.shape[0], 1, rank)), w.dtype)
        b = jnp.asarray(rng.normal(0, 0.05, (1, rank, w.shape[1])), w.dtype)
        return layers.LowRankDelta(w, a, (b,), one_slot)
    deltas = _with_deltas(model.params, delta)
    merged = dict(deltas)
    merged["layers"] = [{k: (w.weight + w.a[:, 0] @ w.b[0][0] if isinstance(w, layers.LowRankDelta) else w)
                         for k, w in p.items()} for p in deltas["layers"]]
    got, _ = fwd(deltas, kv, step)
    want, _ = fwd(merged, kv, step)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(got), np.asarray(base), atol=1e-3)    # the delta is applied
