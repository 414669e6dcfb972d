"""The ragged step for layers that keep a fixed-size state per request (graphs/state.py RECURRENT):
Gated DeltaNet (graphs/qwen3_next.py) and Mamba2 (graphs/granitemoehybrid.py) share it.

A step's tokens are rows laid one after another (graphs/step.py). A row's state is read from its
slot at its first token in the step (zero when that token is at position 0: a new request, or
one recomputed after a preemption) and written back at its last, so a prompt split into chunks
carries its state from chunk to chunk with the boundaries anywhere. Padding tokens (row -1) run on
zero state in the scratch slot 0 and their outputs are ignored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from maxjax.graphs.step import StepInputs


def token_rows(step: StepInputs):
    """Per token: (its row's state slot, first of its row in this step, last of it, fresh: its
    state starts at zero, index of its row's first token)."""
    row = step.token_row
    T = row.shape[0]
    idx = jnp.arange(T, dtype=jnp.int32)
    prev = jnp.concatenate([jnp.full((1,), -2, row.dtype), row[:-1]])
    nxt = jnp.concatenate([row[1:], jnp.full((1,), -2, row.dtype)])
    first, last = row != prev, row != nxt
    slot = jnp.where(row >= 0, step.state_slot[jnp.maximum(row, 0)], 0)
    start = jax.lax.cummax(jnp.where(first, idx, 0))
    fresh = (step.positions[start] == 0) | (row < 0)
    return slot, first, last, fresh, start


def causal_conv(x, weight, bias, conv_pool, step: StepInputs):
    """Depthwise causal convolution of each row's inputs x [T, C] with weight [C, K] (bias [C] or
    None), the row's last K-1 inputs before this step read from conv_pool [slots, C, K-1]
    (oldest first). Returns (y [T, C] float32 before any activation, the updated conv_pool)."""
    T, C = x.shape
    K = weight.shape[1]
    slot, _, last, fresh, start = token_rows(step)
    idx = jnp.arange(T, dtype=jnp.int32)
    before = idx - start                                   # the row's tokens before this one
    held = jnp.where(fresh[:, None, None], 0.0, conv_pool[slot].astype(jnp.float32))
    xf = x.astype(jnp.float32)
    taps = []
    for k in range(K):                                     # oldest tap first
        back = K - 1 - k
        from_x = xf[jnp.maximum(idx - back, 0)]
        at = jnp.clip(K - 1 - back + before, 0, K - 2)
        from_state = jnp.take_along_axis(held, at[:, None, None], axis=2)[:, :, 0]
        taps.append(jnp.where((back <= before)[:, None], from_x, from_state))
    window = jnp.stack(taps, axis=-1)                      # [T, C, K]
    y = jnp.einsum("tck,ck->tc", window, weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    target = jnp.where(last & (step.token_row >= 0), slot, 0)
    conv_pool = conv_pool.at[target].set(window[:, :, 1:].astype(conv_pool.dtype))
    return y, conv_pool


def scan_rows(update, inputs, pool, step: StepInputs):
    """Run `update(state, inputs_t) -> (state, out_t)` token by token (state float32 of one
    request, shaped like a slot of pool [slots, ...]); each row starts from its slot (or zero)
    and its final state is written back. Returns (outs stacked [T, ...], the updated pool)."""
    slot, first, last, fresh, _ = token_rows(step)
    last = last & (step.token_row >= 0)

    def body(carry, xs):
        state, pool = carry
        inp, s, is_first, is_last, is_fresh = xs
        held = pool[s].astype(jnp.float32)
        start = jnp.where(is_fresh, jnp.zeros_like(held), held)
        state = jnp.where(is_first, start, state)
        state, out = update(state, inp)
        pool = pool.at[s].set(jnp.where(is_last, state.astype(pool.dtype), pool[s]))
        return (state, pool), out

    zero = jnp.zeros(pool.shape[1:], jnp.float32)
    (_, pool), outs = jax.lax.scan(body, (zero, pool), (inputs, slot, first, last, fresh))
    return outs, pool
