"""graphs/recurrent.py: the ragged convolution and recurrence give, for every row, what one pass
over its whole sequence gives, whatever the chunk boundaries, with rows of other requests and
padding in the same step."""
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.graphs.recurrent import causal_conv, scan_rows
from maxjax.graphs.step import RowSlice, build_step_inputs

C, K, PAGE = 3, 4, 4


def full_conv(x, w):
    """Causal depthwise convolution of one whole sequence x [n, C] (zeros before it)."""
    pad = np.concatenate([np.zeros((K - 1, C)), x])
    return np.stack([(pad[t:t + K].T * w).sum(-1) for t in range(len(x))])


def full_scan(x):
    s, out = np.zeros(C), []
    for v in x:
        s = 0.5 * s + v
        out.append(s.copy())
    return np.stack(out)


def step_of(rows, slots, num_tokens=16):
    slices = [RowSlice(token_ids=[1] * n, start_pos=start, pages=list(range(1, 9)),
                       state_slot=slot) for (start, n), slot in zip(rows, slots)]
    return build_step_inputs(slices, num_tokens, 4, 8, PAGE, state=True)


@pytest.mark.parametrize("cuts", [(5,), (1, 4), (3, 2), (2, 1, 2)])
def test_chunks_equal_one_pass(cuts):
    rng = np.random.default_rng(len(cuts))
    w = rng.normal(size=(C, K))
    seqs = [rng.normal(size=(5, C)), rng.normal(size=(7, C))]   # two requests, slots 2 and 1
    conv_pool = jnp.asarray(rng.normal(size=(4, C, K - 1)), jnp.float32)  # stale values
    pool = jnp.asarray(rng.normal(size=(4, C)), jnp.float32)
    done = [0, 0]
    ys, ss = [[], []], [[], []]
    for n in cuts:       # request 0 in these chunks; request 1 always 1 token a step after 2
        rows, xs, who = [], [], []
        if n:
            rows.append((done[0], n)); xs.append(seqs[0][done[0]:done[0] + n]); who.append(0)
        m = min(2 if done[1] == 0 else 1, 7 - done[1])
        rows.append((done[1], m)); xs.append(seqs[1][done[1]:done[1] + m]); who.append(1)
        step = step_of(rows, [2 if w_ == 0 else 1 for w_ in who])
        x = np.zeros((16, C)); x[:sum(len(a) for a in xs)] = np.concatenate(xs)
        y, conv_pool = causal_conv(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
                                   None, conv_pool, step)
        out, pool = scan_rows(lambda s, v: (0.5 * s + v, 0.5 * s + v),
                              jnp.asarray(x, jnp.float32), pool, step)
        t = 0
        for r, (start, k) in zip(who, rows):
            ys[r].append(np.asarray(y[t:t + k])); ss[r].append(np.asarray(out[t:t + k]))
            done[r] += k
            t += k
    for r in range(2):
        n = done[r]
        np.testing.assert_allclose(np.concatenate(ys[r]), full_conv(seqs[r][:n], w), atol=1e-5)
        np.testing.assert_allclose(np.concatenate(ss[r]), full_scan(seqs[r][:n]), atol=1e-5)
    assert np.asarray(pool[2]) == pytest.approx(full_scan(seqs[0])[-1], abs=1e-5)
