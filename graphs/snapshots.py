"""The prefix cache's state snapshots for a hybrid model (graphs/state.py RECURRENT), in the step:
a snapshot is a slot of the request-state pools holding a request's state at a page boundary of a
cached prefix (maxjax/engine/state_slots.py Snapshots owns which).

`restore` runs before the model: a row with `state_from` (a prefix-cache hit resuming at the
snapshot's boundary) has that slot copied into its own `state_slot`, which its state layers
then read as a chunk's carried state (graphs/recurrent.py). `save` runs after the model: a row
with `state_save` (its step ended on a page boundary) has its final state copied there. So the
layers see one slot a row, and no extra executable runs. Each copy runs only in steps that ask
(a `lax.cond`); rows that do not ask copy the scratch slot 0 onto itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from maxjax.graphs.state import request_state_of, state_of
from maxjax.graphs.step import StepInputs


def _copy(pools: tuple, src, dst) -> tuple:
    """Each pool [layers, slots, ...] with slot src[r] copied to dst[r] for every row r."""
    return tuple(p.at[:, dst].set(p[:, src]) for p in pools)


def _on_state(cfg, kv, fn):
    n = len(state_of(cfg).pools(cfg))
    return tuple(kv[:n]) + fn(tuple(kv[n:]))


def restore(cfg, kv, step: StepInputs):
    """Copy each row's `state_from` snapshot into its `state_slot` (rows with one)."""
    if request_state_of(cfg) is None or step.state_from is None:
        return kv
    return _copy_rows(cfg, kv, step.state_from > 0, step.state_from, step.state_slot)


def save(cfg, kv, step: StepInputs):
    """Copy each row's final state in `state_slot` to its `state_save` snapshot (rows with
    one)."""
    if request_state_of(cfg) is None or step.state_save is None:
        return kv
    return _copy_rows(cfg, kv, step.state_save > 0, step.state_slot, step.state_save)


def _copy_rows(cfg, kv, ask, src, dst):
    """Slot `src` copied to slot `dst` of every state pool in the rows where `ask` (the others
    copy scratch slot 0 onto itself); no copy at all when no row asks."""
    src = jnp.where(ask, src, 0)
    dst = jnp.where(ask, dst, 0)
    return _on_state(cfg, kv, lambda pools: jax.lax.cond(
        jnp.any(ask), lambda ps: _copy(ps, src, dst), lambda ps: ps, pools))
