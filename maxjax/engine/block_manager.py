"""The KV page pool: which request holds which page, and the prefix cache. Called by the Scheduler.

Pages 1..num_pages-1 are handed out; page 0 is the scratch page padding tokens write into
(graphs/step.py). A page is either free, held (ref count > 0; several requests may share a cached
prefix page), or evictable: unreferenced but still holding the K/V of a cached full page.

Prefix cache: each FULL page of a sequence is keyed by a chained hash of (previous page's hash,
cache_salt, the page's token ids), so a key names the whole prefix up to that page. A key is only a
way to find a candidate: before reusing a page its entry is compared token for token, with its salt
and the identity (uid) of its parent entry, so a hash collision costs a cache miss, never wrong K/V.
Unreferenced cached pages are evicted least recently used, and only when no free page is left.

Not thread-safe: the engine loop owns it.
"""
from __future__ import annotations

import array
import hashlib
import os
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

from maxjax.engine.request import Request
from maxjax.engine.stats import KVCacheStats

HASH_ALGOS = ("ahash64", "sha256", "sha256_64")
HASH_ALIASES = {"fast": "ahash64"}      # maxjax's name before --kv-cache-hash-algo followed max
_ROOT_UID = 0


@dataclass(slots=True)
class _Entry:
    key: object             # the page's chained hash (int for ahash64, else bytes)
    uid: int                # unique per registration: children name their parent by it
    parent_uid: int
    salt: str | None
    tokens: tuple


class PrefixMatch(NamedTuple):
    pages: list[int]
    uids: list[int]


_NO_MATCH = PrefixMatch([], [])


def _hash_fast(prev, salt, tokens: tuple) -> int:
    # Python's tuple hash (xxHash-based, 64-bit): 1.7 us per 128-token page here, against
    # 8.7 us for blake2b(digest_size=8) or sha256, where packing the ids into bytes dominates.
    return hash((prev, salt, tokens))


def _salt(req: Request):
    """What isolates a request's pages besides its tokens: its cache_salt and its LoRA adapter
    (pages computed under one adapter never serve another)."""
    return req.cache_salt if req.adapter_id is None else (req.cache_salt, req.adapter_id)


def _hash_sha256_64(prev: bytes, salt, tokens: tuple) -> bytes:
    return _hash_sha256(prev, salt, tokens)[:8]


def _hash_sha256(prev: bytes, salt, tokens: tuple) -> bytes:
    h = hashlib.sha256(prev)
    if salt is not None:
        s = salt.encode() if isinstance(salt, str) else repr(salt).encode()
        h.update(len(s).to_bytes(8, "little"))
        h.update(s)
    else:
        h.update(b"\xff" * 8)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "fast", hash_seed: str | None = None):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        hash_algo = HASH_ALIASES.get(hash_algo, hash_algo)
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"kv_cache_hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        if hash_algo == "ahash64":
            self._hash = _hash_fast
            self._root = hash(("maxjax-prefix-root", hash_seed or ""))
        else:
            # sha256 without a seed draws one, as max does: page hashes are not guessable
            seed = bytes.fromhex(hash_seed) if hash_seed else os.urandom(32)
            self._hash = _hash_sha256 if hash_algo == "sha256" else _hash_sha256_64
            self._root = self._hash(b"maxjax-prefix-root\0" + seed, None, ())

        self._ref = [0] * num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # oldest first
        self._entry: list[_Entry | None] = [None] * num_pages
        self._cache: dict[object, int] = {}
        self._next_uid = _ROOT_UID + 1
        self.on_uncache = None           # called with each page that leaves the cache
        self.listener = None             # KV events (engine/kv_events.py): stored/removed/cleared
        self.prefix_queries = 0          # admissions that looked up the cache
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_pages = 0
        self.prefix_hit_pages = 0
        self.evictions = 0

    # ---- pool state -------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._cache)

    def usage(self) -> float:
        return self.num_used_pages / self.num_usable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        return self._entry[page] is not None

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            pages_total=self.num_usable_pages, pages_used=self.num_used_pages,
            pages_free=self.num_free_pages, pages_cached=self.num_cached_pages,
            prefix_queries=self.prefix_queries, prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens, prefix_query_pages=self.prefix_query_pages,
            prefix_hit_pages=self.prefix_hit_pages, evictions=self.evictions,
            events_dropped=self.listener.dropped if self.listener is not None else 0)

    # ---- prefix cache -----------------------------------------------------------------------
    def _page_hash(self, req: Request, i: int):
        """Hash of req's i-th full page, memoized on the request (tokens never change)."""
        hashes, ps = req.page_hashes, self.page_size
        if len(hashes) > i:
            return hashes[i]
        toks = req.cache_token_ids      # (a copy, for a request with images)
        while len(hashes) <= i:
            j = len(hashes)
            prev = hashes[-1] if hashes else self._root
            hashes.append(self._hash(prev, _salt(req), tuple(toks[j * ps:(j + 1) * ps])))
        return hashes[i]

    def match_prefix(self, req: Request) -> PrefixMatch:
        """The longest run of cached pages equal to req's leading full pages. Never covers the
        sequence's last token: its logits must be computed. No side effects."""
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs or req.is_embedding:
            return _NO_MATCH   # prompt logprobs (and mean pooling) need every position computed
        ps, toks = self.page_size, req.cache_token_ids
        pages, uids = [], []
        parent = _ROOT_UID
        for i in range((req.num_tokens - 1) // ps):
            page = self._cache.get(self._page_hash(req, i))
            if page is None:
                break
            e = self._entry[page]
            if (e.parent_uid != parent or e.salt != _salt(req)
                    or e.tokens != tuple(toks[i * ps:(i + 1) * ps])):
                break
            pages.append(page)
            uids.append(e.uid)
            parent = e.uid
        return PrefixMatch(pages, uids)

    def cache_full_pages(self, req: Request) -> None:
        """Register req's computed full pages not yet in the cache (call after each step).
        An embedding request's pages are never cached: its K/V is thrown away at its end, and
        nothing is likely to continue its prompt."""
        if not self.enable_prefix_caching or req.is_embedding:
            return
        uids, ps = req.page_uids, self.page_size
        n_full = req.num_computed_tokens // ps
        if uids and uids[-1] is None:
            return            # a collision broke the chain: the rest of this sequence stays private
        toks = req.cache_token_ids
        while len(uids) < n_full:
            i = len(uids)
            key = self._page_hash(req, i)
            parent = uids[-1] if uids else _ROOT_UID
            tokens = tuple(toks[i * ps:(i + 1) * ps])
            other = self._cache.get(key)
            if other is not None:
                e = self._entry[other]
                if e.parent_uid == parent and e.salt == _salt(req) and e.tokens == tokens:
                    uids.append(e.uid)      # same content already cached (computed twice at once)
                    continue
                uids.append(None)
                return
            page = req.pages[i]
            e = _Entry(key, self._next_uid, parent, _salt(req), tokens)
            self._next_uid += 1
            self._entry[page] = e
            self._cache[key] = page
            uids.append(e.uid)
            if self.listener is not None:
                self.listener.stored(key, req.page_hashes[i - 1] if i else None, tokens,
                                     req.adapter_id)

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached page (they become free). Returns how many."""
        n = len(self._evictable)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._uncache(page)
            self._free.append(page)
        if self.listener is not None and not self._cache:
            self.listener.cleared()
        return n

    def _uncache(self, page: int) -> None:
        e = self._entry[page]
        del self._cache[e.key]
        self._entry[page] = None
        if self.on_uncache is not None:
            self.on_uncache(page)
        if self.listener is not None:
            self.listener.removed(e.key)

    def cached_page(self, req: Request, i: int) -> int | None:
        """The page the cache holds req's i-th full page in (its own, or an equal one computed
        beside it); None when that page is not registered."""
        uids = req.page_uids
        if i >= len(uids) or uids[i] is None:
            return None
        page = self._cache.get(self._page_hash(req, i))
        return page if page is not None and self._entry[page].uid == uids[i] else None

    # ---- allocation -------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            self._uncache(page)
            self.evictions += 1
        self._ref[page] = 1
        return page

    def _pages_short(self, req, num_new_tokens, prefix) -> int:
        held = len(req.pages) + len(prefix.pages)
        total = req.num_computed_tokens + len(prefix.pages) * self.page_size + num_new_tokens
        need = max(0, self.pages_for(total) - held)
        revive = sum(1 for p in prefix.pages if self._ref[p] == 0)
        return need + revive - self.num_free_pages

    def allocate(self, req: Request, num_new_tokens: int, prefix: PrefixMatch = _NO_MATCH) -> bool:
        """Make req's pages cover its computed tokens, the cached prefix (admission only: req holds
        no pages) and num_new_tokens more. All or nothing: False, and no change, if pages run short."""
        admitting = not req.pages
        if prefix.pages and not admitting:
            raise ValueError(f"request {req.request_id!r} already holds pages; no prefix to add")
        if not admitting and (req.num_computed_tokens + num_new_tokens
                              <= len(req.pages) * self.page_size):
            return True       # the common decode step: the last page has room
        if self._pages_short(req, num_new_tokens, prefix) > 0:
            return False
        if admitting and self.enable_prefix_caching and not req.is_embedding:
            self.prefix_queries += 1
            self.prefix_query_tokens += req.num_tokens
            self.prefix_query_pages += (req.num_tokens - 1) // self.page_size
            self.prefix_hit_pages += len(prefix.pages)
            self.prefix_hit_tokens += len(prefix.pages) * self.page_size
        for p in prefix.pages:
            if self._ref[p] == 0:
                del self._evictable[p]
            self._ref[p] += 1
        if prefix.pages:
            req.pages.extend(prefix.pages)
            req.page_uids = list(prefix.uids)
            req.num_computed_tokens += len(prefix.pages) * self.page_size
        total = req.num_computed_tokens + num_new_tokens
        for _ in range(self.pages_for(total) - len(req.pages)):
            req.pages.append(self._take())
        return True

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Give back req's pages past the first `num_tokens` tokens (a rollback of rejected
        draft tokens). Those pages were allocated for this request's uncommitted tokens, so they
        are neither shared nor in the prefix cache."""
        keep = self.pages_for(num_tokens)
        for p in req.pages[keep:]:
            assert self._ref[p] == 1 and self._entry[p] is None, f"page {p} is shared or cached"
            self._ref[p] = 0
            self._free.append(p)
        del req.pages[keep:]

    def free(self, req: Request) -> None:
        """Drop req's references. Cached pages become evictable, the tail first, so a shared
        prefix outlives the private ends of the sequences that used it."""
        for p in reversed(req.pages):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if self._entry[p] is not None:
                    self._evictable[p] = None
                else:
                    self._free.append(p)
        req.pages = []
        req.page_uids = []
