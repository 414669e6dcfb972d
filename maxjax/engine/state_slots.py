"""The request-state slots of a hybrid model (graphs/state.py RECURRENT): which running request
holds which slot of the state pools. Called by the Scheduler.

Slot 0 is scratch (padding rows read and write it); slots 1..n-1 are handed out. A request holds
one from the step that first schedules it to its finish, abort or preemption. The plan makes
max batch size + 1 slots (maxjax/engine/state_plan.py) and the scheduler runs at most max batch
size requests, so a running request always finds one: running out is a bug, asserted.
A slot's old contents need no clearing: the graphs (graphs/recurrent.py) start a row whose first
token is at position 0 from zero state, and a request (re)starts there.

Not thread-safe: the engine loop owns it.
"""
from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is scratch), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))     # pop() hands out the lowest
        self._holder: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holder(self, slot: int) -> str | None:
        """The request id holding `slot`, None when free."""
        return self._holder.get(slot)

    def acquire(self, req) -> int:
        """Give `req` (holding none) a slot: its `state_slot`."""
        assert req.state_slot == 0, f"{req.request_id!r} already holds state slot {req.state_slot}"
        assert self._free, (f"no request-state slot free for {req.request_id!r}: {self.num_slots}"
                            " slots must be more than the running requests")
        slot = self._free.pop()
        self._holder[slot] = req.request_id
        req.state_slot = slot
        return slot

    def release(self, req) -> None:
        """Take back `req`'s slot, if it holds one."""
        slot = req.state_slot
        if slot == 0:
            return
        assert self._holder.pop(slot) == req.request_id, (slot, req.request_id)
        self._free.append(slot)
        req.state_slot = 0
