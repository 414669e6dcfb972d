"""The step contract between the engine and every graph.

One step runs a ragged batch: prefill chunks and single decode tokens of up to R requests,
flattened into T token slots and padded to the bucket (T, R, S). Every per-step value is an array;
nothing per request is static, so one compiled executable serves every step of its bucket.

Sample slots: a row samples the next token after each of its last `num_samples` tokens (one
while decoding; k draft tokens + 1 to verify a speculation; none for a prefill chunk that does
not end its prompt). The S slots of a bucket are flattened in row order; `sample_idx` holds each
slot's token slot, and unused slots point at token 0 (their samples are ignored).

Padding tokens write their K/V into page 0, which the block manager never hands out.

Every step also returns, per row, the sum of its tokens' final-normed hidden states in this step
and the hidden state at its last token (`token_row` says which row each token slot is in): the
engine accumulates them over an embedding request's prefill chunks (graphs/program.py).

What the attention kernel needs beyond the page table (e.g. query blocks) is the attention
backend's own metadata, `attn` (graphs/attention.py), built with the rest of the step.

A model that reads images (graphs/vision.py) takes three more per-token inputs: `embeds`, the
image embeddings that replace the token embeddings where `embed_mask` is set, and `visible_end`,
the last position each token attends to (its own position; for Gemma 3's image tokens, their
image's last one: an image attends to itself both ways). A model with M-RoPE (Qwen2.5-VL) takes
`rope_positions`, each token's (temporal, height, width) rope positions; `positions` stays its
place in the sequence, which the KV writes and the attention masks read. A hybrid model
(graphs/state.py RECURRENT) takes `state_slot`, each row's request-state slot (0 for padding),
and for the prefix cache's state snapshots `state_from`, a snapshot slot copied into the row's
slot before the step (a cached prefix resumed; 0: none), and `state_save`, a snapshot slot the
row's final state is also copied to after the step (0: none) (graphs/snapshots.py); and for
speculative decoding `state_keep`, per token a slot its row's state after that token is also
written to (0: none): a verify row keeps the state after each of its tokens but its last, so the
engine can roll the state back to its last accepted draft (maxjax/engine/state_slots.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs.attention import AttentionBackend, backend_for

SCRATCH_PAGE = 0
STATE_ROWS = ("state_slot", "state_from", "state_save")     # a hybrid model's per-row slots


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    token_ids: jax.Array      # int32[T]
    positions: jax.Array      # int32[T]  position of each token in its sequence
    slot_mapping: jax.Array   # int32[T]  page * page_size + offset each token's K/V is written to
    page_table: jax.Array     # int32[R, P] pages of each request row, in order
    attn: Any                 # the attention backend's metadata (graphs/attention.py)
    sample_idx: jax.Array     # int32[S]  token slot whose next token each sample slot samples
    next_token: jax.Array     # int32[T]  prompt token after each slot, for prompt logprobs; -1: none
    token_row: jax.Array      # int32[T]  request row of each token slot; -1: padding
    lora_slot: Any = None     # int32[T]  each token's adapter slot (0: none); None: LoRA off
    embeds: Any = None        # [T, hidden] image embeddings (compute dtype); None: text only
    embed_mask: Any = None    # bool[T]   token slots that take `embeds`
    visible_end: Any = None   # int32[T]  last position each token attends to
    rope_positions: Any = None  # int32[3, T] M-RoPE positions (cfg.mrope_section); None: 1-D
    state_slot: Any = None    # int32[R]  each row's request-state slot (0: padding); None: none
    state_from: Any = None    # int32[R]  snapshot slot restored into state_slot first (0: none)
    state_save: Any = None    # int32[R]  snapshot slot its final state is saved to (0: none)
    state_keep: Any = None    # int32[T]  slot the state after this token also goes to (0: none;
                              #           ignored at a row's last token: its own slot has it)

    @property
    def bucket(self) -> tuple[int, int]:
        return int(self.token_ids.shape[0]), int(self.page_table.shape[0])

    def live_tokens(self):
        """How many token slots hold real tokens (a traced count): they come first, and only
        padding writes to the scratch page."""
        return jnp.sum(self.slot_mapping != SCRATCH_PAGE, dtype=jnp.int32)   # page 0, slot 0


@dataclass
class RowSlice:
    """The tokens one request contributes to a step."""
    token_ids: Sequence[int]
    start_pos: int            # position of token_ids[0]
    pages: Sequence[int]      # every page the request holds, covering start_pos + len(token_ids)
    next_tokens: Sequence[int] | None = None   # per token: the prompt token after it (-1: none)
    num_samples: int = 1      # sample slots at the row's last tokens
    lora_slot: int = 0        # the row's adapter slot (0: the base model)
    embeds: Any = None        # [k, hidden] per token, its image embedding, or None
    embed_mask: Any = None    # bool[k] the tokens that take `embeds`
    visible_end: Any = None   # int[k] per token, the last position it sees (None: its own)
    rope_positions: Any = None  # int[3, k] its M-RoPE positions (None: its position, 3 times)
    state_slot: int = 0       # its request-state slot (a hybrid model's; graphs/state.py)
    state_from: int = 0       # the snapshot slot its state resumes from (0: its own slot's)
    state_save: int = 0       # the snapshot slot its final state is saved to (0: none)
    state_keep: Sequence[int] | None = None   # per token, a slot its state after it goes to


def step_input_specs(num_tokens: int, num_rows: int, max_pages: int,
                     num_samples: int | None = None,
                     backend: AttentionBackend | None = None, lora: bool = False,
                     embeds: tuple | None = None, mrope: bool = False,
                     state: bool = False) -> StepInputs:
    """`embeds`: (hidden size, dtype) of a model that reads images; None: text only.
    `mrope`: the step takes `rope_positions` (a model with cfg.mrope_section); `state`: it
    takes `state_slot`, `state_from`, `state_save` and `state_keep` (a hybrid model)."""
    i32 = np.int32
    backend = backend or backend_for()
    return StepInputs(
        token_ids=jax.ShapeDtypeStruct((num_tokens,), i32),
        positions=jax.ShapeDtypeStruct((num_tokens,), i32),
        slot_mapping=jax.ShapeDtypeStruct((num_tokens,), i32),
        page_table=jax.ShapeDtypeStruct((num_rows, max_pages), i32),
        attn=backend.metadata_specs(num_tokens, num_rows),
        sample_idx=jax.ShapeDtypeStruct((num_samples or num_rows,), i32),
        next_token=jax.ShapeDtypeStruct((num_tokens,), i32),
        token_row=jax.ShapeDtypeStruct((num_tokens,), i32),
        lora_slot=jax.ShapeDtypeStruct((num_tokens,), i32) if lora else None,
        **(_embed_specs(num_tokens, *embeds) if embeds else {}),
        rope_positions=jax.ShapeDtypeStruct((3, num_tokens), i32) if mrope else None,
        **({k: jax.ShapeDtypeStruct((num_rows,), i32) for k in STATE_ROWS} if state else {}),
        state_keep=jax.ShapeDtypeStruct((num_tokens,), i32) if state else None,
    )


def _embed_specs(num_tokens: int, dim: int, dtype) -> dict:
    return {"embeds": jax.ShapeDtypeStruct((num_tokens, dim), dtype),
            "embed_mask": jax.ShapeDtypeStruct((num_tokens,), np.bool_),
            "visible_end": jax.ShapeDtypeStruct((num_tokens,), np.int32)}


def build_step_inputs(rows: Sequence[RowSlice], num_tokens: int, num_rows: int, max_pages: int,
                      page_size: int, num_samples: int | None = None,
                      backend: AttentionBackend | None = None, lora: bool = False,
                      embeds: tuple | None = None, mrope: bool = False,
                      state: bool = False) -> StepInputs:
    """Pack row slices into padded numpy arrays for the (num_tokens, num_rows, num_samples)
    bucket. `lora`: fill `lora_slot` (padding tokens: slot 0); `embeds`: (hidden size, dtype),
    fill the image inputs (`step_input_specs`); `mrope`: fill `rope_positions`; `state`: fill
    `state_slot`, `state_from`, `state_save` and `state_keep` (padding: slot 0)."""
    n = sum(len(r.token_ids) for r in rows)
    num_samples = num_samples or num_rows
    n_samples = sum(r.num_samples for r in rows)
    if n > num_tokens or len(rows) > num_rows or n_samples > num_samples:
        raise ValueError(f"{n} tokens / {len(rows)} rows / {n_samples} samples do not fit bucket "
                         f"({num_tokens}, {num_rows}, {num_samples})")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, SCRATCH_PAGE * page_size, np.int32)
    page_table = np.full((num_rows, max_pages), SCRATCH_PAGE, np.int32)
    sample_idx = np.zeros(num_samples, np.int32)
    s = 0
    next_token = np.full(num_tokens, -1, np.int32)
    token_row = np.full(num_tokens, -1, np.int32)
    lora_slot = np.zeros(num_tokens, np.int32) if lora else None
    t = 0
    for r, row in enumerate(rows):
        k = len(row.token_ids)
        if len(row.pages) > max_pages:
            raise ValueError(f"row {r} holds {len(row.pages)} pages, bucket allows {max_pages}")
        pages = np.asarray(row.pages, np.int32)
        pos = np.arange(row.start_pos, row.start_pos + k, dtype=np.int32)
        token_ids[t:t + k] = row.token_ids
        positions[t:t + k] = pos
        token_row[t:t + k] = r
        slots[t:t + k] = pages[pos // page_size] * page_size + pos % page_size
        page_table[r, :len(pages)] = pages
        if not 0 <= row.num_samples <= k:
            raise ValueError(f"row {r}: {row.num_samples} sample slots for {k} tokens")
        sample_idx[s:s + row.num_samples] = np.arange(t + k - row.num_samples, t + k)
        s += row.num_samples
        if getattr(row, "next_tokens", None) is not None:   # scheduler rows carry none
            next_token[t:t + k] = row.next_tokens
        if lora:
            lora_slot[t:t + k] = getattr(row, "lora_slot", 0)
        t += k
    attn = (backend or backend_for()).build_metadata(rows, num_tokens, num_rows)
    step = StepInputs(token_ids, positions, slots, page_table, attn, sample_idx, next_token,
                      token_row, lora_slot)
    if embeds:
        step.embeds, step.embed_mask, step.visible_end = _image_inputs(rows, positions, n,
                                                                       *embeds)
    if mrope:
        step.rope_positions = _rope_positions(rows, positions)
    if state:
        for name in STATE_ROWS:
            a = np.zeros(num_rows, np.int32)
            a[:len(rows)] = [getattr(r, name, 0) for r in rows]
            setattr(step, name, a)
        step.state_keep = _state_keep(rows, num_tokens)
    return step


def _state_keep(rows: Sequence[RowSlice], num_tokens: int):
    """int32 [T]: each token's `state_keep` slot, 0 for rows that keep none and padding."""
    keep = np.zeros(num_tokens, np.int32)
    t = 0
    for row in rows:
        k = len(row.token_ids)
        if getattr(row, "state_keep", None) is not None:
            keep[t:t + k] = row.state_keep
        t += k
    return keep


def _rope_positions(rows: Sequence[RowSlice], positions):
    """int32 [3, T]: each token's position on all three rows, but for rows that carry theirs."""
    rope = np.tile(positions, (3, 1))
    t = 0
    for row in rows:
        k = len(row.token_ids)
        if getattr(row, "rope_positions", None) is not None:
            rope[:, t:t + k] = row.rope_positions
        t += k
    return rope


def _image_inputs(rows: Sequence[RowSlice], positions, n: int, dim: int, dtype):
    """(embeds, embed_mask, visible_end) of the rows' tokens; padding sees nothing (-1)."""
    embeds = np.zeros((len(positions), dim), dtype)
    mask = np.zeros(len(positions), np.bool_)
    end = np.full(len(positions), -1, np.int32)
    end[:n] = positions[:n]
    t = 0
    for row in rows:
        k = len(row.token_ids)
        if row.embeds is not None:
            embeds[t:t + k] = row.embeds
            mask[t:t + k] = row.embed_mask
        if row.visible_end is not None:
            end[t:t + k] = row.visible_end
        t += k
    return embeds, mask, end
