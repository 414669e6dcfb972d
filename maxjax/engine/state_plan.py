"""The plan's part for hybrid models (graphs/state.py RECURRENT: layers keeping a fixed-size
state per request, not paged K/V): the request-state pools' slots and dtype, their bytes out of
the memory budget, and what such a model cannot do yet. Called by maxjax/engine/plan.py only
(the planner: nothing after the plan decides anything, tests/test_plan_once.py).

Slots: max batch size + 1 (slot 0 is scratch), so every running request holds one
(maxjax/engine/state_slots.py). Dtype: --state-pool-dtype, else the KV pool's (float16 keeps
the state in float32: bfloat16's range, or exact, never float16's).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from maxjax.errors import UserError
from maxjax.graphs.state import request_state_of

STATE_POOL_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class StatePools:
    """A hybrid model's request-state pools as planned; slots 0: the model has none."""
    slots: int = 0
    dtype: str = ""
    bytes_per_request: int = 0
    prefix_cache_off: str = ""     # why the prefix cache is off for this model ("": it is not)

    @property
    def total_bytes(self) -> int:
        return self.slots * self.bytes_per_request

    def report(self) -> str:
        """One line for the start-up log and `maxjax suggest`."""
        if not self.slots:
            return ""
        return (f"request state {self.slots} slots ({self.slots - 1} requests + scratch) x "
                f"{self.bytes_per_request / 1024:.1f} KiB {self.dtype} = "
                f"{self.total_bytes / (1 << 20):.2f} MiB; prefix cache off: "
                f"{self.prefix_cache_off}")


def check_state_flags(cfg) -> None:
    """--state-pool-dtype, without a model (an override: a model without state layers ignores
    it)."""
    v = cfg.state_pool_dtype
    if v is not None and v not in STATE_POOL_DTYPES:
        raise UserError(f"--state-pool-dtype {v!r}: one of {', '.join(STATE_POOL_DTYPES)}")


def check_hybrid_flags(cfg, model_cfg) -> None:
    """What a model with state layers cannot run yet: a one-line UserError naming the flag."""
    if request_state_of(model_cfg) is None or not cfg.speculative_method:
        return
    raise UserError(
        f"--speculative-method {cfg.speculative_method}: {model_cfg.architecture} keeps a "
        f"fixed-size state per request in {sum(model_cfg.state_layers)} of its layers, which "
        "speculative decoding would have to roll back to the last accepted draft; not supported "
        "yet for hybrid models (leave out --speculative-method and the --draft-* flags)")


def plan_state_pools(cfg, model_cfg, kv_dtype: str) -> StatePools:
    """The request-state pools of `model_cfg` for the resolved `cfg` whose KV pool is
    `kv_dtype`; StatePools() for a model without state layers."""
    rs = request_state_of(model_cfg)
    if rs is None:
        return StatePools()
    dtype = cfg.state_pool_dtype or (kv_dtype if kv_dtype in STATE_POOL_DTYPES else "float32")
    per_request = rs.values_per_request(model_cfg) * jnp.dtype(dtype).itemsize
    return StatePools(cfg.max_batch_size + 1, dtype, per_request,
                      prefix_cache_reason(model_cfg))


def prefix_cache_reason(model_cfg) -> str:
    """Why the prefix cache is off for a model with state layers (the plan turns it off)."""
    return (f"{model_cfg.architecture} keeps a fixed-size {request_state_of(model_cfg).name} "
            "state per request, which a cached prefix's pages do not restore (no state "
            "snapshots yet)")
