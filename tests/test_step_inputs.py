"""The step contract's attention blocks: every token in exactly one block of its own row."""
import numpy as np
import pytest

from maxjax.engine.buckets import bucket_set
from maxjax.graphs.attention import attention_blocks
from maxjax.graphs.step import RowSlice, build_step_inputs


def test_decode_buckets_use_one_token_blocks():
    assert attention_blocks(32, 32) == (32, 1)
    assert attention_blocks(1, 1) == (1, 1)
    nb, b = attention_blocks(256, 32)
    assert b > 1 and nb * b >= 256 and nb < 256


@pytest.mark.parametrize("seed", range(20))
def test_any_mix_of_rows_fits_its_bucket_blocks(seed):
    rng = np.random.default_rng(seed)
    for bucket in bucket_set(256, 32):
        T, R = bucket.num_tokens, bucket.num_rows
        n_rows = int(rng.integers(1, R + 1))
        lens = np.ones(n_rows, int)
        for _ in range(int(rng.integers(0, T - n_rows + 1))):
            lens[rng.integers(n_rows)] += 1
        rows = []
        for r, n in enumerate(lens):
            start = int(rng.integers(0, 100))
            pages = list(range(100 * r + 1, 100 * r + 1 + (start + n) // 8 + 1))
            rows.append(RowSlice(list(range(n)), start, pages))
        step = build_step_inputs(rows, T, R, 64, 8)
        blocks = step.attn
        nb, b = blocks.block_tokens.shape
        token_row = np.repeat(np.arange(n_rows), lens)
        used = blocks.block_pos >= 0
        slots = blocks.block_tokens[used]
        assert sorted(slots) == list(range(int(lens.sum())))        # each token once
        assert np.array_equal(blocks.block_pos[used], step.positions[slots])
        assert np.array_equal(np.broadcast_to(blocks.block_row[:, None], (nb, b))[used],
                              token_row[slots])                       # a block holds one row
        flat = blocks.token_block[: lens.sum()]
        assert np.array_equal(blocks.block_tokens.reshape(-1)[flat], np.arange(lens.sum()))
