"""The KV page pool's invariants, asserted by the engine's tests (reads BlockManager internals)."""
from __future__ import annotations


def check_pool(bm, live=()) -> None:
    """Assert the pool's invariants; `live` are all requests holding pages."""
    refs = [0] * bm.num_pages
    for r in live:
        for p in r.pages:
            refs[p] += 1
    assert refs[0] == 0 and bm._ref[0] == 0, "scratch page handed out"
    assert refs == bm._ref, f"ref counts {bm._ref} != held {refs}"
    free, evictable = set(bm._free), set(bm._evictable)
    assert len(free) == len(bm._free) and not free & evictable
    held = {p for p in range(1, bm.num_pages) if bm._ref[p] > 0}
    assert free | evictable | held == set(range(1, bm.num_pages)), "page lost"
    assert not (free | evictable) & held
    assert all(bm._entry[p] is None for p in free)
    assert all(bm._entry[p] is not None for p in evictable)
    for key, page in bm._cache.items():
        assert bm._entry[page] is not None and bm._entry[page].key == key
    assert sum(e is not None for e in bm._entry) == len(bm._cache)
