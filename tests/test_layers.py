"""graphs/layers.py's RMSNorm sums in one fixed order: a row's result is the same to the bit
whatever the number of rows compiled beside it (XLA's own reduce orders its sums by shape)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxjax.graphs import layers as L

ROWS = (1, 2, 3, 8, 32, 256)


@pytest.mark.parametrize("n", [1, 5, 64, 576])
def test_sum_last_is_the_sum(n):
    x = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
    got = np.asarray(L.sum_last(jnp.asarray(x)))[:, 0]
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("d", [64, 576])
def test_rms_norm_of_a_row_does_not_depend_on_the_rows_beside_it(d, fused):
    rng = np.random.default_rng(d)
    h = rng.standard_normal((max(ROWS), d)).astype(np.float32) * 3
    res = rng.standard_normal((max(ROWS), d)).astype(np.float32) if fused else np.zeros_like(h)
    w = rng.standard_normal(d).astype(np.float32)
    step = jax.jit(lambda h, res, w: L.rms_norm(h + res, w, 1e-5) if fused
                   else L.rms_norm(h, w, 1e-5))
    alone = np.concatenate([np.asarray(step(h[i:i + 1], res[i:i + 1], w)) for i in range(len(h))])
    for rows in ROWS:
        together = np.asarray(step(h[:rows], res[:rows], w))
        assert np.array_equal(together, alone[:rows]), (rows, np.abs(together - alone[:rows]).max())
