"""The Responses API's stored responses (`store: true`, the default), for GET /v1/responses/{id},
DELETE and `previous_response_id`: in memory only, bounded by a count and by the JSON size of
what it holds, the least recently used going first. A record is the response object and the
input items of its turn (the conversation before it, without `instructions`), so a follow-up
turn can rebuild the whole conversation. Used by server/responses_api.py."""
from __future__ import annotations

import json
from collections import OrderedDict

DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_BYTES = 64 << 20


class ResponseStore:
    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_count < 0 or max_bytes < 0:
            raise ValueError("the store's limits must not be negative")
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def put(self, response: dict, input_items: list[dict]) -> bool:
        """Keep a response (by its id); False when it alone is over the byte limit (then
        nothing is kept). Older ones go until both limits hold."""
        rid = response["id"]
        size = len(json.dumps([response, input_items], separators=(",", ":")))
        self.delete(rid)
        if size > self.max_bytes or self.max_count == 0:
            return False
        self._items[rid] = (response, input_items, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, (_, _, old) = self._items.popitem(last=False)
            self.bytes -= old
        return True

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        """(response, input items), or None; a hit counts as a use."""
        hit = self._items.get(rid)
        if hit is None:
            return None
        self._items.move_to_end(rid)
        return hit[0], hit[1]

    def delete(self, rid: str) -> bool:
        hit = self._items.pop(rid, None)
        if hit is not None:
            self.bytes -= hit[2]
        return hit is not None
