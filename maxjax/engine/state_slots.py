"""The request-state slots of a hybrid model (graphs/state.py RECURRENT): which running request
holds which slot of the state pools (StateSlots), and which slots hold the prefix cache's state
snapshots (Snapshots, after the requests' slots). The Scheduler asks them through RequestState,
which does nothing for other models.

Slot 0 is scratch (padding rows read and write it); slots 1..n-1 are handed out. A request holds
one from the step that first schedules it to its finish, abort or preemption. The plan makes
max batch size + 1 slots (maxjax/engine/state_plan.py) and the scheduler runs at most max batch
size requests, so a running request always finds one: running out is a bug, asserted.
A slot's old contents need no clearing: the graphs (graphs/recurrent.py) start a row whose first
token is at position 0 from zero state, and a request (re)starts there.

Speculative decoding: with k drafts a step, each request also holds k speculative slots
(`StateSlots(per_request=1 + k)`; the plan makes max batch size x k more). A verify row of d
drafts computes [last, d1..dd]; its state after token i < d goes to its i-th speculative slot
(StepInputs.state_keep), after dd to its own slot. When j < d drafts stand, its state after dj
is in speculative slot j: its next row restores it from there into its own slot first
(`state_from`, the prefix cache's restore, graphs/snapshots.py); when all stand, its own slot
holds it already (`verify_slots`, `accepted`).

Not thread-safe: the engine loop owns it.
"""
from __future__ import annotations

from collections import OrderedDict

from maxjax.engine.block_manager import PrefixMatch


class StateSlots:
    def __init__(self, num_slots: int, per_request: int = 1):
        """Slots [1, num_slots), `per_request` to a request: its own, then its speculative
        ones."""
        if num_slots < 2 or per_request < 1:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is scratch), got {num_slots}")
        self.num_slots = num_slots
        self.per_request = per_request
        self._free = list(range(num_slots - 1, 0, -1))     # pop() hands out the lowest
        self._holder: dict[int, str] = {}
        self._spec: dict[str, list[int]] = {}      # id -> its speculative slots
        self._resume: dict[str, int] = {}          # id -> the slot its next row restores from

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holder(self, slot: int) -> str | None:
        """The request id holding `slot`, None when free."""
        return self._holder.get(slot)

    def acquire(self, req) -> int:
        """Give `req` (holding none) a slot: its `state_slot`."""
        assert req.state_slot == 0, f"{req.request_id!r} already holds state slot {req.state_slot}"
        assert len(self._free) >= self.per_request, (
            f"no request-state slot free for {req.request_id!r}: {self.num_slots} slots must be "
            f"more than {self.per_request} a running request")
        slots = [self._free.pop() for _ in range(self.per_request)]
        for slot in slots:
            self._holder[slot] = req.request_id
        req.state_slot = slots[0]
        if len(slots) > 1:
            self._spec[req.request_id] = slots[1:]
        return slots[0]

    def release(self, req) -> None:
        """Take back `req`'s slots, if it holds them."""
        slot = req.state_slot
        if slot == 0:
            return
        self._resume.pop(req.request_id, None)
        for s in [slot] + self._spec.pop(req.request_id, []):
            assert self._holder.pop(s) == req.request_id, (s, req.request_id)
            self._free.append(s)
        req.state_slot = 0

    def spec_slots(self, req) -> list[int]:
        """`req`'s speculative slots (none without speculation or while it holds no slot)."""
        return list(self._spec.get(req.request_id, ()))

    def verify_slots(self, req, num_drafts: int) -> tuple[int, list[int] | None]:
        """For `req`'s next row, of one token and `num_drafts` drafts: the slot its state is
        restored from first (0: its own slot holds it), taken once; and per token the slot its
        state after it is kept in (None: no drafts)."""
        resume = self._resume.pop(req.request_id, 0)
        if not num_drafts:
            return resume, None
        spec = self._spec[req.request_id]
        assert num_drafts <= len(spec), (req.request_id, num_drafts, len(spec))
        return resume, spec[:num_drafts] + [0]

    def accepted(self, req, num_drafts: int, num_accepted: int) -> None:
        """`req`'s verify row of `num_drafts` drafts kept `num_accepted`: its next row resumes
        from the state after the last one kept (its own slot's when all stood)."""
        if num_accepted < num_drafts:
            self._resume[req.request_id] = self._spec[req.request_id][num_accepted]

    @property
    def num_pending(self) -> int:
        """Requests whose next row restores a rolled-back state."""
        return len(self._resume)


class Snapshots:
    """The prefix cache's request-state snapshots of a hybrid model: slots [first, first + count)
    of the state pools (after the requests' slots, so a snapshot never aliases a running
    request's), each holding the state of a cached prefix at the end of one of its full pages.

    A snapshot is claimed for a prefill row whose step ends on a page boundary (`claim`: the
    step saves its final state there, graphs/snapshots.py), stays pending with its request until
    the step's pages are registered in the cache, then belongs to the cached page that ends at
    its boundary (`bind`), or is freed when that page was not cached or has one already. The
    BlockManager's eviction of a page frees its snapshot (`drop`); when no slot is free a claim
    takes the least recently used snapshot (its page stays cached, no longer a hit's end). A hit
    (`restore_point`) is the longest cached prefix whose last page has a snapshot.

    Not thread-safe: the engine loop owns it.
    """

    def __init__(self, first: int, count: int, block_manager):
        """Slots [first, first + count), for the cached pages of `block_manager` (whose
        evictions it follows from now on)."""
        if first < 1 or count < 1:
            raise ValueError(f"snapshot slots [{first}, {first + count}): slot 0 is scratch")
        self.first, self.count = first, count
        self.bm, self.page_size = block_manager, block_manager.page_size
        block_manager.on_uncache = self.drop
        self._free = list(range(first + count - 1, first - 1, -1))   # pop() hands out the lowest
        self._page_slot: OrderedDict[int, int] = OrderedDict()        # page -> slot, LRU first
        self._pending: dict[str, list[tuple[int, int]]] = {}          # id -> [(slot, page index)]
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_bound(self) -> int:
        return len(self._page_slot)

    @property
    def num_pending(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def slot_of(self, page: int) -> int:
        """The snapshot of cached `page` (its state at the page's end), 0: none."""
        return self._page_slot.get(page, 0)

    def restore_point(self, prefix: PrefixMatch) -> tuple[PrefixMatch, int]:
        """`prefix` (BlockManager.match_prefix) cut to its longest run whose last page has a
        snapshot, and that snapshot's slot (0 and no pages: none)."""
        for n in range(len(prefix.pages), 0, -1):
            slot = self._page_slot.get(prefix.pages[n - 1])
            if slot:
                self._page_slot.move_to_end(prefix.pages[n - 1])
                return PrefixMatch(prefix.pages[:n], prefix.uids[:n]), slot
        return PrefixMatch([], []), 0

    def claim(self, req, end: int) -> int:
        """A slot for `req`'s state after its step ending at token `end`, when that is a page
        boundary whose page the prefix cache may register; 0: no snapshot."""
        ps = self.page_size
        if end < ps or end % ps or req.is_embedding or (req.page_uids
                                                        and req.page_uids[-1] is None):
            return 0
        if self._free:
            slot = self._free.pop()
        elif self._page_slot:
            _, slot = self._page_slot.popitem(last=False)
            self.evictions += 1
        else:
            return 0                      # every snapshot is pending in this step
        self._pending.setdefault(req.request_id, []).append((slot, end // ps - 1))
        return slot

    def bind(self, req) -> None:
        """After `req`'s step and BlockManager.cache_full_pages: its pending snapshots whose
        pages the cache has taken (or refused) go to the cached pages they end (the page cached
        for that prefix, its own or an equal one), or are freed."""
        uids, left = req.page_uids, []
        for slot, index in self._pending.pop(req.request_id, ()):
            if index >= len(uids) and not (uids and uids[-1] is None):
                left.append((slot, index))          # its step is not taken in yet
                continue
            page = self.bm.cached_page(req, index)
            if page is None or page in self._page_slot:
                self._free.append(slot)
            else:
                self._page_slot[page] = slot
        if left:
            self._pending[req.request_id] = left

    def release(self, req) -> None:
        """Free `req`'s pending snapshots (finished, aborted or preempted before its update)."""
        for slot, _ in self._pending.pop(req.request_id, ()):
            self._free.append(slot)

    def drop(self, page: int) -> None:
        """`page` left the prefix cache: its snapshot is freed."""
        slot = self._page_slot.pop(page, 0)
        if slot:
            self._free.append(slot)


def cut_at_page(start: int, chunk: int, num_tokens: int, page_size: int) -> int:
    """A hybrid prefill chunk of `chunk` tokens from `start` of a `num_tokens`-token sequence, cut
    to end on a page boundary, a snapshot point: at the sequence's last full page boundary
    before its last token when the chunk spans it (the tail after it runs as a chunk of its
    own), else at the last boundary inside a chunk that does not end the sequence; as it is
    when no boundary falls inside it."""
    end = start + chunk
    last = (num_tokens - 1) // page_size * page_size
    if start < last < end:
        return last - start
    aligned = end // page_size * page_size
    if end < num_tokens and aligned > start:
        return aligned - start
    return chunk


class RequestState:
    """What the Scheduler asks of the request state: for a hybrid model a slot held by each
    running request (`slots`, StateSlots) and, with the prefix cache, the state snapshots
    (`snapshots`, Snapshots; then `chunked`: whether prefills run in chunks, cut at pages);
    for other models (both None) every call does nothing."""

    def __init__(self, slots: StateSlots | None = None, snapshots: Snapshots | None = None,
                 chunked: bool = True):
        self.slots, self.snapshots, self.chunked = slots, snapshots, chunked

    def acquire(self, req) -> None:
        """A slot for `req`, admitted."""
        if self.slots is not None:
            self.slots.acquire(req)

    def release(self, req) -> None:
        """What `req` holds while running: its slot and its pending snapshots."""
        if self.slots is not None:
            self.slots.release(req)
        if self.snapshots is not None:
            self.snapshots.release(req)

    def resume_point(self, prefix: PrefixMatch) -> tuple[PrefixMatch, int]:
        """Where a request whose cached prefix is `prefix` resumes: a hybrid at its longest
        run with a snapshot, and that snapshot's slot (0: none; Snapshots.restore_point)."""
        if self.snapshots is None:
            return prefix, 0
        return self.snapshots.restore_point(prefix)

    def cut(self, req, start: int, chunk: int) -> int:
        """A prefill chunk of `chunk` tokens from `start`, cut to end on a page boundary where
        it can when snapshots are kept (`cut_at_page`: a state exists only where a step ends)."""
        if not chunk or self.snapshots is None or req.images or req.is_embedding or \
                not self.chunked:
            return chunk
        return cut_at_page(start, chunk, req.num_tokens, self.snapshots.page_size)

    def verify_slots(self, req, num_drafts: int) -> tuple[int, list[int] | None]:
        """`req`'s next row's (state_from, state_keep) for speculation (StateSlots)."""
        if self.slots is None or req.is_prefilling:
            return 0, None
        return self.slots.verify_slots(req, num_drafts)

    def accepted(self, req, num_drafts: int, num_accepted: int) -> None:
        """After `req`'s verify row: where its state rolls back to (StateSlots.accepted)."""
        if self.slots is not None and num_drafts:
            self.slots.accepted(req, num_drafts, num_accepted)

    def save_slot(self, req, end: int) -> int:
        """The snapshot that `req`'s prefill step ending at token `end` saves its state to
        (0: none; Snapshots.claim)."""
        if self.snapshots is None or not req.is_prefilling:
            return 0
        return self.snapshots.claim(req, end)

    def bind(self, req) -> None:
        """After `req`'s pages were offered to the prefix cache: its pending snapshots to the
        cached pages they end (Snapshots.bind)."""
        if self.snapshots is not None:
            self.snapshots.bind(req)
