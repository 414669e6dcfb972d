"""The chunked forms of the recurrences (graphs/recurrent.py `scan_chunks`: Gated DeltaNet's
`chunk_delta`, Mamba2's `chunk_ssd`) equal the token scans (`scan_rows`) on ragged steps: rows
whose boundaries fall inside chunks, prompts several chunks long, states carried from a previous
step's slot, a decode row of one token, and padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.graphs import recurrent
from maxjax.graphs.gated_deltanet import chunk_delta, delta_step
from maxjax.graphs.granitemoehybrid import chunk_ssd, ssd_step
from maxjax.graphs.step import RowSlice, build_step_inputs

H, DK, DV, SIZE, T, R, SLOTS = 3, 8, 6, 8, 96, 6, 7

# (start position, tokens, slot) a row: a fresh 30-token prompt (4 chunks), a decode token on a
# carried state, a continued prompt of 21, a 1-token row at position 0, a 9-token continuation
ROWS = [(0, 30, 3), (17, 1, 1), (40, 21, 5), (0, 1, 2), (5, 9, 6)]


def ragged_step(rows=ROWS):
    slices = [RowSlice(token_ids=[1] * n, start_pos=s, pages=list(range(1, 41)), state_slot=slot)
              for s, n, slot in rows]
    return build_step_inputs(slices, T, R, 40, 4, state=True)


def random_inputs(rng):
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(T, H, DK))) * DK ** -0.5
    k = unit(rng.normal(size=(T, H, DK)))
    v = rng.normal(size=(T, H, DV))
    g = -rng.uniform(0.0, 1.5, size=(T, H))           # strong and weak decays
    beta = rng.uniform(0.0, 1.0, size=(T, H))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)]


def real_tokens(rows=ROWS):
    return sum(n for _, n, _ in rows)


def test_layout_puts_each_row_in_chunks_of_its_own():
    step = ragged_step()
    lay = recurrent.chunk_layout(step, SIZE)
    index = np.asarray(lay.index)
    assert index.shape == (recurrent.num_chunks(T, R, SIZE), SIZE)
    rows = np.asarray(step.token_row)
    for chunk in index:
        held = chunk[chunk < T]
        assert len(set(rows[held])) <= 1                 # one row a chunk
        assert list(held) == list(range(held[0], held[0] + len(held))) if len(held) else True
    # 30 -> 4 chunks, 1, 21 -> 3, 1, 9 -> 2
    assert int((index[:, 0] < T).sum()) == 11
    assert np.asarray(lay.last).sum() == len(ROWS)
    n = real_tokens()
    np.testing.assert_array_equal(index.reshape(-1)[np.asarray(lay.at)[:n]], np.arange(n))


@pytest.mark.parametrize("size", [4, SIZE, 32])
def test_chunked_delta_rule_equals_token_scan(size):
    rng = np.random.default_rng(size)
    q, k, v, g, beta = random_inputs(rng)
    pool = jnp.asarray(rng.normal(size=(SLOTS, H, DK, DV)), jnp.float32)   # carried states
    step = ragged_step()
    want, want_pool = recurrent.scan_rows(delta_step, (q, k, v, jnp.exp(g), beta), pool, step)
    got, got_pool = jax.jit(chunk_delta, static_argnames="size")(q, k, v, g, beta, pool, step,
                                                                 size=size)
    n = real_tokens()
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(got_pool), np.asarray(want_pool), atol=2e-4, rtol=1e-4)
    assert not np.allclose(np.asarray(got_pool[3]), np.asarray(pool[3]))   # written back


@pytest.mark.parametrize("size", [4, SIZE, 32])
def test_chunked_ssd_equals_token_scan(size):
    rng = np.random.default_rng(10 + size)
    x = jnp.asarray(rng.normal(size=(T, H, DV)), jnp.float32)
    b, c = (jnp.asarray(rng.normal(size=(T, H, DK)), jnp.float32) for _ in range(2))
    dt = jnp.asarray(rng.uniform(0.01, 1.0, size=(T, H)), jnp.float32)
    log_decay = dt * -jnp.asarray(rng.uniform(0.1, 2.0, size=(H,)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(SLOTS, H, DK, DV)), jnp.float32)
    step = ragged_step()
    want, want_pool = recurrent.scan_rows(ssd_step, (x, b, c, jnp.exp(log_decay), dt), pool, step)
    got, got_pool = jax.jit(chunk_ssd, static_argnames="size")(x, b, c, log_decay, dt, pool, step,
                                                                size=size)
    n = real_tokens()
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(got_pool), np.asarray(want_pool), atol=2e-4, rtol=1e-4)


def test_prompt_over_two_steps_equals_one_step():
    """A 50-token prompt prefilled in one chunked step, and in two (cut at 23, inside a chunk),
    its state carried through the pool, give the same outputs and final state."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta = random_inputs(rng)
    pool = jnp.zeros((SLOTS, H, DK, DV), jnp.float32)
    one, one_pool = chunk_delta(q, k, v, g, beta, pool, ragged_step([(0, 50, 4)]), SIZE)
    first, pool = chunk_delta(q, k, v, g, beta, pool, ragged_step([(0, 23, 4)]), SIZE)
    later = [a[23:].at[:].get() for a in (q, k, v, g, beta)]
    later = [jnp.concatenate([a, jnp.zeros((23,) + a.shape[1:], a.dtype)]) for a in later]
    second, pool = chunk_delta(*later, pool, ragged_step([(23, 27, 4)]), SIZE)
    np.testing.assert_allclose(np.concatenate([first[:23], second[:27]]), np.asarray(one[:50]),
                               atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(pool[4]), np.asarray(one_pool[4]), atol=2e-4,
                               rtol=1e-4)


def test_the_form_follows_the_bucket():
    assert recurrent.chunked(ragged_step(), 64)                  # 96 slots, 6 rows: 7 chunks
    assert recurrent.chunked(ragged_step(), SIZE)                # 17 chunks of 8 <= 96 / 4
    decode = build_step_inputs([RowSlice([1], 3, [1], state_slot=1)] * 8, 8, 8, 1, 4, state=True)
    assert not recurrent.chunked(decode, 4)                      # a token a row: 8 chunks
    mixed = build_step_inputs([RowSlice([1] * 9, 0, [1, 2, 3], state_slot=1)], 16, 8, 3, 4,
                              state=True)
    assert not recurrent.chunked(mixed, 64)                      # up to 8 chunks for 16 slots
