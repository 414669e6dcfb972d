"""The plan's part for hybrid models (graphs/state.py RECURRENT: layers keeping a fixed-size
state per request, not paged K/V): the request-state pools' slots and dtype, their bytes out of
the memory budget, and what such a model cannot do yet. Called by maxjax/engine/plan.py only
(the planner: nothing after the plan decides anything, tests/test_plan_once.py).

Slots: max batch size + 1 (slot 0 is scratch), so every running request holds one
(maxjax/engine/state_slots.py StateSlots), then with the prefix cache on as many again for its
state snapshots (Snapshots): a hit resumes a cached prefix at the end of its last page that has
one, and each prompt saves one at its last full page's end, so the last max-batch-size prompts'
prefixes (and their earlier pages, LRU) stay resumable at a state's bytes each; none with
--no-enable-prefix-caching. With speculative decoding (k drafts a step, a draft model's or
n-gram lookup's), max batch size x k more: each running request's speculative slots, holding its
state after each of a verify step's tokens, which roll it back to its last accepted draft. Dtype:
--state-pool-dtype, else the KV pool's (float16 keeps the state in float32: bfloat16's range,
or exact, never float16's).
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
    spec: int = 0                  # the running requests' speculative slots among them

    @property
    def total_bytes(self) -> int:
        return self.slots * self.bytes_per_request

    def report(self) -> str:
        """One line for the start-up log and `maxjax suggest`."""
        if not self.slots:
            return ""
        requests = self.slots - 1 - self.snapshots - self.spec
        snaps = (f"{self.snapshots} prefix-cache snapshots of "
                 f"{self.snapshots * self.bytes_per_request / (1 << 20):.2f} MiB" if self.snapshots
                 else "no prefix-cache snapshots (--no-enable-prefix-caching)")
        spec = (f" + {self.spec} speculative (a request's state after each draft) of "
                f"{self.spec * self.bytes_per_request / (1 << 20):.2f} MiB" if self.spec else "")
        return (f"request state {self.slots} slots ({requests} requests{spec} + {snaps} + "
                f"scratch) x "
                f"{self.bytes_per_request / 1024:.1f} KiB {self.dtype} = "
                f"{self.total_bytes / (1 << 20):.2f} MiB")


def check_state_flags(cfg) -> None:
    """--state-pool-dtype, without a model (an override: a model without state layers ignores
    it)."""
    v = cfg.state_pool_dtype
    if v is not None and v not in STATE_POOL_DTYPES:
        raise UserError(f"--state-pool-dtype {v!r}: one of {', '.join(STATE_POOL_DTYPES)}")


def check_hybrid_flags(cfg, model_cfg) -> None:
    """What a model with state layers cannot run yet: a one-line UserError naming the flag.
    Speculation by a draft model or n-gram lookup rolls the state back (`plan_state_pools`'
    speculative slots); MTP drafting (engine/mtp.py) reads only paged layers."""
    if request_state_of(model_cfg) is None or cfg.speculative_method in (None, "draft", "ngram"):
        return
    raise UserError(
        f"--speculative-method {cfg.speculative_method}: {model_cfg.architecture} keeps a "
        f"fixed-size state per request in {sum(model_cfg.state_layers)} of its layers, which "
        "MTP drafting does not carry yet; use --speculative-method draft or ngram")


def plan_state_pools(cfg, model_cfg, kv_dtype: str, draft_tokens: int = 0) -> StatePools:
    """The request-state pools of `model_cfg` for the resolved `cfg` whose KV pool is
    `kv_dtype`, verifying at most `draft_tokens` drafts a request a step; StatePools() for a
    model without state layers."""
    rs = request_state_of(model_cfg)
    if rs is None:
        return StatePools()
    dtype = cfg.state_pool_dtype or (kv_dtype if kv_dtype in STATE_POOL_DTYPES else "float32")
    per_request = rs.values_per_request(model_cfg) * jnp.dtype(dtype).itemsize
    snapshots = cfg.max_batch_size if cfg.enable_prefix_caching else 0
    spec = cfg.max_batch_size * draft_tokens
    return StatePools(cfg.max_batch_size + 1 + spec + snapshots, dtype, per_request, snapshots,
                      spec)
