"""LoraManager: the adapters this engine serves, in host memory (at most `max_cpu_loras`), and the
N device slots of graphs/lora.py they are swapped into, least recently used first.

A request is pinned to its adapter's slot from admission to the end (or preemption): the
Scheduler asks `can_acquire` before admitting, `acquire`s after, and `release`s. A slot no
running request holds may be rewritten by another adapter; rewriting one puts new arrays on the
device (a host copy, no compilation). Called only from the engine's thread.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

import jax
import numpy as np

from maxjax.errors import RequestError
from maxjax.graphs.lora import lora_specs
from maxjax.graphs.sharding import shapes
from maxjax.lora.adapter import Adapter, read_adapter


class LoraManager:
    def __init__(self, model_cfg, dtype, max_num_loras: int, max_lora_rank: int,
                 max_cpu_loras: int):
        self.cfg, self.dtype = model_cfg, np.dtype(dtype)
        self.max_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.num_slots = max_num_loras + 1           # slot 0: no adapter
        self.host = jax.tree.map(lambda s: np.zeros(s, self.dtype),
                                 shapes(lora_specs(model_cfg, self.num_slots, max_lora_rank)),
                                 is_leaf=lambda x: isinstance(x, tuple))
        self.device = jax.device_put(self.host)
        self.adapters: OrderedDict[str, tuple[str, Adapter]] = OrderedDict()  # name -> (uid, ...)
        self._uids = itertools.count(1)
        self.slot_uid: list[str | None] = [None] * self.num_slots
        self.refs = [0] * self.num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, self.num_slots))
        self.swaps = 0

    # ---- adapters ----------------------------------------------------------------------------
    def load(self, name: str, path: str, field: str = "lora_path") -> None:
        if not name or "=" in name:
            raise RequestError("lora_name", f"{name!r} is not a valid adapter name")
        if name in self.adapters:
            raise RequestError("lora_name", f"adapter {name!r} is already loaded")
        if len(self.adapters) >= self.max_cpu_loras:
            raise RequestError("lora_name", f"{len(self.adapters)} adapters are loaded, the most "
                                            f"--max-cpu-loras allows; unload one first")
        adapter = read_adapter(name, path, self.cfg, self.max_rank, self.dtype, field)
        self.adapters[name] = (f"{name}#{next(self._uids)}", adapter)

    def unload(self, name: str, in_use: int) -> None:
        if name not in self.adapters:
            raise RequestError("lora_name", f"adapter {name!r} is not loaded")
        if in_use:
            raise RequestError("lora_name", f"adapter {name!r} is in use by {in_use} unfinished "
                                            "requests; unload it when they have finished")
        uid = self.adapters.pop(name)[0]
        for s, u in enumerate(self.slot_uid):
            if u == uid:
                self.slot_uid[s] = None

    def names(self) -> list[str]:
        return list(self.adapters)

    def resolve(self, name: str, field: str = "model") -> str:
        """The id of the loaded adapter `name` (unique per load: the prefix cache keys on it)."""
        if name not in self.adapters:
            raise RequestError(field, f"adapter {name!r} is not loaded (loaded: "
                                      f"{', '.join(self.adapters) or 'none'})")
        return self.adapters[name][0]

    # ---- slots -------------------------------------------------------------------------------
    def _slot_of(self, uid: str) -> int | None:
        return self.slot_uid.index(uid) if uid in self.slot_uid else None

    def can_acquire(self, req) -> bool:
        uid = req.adapter_id
        return uid is None or self._slot_of(uid) is not None or any(
            self.refs[s] == 0 for s in self._lru)

    def acquire(self, req) -> None:
        """Pin req to its adapter's slot (writing the adapter into the least recently used free
        slot when it holds none); `can_acquire(req)` must be True."""
        uid = req.adapter_id
        if uid is None:
            return
        slot = self._slot_of(uid)
        if slot is None:
            slot = next(s for s in self._lru if self.refs[s] == 0)
            adapter = next(a for u, a in self.adapters.values() if u == uid)
            self._write(slot, adapter)
            self.slot_uid[slot] = uid
        self.refs[slot] += 1
        self._lru.move_to_end(slot)
        req.lora_slot = slot

    def release(self, req) -> None:
        if req.lora_slot:
            self.refs[req.lora_slot] -= 1
            req.lora_slot = 0

    def _write(self, slot: int, adapter: Adapter) -> None:
        for host_layer, weights in zip(self.host, adapter.weights):
            for key, (a, b) in weights.items():
                host_layer[key]["a"][:, slot] = a
                host_layer[key]["b"][slot] = b
        # A copy: on CPU device_put may alias a numpy buffer that the next write changes.
        self.device = jax.device_put(jax.tree.map(np.copy, self.host))
        self.swaps += 1
