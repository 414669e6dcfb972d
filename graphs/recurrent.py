"""The ragged step for layers that keep a fixed-size state per request (graphs/state.py RECURRENT):
Gated DeltaNet (graphs/qwen3_next.py) and Mamba2 (graphs/granitemoehybrid.py) share it.

A step's tokens are rows laid one after another (graphs/step.py). A row's state is read from its
slot at its first token in the step (zero when that token is at position 0: a new request, or
one recomputed after a preemption) and written back at its last, so a prompt split into chunks
carries its state from chunk to chunk with the boundaries anywhere. Padding tokens (row -1) run on
zero state in the scratch slot 0 and their outputs are ignored.

Two ways through a step's recurrence: `scan_rows`, token by token (decode: a token a row), and
`scan_chunks` for prefill. The chunked form lays each row's tokens into chunks of C token slots
of their own (`chunk_layout`: a row starts a fresh chunk, its last one padded with zero inputs
that leave the state as it is), so a chunk holds one row: the layer computes each chunk's
intra-chunk part for all chunks at once (a masked C x C matmul form), and a scan over the
chunks carries the state, reset to the row's slot (or zero) at its first chunk and written back
at its last. A step of T token slots and R rows needs at most `num_chunks` chunks, static;
`chunked` picks the form from the bucket's shape.

Speculative decoding's rollback (StepInputs.state_keep): a verify row also writes its state after
each token but its last to a slot of its own (the conv window and the recurrent state alike), so
the engine can resume from the state after its last accepted draft. Only the token scan has the
state after every token: a bucket that runs chunked takes the token scan in a step that keeps
any (`token_or_chunks`).
"""
from __future__ import annotations

from dataclasses import dataclass

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
        at = jnp.clip(K - 1 - back + before, 0, K - 2)[:, None]
        from_state = sum(jnp.where(at == j, held[:, :, j], 0.0) for j in range(K - 1))
        taps.append(jnp.where((back <= before)[:, None], from_x, from_state))
    window = jnp.stack(taps, axis=-1)                      # [T, C, K]
    y = jnp.einsum("tck,ck->tc", window, weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    target = jnp.where(last & (step.token_row >= 0), slot, kept(step))
    conv_pool = conv_pool.at[target].set(window[:, :, 1:].astype(conv_pool.dtype))
    return y, conv_pool


def kept(step: StepInputs):
    """int32[T]: per token the slot its state after it is kept in (state_keep; 0: none)."""
    if step.state_keep is None:
        return jnp.zeros_like(step.token_row)
    return jnp.where(step.token_row >= 0, step.state_keep, 0)


def scan_rows(update, inputs, pool, step: StepInputs):
    """Run `update(state, inputs_t) -> (state, out_t)` token by token (state float32 of one
    request, shaped like a slot of pool [slots, ...]); each row starts from its slot (or zero)
    and its final state is written back. Returns (outs stacked [T, ...], the updated pool)."""
    slot, first, last, fresh, _ = token_rows(step)
    last = last & (step.token_row >= 0)
    keep = kept(step)
    target = jnp.where(last, slot, keep)             # where each token's state goes, if anywhere
    write = last | (keep > 0)

    def body(carry, xs):
        state, pool = carry
        inp, s, is_first, is_fresh, t, w = xs
        held = pool[s].astype(jnp.float32)
        start = jnp.where(is_fresh, jnp.zeros_like(held), held)
        state = jnp.where(is_first, start, state)
        state, out = update(state, inp)
        pool = pool.at[t].set(jnp.where(w, state.astype(pool.dtype), pool[t]))
        return (state, pool), out

    zero = jnp.zeros(pool.shape[1:], jnp.float32)
    (_, pool), outs = jax.lax.scan(body, (zero, pool),
                                   (inputs, slot, first, fresh, target, write))
    return outs, pool


def token_or_chunks(step: StepInputs, size: int, chunks, tokens):
    """`chunks()` where the bucket runs chunked (`chunked`), else `tokens()` (the token scan,
    `scan_rows`); a chunked bucket takes the token scan in a step that keeps a token's state
    (StepInputs.state_keep: a verify row in it), which only the token scan has."""
    if not chunked(step, size):
        return tokens()
    if step.state_keep is None:
        return chunks()
    return jax.lax.cond(jnp.any(kept(step) > 0), tokens, chunks)


def num_chunks(num_tokens: int, num_rows: int, size: int) -> int:
    """The most chunks of `size` a step of this bucket's rows can fill: a row of n tokens takes
    ceil(n / size), and every chunk holds at least one token."""
    return min(num_tokens, (num_tokens + num_rows * (size - 1)) // size)


def chunked(step: StepInputs, size: int) -> bool:
    """Whether the chunked form runs this bucket: when its scan is at most a quarter of the
    token scan's length (a chunk's step does a few matmuls where a token's does outer
    products); decode buckets (a token a row) keep the token scan."""
    T, R = step.bucket
    return 4 * num_chunks(T, R, size) <= T


@jax.tree_util.register_dataclass
@dataclass
class ChunkLayout:
    """Where a step's tokens sit in chunks of `size`: each row's tokens from the start of a
    chunk of their own. Arrays over the N chunks and their N * size slots."""
    index: jax.Array        # int32[N, size] the token slot in each chunk slot; T: none (zeros)
    at: jax.Array           # int32[T] each token's chunk slot (flat); padding tokens: 0
    slot: jax.Array         # int32[N] the chunk's row's state slot (0: an empty chunk)
    first: jax.Array        # bool[N]  the row's first chunk in this step (empty chunks too)
    last: jax.Array         # bool[N]  the row's last chunk in this step, of a real row
    fresh: jax.Array        # bool[N]  its state starts at zero (position 0; empty chunks)


def chunk_layout(step: StepInputs, size: int) -> ChunkLayout:
    T, R = step.bucket
    N = num_chunks(T, R, size)
    slot, first, last, fresh, start = token_rows(step)
    row = step.token_row
    real = row >= 0
    idx = jnp.arange(T, dtype=jnp.int32)
    count = jnp.zeros(R, jnp.int32).at[jnp.where(real, row, R)].add(1, mode="drop")
    chunks = (count + size - 1) // size
    base = jnp.cumsum(chunks) - chunks                          # each row's first chunk
    offset = idx - start
    at = base[jnp.maximum(row, 0)] * size + offset
    index = jnp.full(N * size, T, jnp.int32).at[jnp.where(real, at, N * size)].set(
        idx, mode="drop").reshape(N, size)
    head = index[:, 0]
    used = head < T
    h = jnp.minimum(head, T - 1)
    tail = jnp.zeros(N, bool).at[jnp.where(real & last, at // size, N)].set(True, mode="drop")
    return ChunkLayout(index=index, at=jnp.where(real, at, 0),
                       slot=jnp.where(used, slot[h], 0),
                       first=~used | first[h], last=tail,
                       fresh=~used | fresh[h])


def to_chunks(layout: ChunkLayout, x):
    """x [T, ...] -> [N, size, ...], zeros in the chunk slots no token fills."""
    pad = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])
    return pad[layout.index]


def from_chunks(layout: ChunkLayout, y):
    """[N, size, ...] -> [T, ...] (padding tokens read chunk slot 0)."""
    return y.reshape((-1,) + y.shape[2:])[layout.at]


def scan_chunks(update, inputs, pool, layout: ChunkLayout):
    """Run `update(state, inputs_n) -> (state, out_n [size, ...])` chunk by chunk (inputs: a
    pytree of [N, ...]; state float32 of one request, shaped like a slot of pool); each row
    starts from its slot (or zero) at its first chunk and its state after its last is written
    back. Returns (outs [T, ...] in token order, the updated pool)."""
    def body(carry, xs):
        state, pool = carry
        inp, s, is_first, is_last, is_fresh = xs
        held = pool[s].astype(jnp.float32)
        state = jnp.where(is_first, jnp.where(is_fresh, jnp.zeros_like(held), held), state)
        state, out = update(state, inp)
        pool = pool.at[s].set(jnp.where(is_last, state.astype(pool.dtype), pool[s]))
        return (state, pool), out

    zero = jnp.zeros(pool.shape[1:], jnp.float32)
    (_, pool), outs = jax.lax.scan(body, (zero, pool), (inputs, layout.slot, layout.first,
                                                        layout.last, layout.fresh))
    return from_chunks(layout, outs), pool
