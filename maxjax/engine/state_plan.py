"""The plan's part for hybrid models (graphs/state.py RECURRENT: layers keeping a fixed-size
state per request, not paged K/V): the request-state pools' slots and dtype, their bytes out of
the memory budget, and what such a model cannot do yet. Called by maxjax/engine/plan.py only
(the planner: nothing after the plan decides anything, tests/test_plan_once.py).

Slots: max batch size + 1 (slot 0 is scratch), so every running request holds one
(maxjax/engine/state_slots.py StateSlots), then with the prefix cache on as many again for its
state snapshots (Snapshots): a hit resumes a cached prefix at the end of its last page that has
one, and each prompt saves one at its last full page's end, so the last max-batch-size prompts'
prefixes (and their earlier pages, LRU) stay resumable at a state's bytes each; none with
--no-enable-prefix-caching. Dtype: --state-pool-dtype, else the KV pool's (float16 keeps the
state in float32: bfloat16's range, or exact, never float16's).
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
    snapshots: int = 0             # the prefix cache's state snapshots among the slots

    @property
    def total_bytes(self) -> int:
        return self.slots * self.bytes_per_request

    def report(self) -> str:
        """One line for the start-up log and `maxjax suggest`."""
        if not self.slots:
            return ""
        requests = self.slots - 1 - self.snapshots
        snaps = (f"{self.snapshots} prefix-cache snapshots of "
                 f"{self.snapshots * self.bytes_per_request / (1 << 20):.2f} MiB" if self.snapshots
                 else "no prefix-cache snapshots (--no-enable-prefix-caching)")
        return (f"request state {self.slots} slots ({requests} requests + {snaps} + scratch) x "
                f"{self.bytes_per_request / 1024:.1f} KiB {self.dtype} = "
                f"{self.total_bytes / (1 << 20):.2f} MiB")


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
    snapshots = cfg.max_batch_size if cfg.enable_prefix_caching else 0
    return StatePools(cfg.max_batch_size + 1 + snapshots, dtype, per_request, snapshots)
