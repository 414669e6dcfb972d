"""The step contract between the engine and every graph.

One step runs a ragged batch: prefill chunks and single decode tokens of up to R requests,
flattened into T token slots and padded to the bucket (T, R). Every per-step value is an array;
nothing per request is static, so one compiled executable serves every step of its bucket.

Padding tokens write their K/V into page 0, which the block manager never hands out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    token_ids: jax.Array      # int32[T]
    positions: jax.Array      # int32[T]  position of each token in its sequence
    slot_mapping: jax.Array   # int32[T]  page * page_size + offset each token's K/V is written to
    token_row: jax.Array      # int32[T]  request row each token belongs to
    page_table: jax.Array     # int32[R, P] pages of each request row, in order
    sample_idx: jax.Array     # int32[R]  token slot whose logits are returned for each row
    next_token: jax.Array     # int32[T]  prompt token after each slot, for prompt logprobs; -1: none

    @property
    def bucket(self) -> tuple[int, int]:
        return int(self.token_ids.shape[0]), int(self.page_table.shape[0])


@dataclass
class RowSlice:
    """The tokens one request contributes to a step."""
    token_ids: Sequence[int]
    start_pos: int            # position of token_ids[0]
    pages: Sequence[int]      # every page the request holds, covering start_pos + len(token_ids)
    next_tokens: Sequence[int] | None = None   # per token: the prompt token after it (-1: none)


def step_input_specs(num_tokens: int, num_rows: int, max_pages: int) -> StepInputs:
    i32 = np.int32
    return StepInputs(
        token_ids=jax.ShapeDtypeStruct((num_tokens,), i32),
        positions=jax.ShapeDtypeStruct((num_tokens,), i32),
        slot_mapping=jax.ShapeDtypeStruct((num_tokens,), i32),
        token_row=jax.ShapeDtypeStruct((num_tokens,), i32),
        page_table=jax.ShapeDtypeStruct((num_rows, max_pages), i32),
        sample_idx=jax.ShapeDtypeStruct((num_rows,), i32),
        next_token=jax.ShapeDtypeStruct((num_tokens,), i32),
    )


def build_step_inputs(rows: Sequence[RowSlice], num_tokens: int, num_rows: int, max_pages: int,
                      page_size: int) -> StepInputs:
    """Pack row slices into padded numpy arrays for the (num_tokens, num_rows) bucket."""
    n = sum(len(r.token_ids) for r in rows)
    if n > num_tokens or len(rows) > num_rows:
        raise ValueError(f"{n} tokens / {len(rows)} rows do not fit bucket ({num_tokens}, {num_rows})")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, SCRATCH_PAGE * page_size, np.int32)
    token_row = np.zeros(num_tokens, np.int32)
    page_table = np.full((num_rows, max_pages), SCRATCH_PAGE, np.int32)
    sample_idx = np.zeros(num_rows, np.int32)
    next_token = np.full(num_tokens, -1, np.int32)
    t = 0
    for r, row in enumerate(rows):
        k = len(row.token_ids)
        if len(row.pages) > max_pages:
            raise ValueError(f"row {r} holds {len(row.pages)} pages, bucket allows {max_pages}")
        pages = np.asarray(row.pages, np.int32)
        pos = np.arange(row.start_pos, row.start_pos + k, dtype=np.int32)
        token_ids[t:t + k] = row.token_ids
        positions[t:t + k] = pos
        slots[t:t + k] = pages[pos // page_size] * page_size + pos % page_size
        token_row[t:t + k] = r
        page_table[r, :len(pages)] = pages
        sample_idx[r] = t + k - 1
        if getattr(row, "next_tokens", None) is not None:   # scheduler rows carry none
            next_token[t:t + k] = row.next_tokens
        t += k
    return StepInputs(token_ids, positions, slots, token_row, page_table, sample_idx, next_token)
