"""LoraManager: the adapters this engine serves, the host memory holding at most `max_cpu_loras`
of them, and the N device slots of graphs/lora.py they are swapped into, least recently used
first at both levels.

Each served name has an entry whose id (`uid`, unique per load) the requests and the prefix cache
key on. An entry no unfinished request names may leave host memory to make room for another
(LRU); a request naming it later reads it again from its path, under a new id (the files may
have changed, so its cached pages are not reused). Unloading removes the name at once (new
requests naming it are refused) and the entry when the last unfinished request using it ends.

A request is counted as a user from `Scheduler.add` to its end (`use` / `done`) and pinned to its
adapter's slot from admission to the end or a preemption (`can_acquire`, `acquire`, `release`).
A slot no running request holds may be rewritten by another adapter; rewriting one puts new
arrays on the device (a host copy, no compilation). Called only from the engine's thread.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import jax
import numpy as np

from maxjax.errors import RequestError
from maxjax.graphs.lora import lora_specs
from maxjax.graphs.sharding import abstract
from maxjax.lora.adapter import Adapter, read_adapter


@dataclass
class Entry:
    name: str
    path: str
    uid: str
    adapter: Adapter | None       # None: evicted from host memory (read again when named)
    users: int = 0                # unfinished requests naming this load of it
    unloading: bool = False


class LoraManager:
    def __init__(self, model_cfg, dtype, max_num_loras: int, max_lora_rank: int,
                 max_cpu_loras: int):
        self.cfg, self.dtype = model_cfg, np.dtype(dtype)
        self.max_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.num_slots = max_num_loras + 1           # slot 0: no adapter
        self.host = jax.tree.map(lambda s: np.zeros(s.shape, self.dtype), abstract(
            lora_specs(model_cfg, self.num_slots, max_lora_rank), self.dtype))
        self.device = jax.device_put(self.host)
        self.served: dict[str, Entry] = {}           # name -> its entry, in load order
        self.entries: dict[str, Entry] = {}          # uid -> entry (unloading ones in use too)
        self._resident: OrderedDict[str, None] = OrderedDict()  # uids in host memory, LRU first
        self._uids = itertools.count(1)
        self.slot_uid: list[str | None] = [None] * self.num_slots
        self.refs = [0] * self.num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, self.num_slots))
        self.swaps = 0
        self.evictions = 0

    # ---- adapters ----------------------------------------------------------------------------
    def load(self, name: str, path: str, field: str = "lora_path") -> None:
        if not name or "=" in name:
            raise RequestError("lora_name", f"{name!r} is not a valid adapter name")
        if name in self.served:
            raise RequestError("lora_name", f"adapter {name!r} is already loaded")
        adapter = self._read(name, path, field)       # a bad adapter evicts nothing
        self._make_room("lora_name")
        self._add(Entry(name, path, "", adapter))

    def unload(self, name: str) -> str:
        """Serve `name` no more; its entry goes now, or when its last user ends. Its uid."""
        entry = self.served.pop(name, None)
        if entry is None:
            raise RequestError("lora_name", f"adapter {name!r} is not loaded")
        entry.unloading = True
        if not entry.users:
            self._drop(entry)
        return entry.uid

    def users(self, uid: str) -> int:
        """Unfinished requests using the load `uid` (0 once an unloaded one is gone)."""
        entry = self.entries.get(uid)
        return entry.users if entry else 0

    def names(self) -> list[str]:
        return list(self.served)

    def paths(self) -> dict[str, str]:
        return {n: e.path for n, e in list(self.served.items())}

    def resolve(self, name: str, field: str = "model") -> str:
        """The id of the served adapter `name`, read again from its path if it was evicted."""
        entry = self.served.get(name)
        if entry is None:
            raise RequestError(field, f"adapter {name!r} is not loaded (loaded: "
                                      f"{', '.join(self.served) or 'none'})")
        if entry.adapter is None:
            try:
                adapter = self._read(name, entry.path, field)
            except RequestError as e:
                raise RequestError(field, f"adapter {name!r} left host memory (--max-cpu-loras "
                                          f"{self.max_cpu_loras}) and cannot be read again: "
                                          f"{e.reason}") from None
            self._make_room(field)
            del self.entries[entry.uid]
            self._add(Entry(name, entry.path, "", adapter))
            entry = self.served[name]
        self._resident.move_to_end(entry.uid)
        return entry.uid

    def use(self, uid: str) -> None:
        self.entries[uid].users += 1

    def done(self, req) -> None:
        """`req` ended: its slot is released and it no longer uses its adapter."""
        self.release(req)
        entry = self.entries.get(req.adapter_id)
        if entry is not None:
            entry.users -= 1
            if entry.unloading and not entry.users:
                self._drop(entry)

    def _read(self, name: str, path: str, field: str) -> Adapter:
        return read_adapter(name, path, self.cfg, self.max_rank, self.dtype, field)

    def _add(self, entry: Entry) -> None:
        entry.uid = f"{entry.name}#{next(self._uids)}"
        self.served[entry.name] = self.entries[entry.uid] = entry
        self._resident[entry.uid] = None

    def _make_room(self, field: str) -> None:
        """Evict least recently used idle adapters until one more fits in host memory."""
        while len(self._resident) >= self.max_cpu_loras:
            idle = next((u for u in self._resident if not self.entries[u].users), None)
            if idle is None:
                raise RequestError(field, f"all {len(self._resident)} adapters in host memory "
                                          "(--max-cpu-loras) are in use by unfinished requests; "
                                          "retry when they finish")
            self._forget(idle)
            self.entries[idle].adapter = None
            self.evictions += 1

    def _drop(self, entry: Entry) -> None:
        self.entries.pop(entry.uid, None)
        self._forget(entry.uid)

    def _forget(self, uid: str) -> None:
        """Its host copy and device slot are free (no running request holds it: it has no user)."""
        self._resident.pop(uid, None)
        if uid in self.slot_uid:
            self.slot_uid[self.slot_uid.index(uid)] = None

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
            self._write(slot, self.entries[uid].adapter)
            self.slot_uid[slot] = uid
        self.refs[slot] += 1
        self._lru.move_to_end(slot)
        req.lora_slot = slot

    def release(self, req) -> None:
        if req.lora_slot:
            self.refs[req.lora_slot] -= 1
            req.lora_slot = 0

    def _write(self, slot: int, adapter: Adapter) -> None:
        for host_layer, weights in zip(self.host, adapter.weights):     # slot s at index s - 1
            for key, (a, bs) in weights.items():
                host_layer[key]["a"][:, slot - 1] = a
                for stack, b in zip(host_layer[key]["b"], bs):
                    stack[slot - 1] = b
        # A copy: on CPU device_put may alias a numpy buffer that the next write changes.
        self.device = jax.device_put(jax.tree.map(np.copy, self.host))
        self.swaps += 1
