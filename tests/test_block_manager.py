"""BlockManager: page pool, ref counts, prefix cache (chained hashes, salt, collisions), LRU eviction."""
import pytest

from maxjax.engine import block_manager as bm_mod
from maxjax.engine.block_manager import BlockManager
from maxjax.engine.request import Request
from pool_check import check_pool

PS = 4


def req(tokens, rid="r", salt=None):
    return Request(rid, list(tokens), cache_salt=salt)


def compute_all(bm, r):
    """Admit r as the scheduler would (cached prefix + the whole rest), 'run' it, cache its pages."""
    prefix = bm.match_prefix(r)
    assert bm.allocate(r, r.num_tokens - len(prefix.pages) * PS, prefix)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_pages(r)
    return prefix


def test_pool_never_hands_out_page_0_and_is_all_or_nothing():
    bm = BlockManager(5, PS)
    a, b = req(range(10), "a"), req(range(10), "b")
    assert bm.allocate(a, 10)                     # 3 pages
    assert sorted(a.pages) == [1, 2, 3] and bm.num_free_pages == 1
    assert not bm.allocate(b, 8)                  # needs 2, 1 left: no change
    assert b.pages == [] and bm.num_free_pages == 1
    assert bm.allocate(b, 4) and 0 not in b.pages
    assert bm.num_free_pages == 0 and bm.usage() == 1.0
    check_pool(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_pages == 4 and bm.num_used_pages == 0
    check_pool(bm, [])


def test_grow_one_token_at_a_time():
    bm = BlockManager(4, PS)
    r = req([1, 2, 3])
    assert bm.allocate(r, 3) and len(r.pages) == 1
    r.num_computed_tokens = 3
    assert bm.allocate(r, 1) and len(r.pages) == 1   # 4th token fits page 1
    r.num_computed_tokens = 4
    assert bm.allocate(r, 1) and len(r.pages) == 2
    bm.free(r)
    check_pool(bm, [])


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(1, PS)
    with pytest.raises(ValueError, match="hash_algo"):
        BlockManager(8, PS, hash_algo="md5")


@pytest.mark.parametrize("algo", ["fast", "sha256"])
def test_prefix_hit_reuses_three_pages(algo):
    bm = BlockManager(16, PS, hash_algo=algo)
    shared = list(range(100, 112))                # 3 full pages
    a = req(shared + [1, 2], "a")
    compute_all(bm, a)
    a_pages = list(a.pages)
    bm.free(a)
    b = req(shared + [7, 8, 9], "b")
    prefix = compute_all(bm, b)
    assert prefix.pages == a_pages[:3]
    assert b.pages[:3] == a_pages[:3]
    assert bm.prefix_hit_pages == 3 and bm.prefix_hit_tokens == 12
    assert bm.prefix_queries == 2 and bm.prefix_query_tokens == 14 + 15
    c = req(shared + [5], "c")                    # shares while b still holds them
    compute_all(bm, c)
    assert c.pages[:3] == a_pages[:3] and all(bm.ref_count(p) == 2 for p in a_pages[:3])
    check_pool(bm, [b, c])
    bm.free(b)
    bm.free(c)
    check_pool(bm, [])
    assert bm.num_free_pages == 15


def test_match_never_covers_the_last_token():
    bm = BlockManager(16, PS)
    a = req(range(12), "a")                       # exactly 3 pages: 3 get cached
    compute_all(bm, a)
    assert bm.num_cached_pages == 3
    bm.free(a)
    same = req(range(12), "b")
    assert len(bm.match_prefix(same).pages) == 2  # (12 - 1) // 4: the last token is recomputed
    longer = req(range(13), "c")
    assert len(bm.match_prefix(longer).pages) == 3


def test_salt_isolates_and_same_salt_shares():
    bm = BlockManager(16, PS)
    a = req(range(9), "a", salt="alice")
    compute_all(bm, a)
    bm.free(a)
    assert bm.match_prefix(req(range(9), "x", salt="bob")).pages == []
    assert bm.match_prefix(req(range(9), "y")).pages == []
    assert len(bm.match_prefix(req(range(9), "z", salt="alice")).pages) == 2


@pytest.mark.parametrize("algo", ["fast", "sha256"])
def test_lora_adapter_isolates_pages(algo):
    bm = BlockManager(16, PS, hash_algo=algo)
    a = Request("a", list(range(9)), adapter_id="ad#1")
    compute_all(bm, a)
    bm.free(a)
    for other in (None, "ad#2", "bd#1"):        # the base model, a reload, another adapter
        assert bm.match_prefix(Request("x", list(range(9)), adapter_id=other)).pages == []
    # a user salt spelling the adapter's key does not reach its pages either
    assert bm.match_prefix(req(range(9), "y", salt=repr((None, "ad#1")))).pages == []
    assert len(bm.match_prefix(Request("z", list(range(9)), adapter_id="ad#1")).pages) == 2


def test_partial_match_stops_at_first_different_page():
    bm = BlockManager(16, PS)
    compute_all(bm, req(list(range(8)) + [50] * 5, "a"))
    b = req(list(range(4)) + [9, 9, 9, 9] + [50] * 5, "b")   # page 2 differs, page 3 equals
    assert len(bm.match_prefix(b).pages) == 1


def test_lru_eviction_order_and_reuse_refreshes():
    bm = BlockManager(7, 2)                       # 6 usable pages of 2 tokens

    def run(tokens, rid):
        r = req(tokens, rid)
        p = bm.match_prefix(r)
        assert bm.allocate(r, r.num_tokens - 2 * len(p.pages), p)
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_pages(r)
        bm.free(r)
        return r

    run([1, 2, 3, 4, 5], "a")                     # 2 cached pages + 1 private
    run([6, 7, 8, 9, 10], "b")
    assert bm.num_cached_pages == 4 and bm.num_free_pages == 6
    run([1, 2, 3, 4, 99], "a2")                   # reuses a's 2 pages: now more recent than b's
    assert bm.prefix_hit_pages == 2
    c = req([20, 21, 22, 23, 24, 25, 26], "c")    # 4 pages: 2 free + 2 evicted, oldest first
    assert bm.allocate(c, 7)
    assert bm.evictions == 2
    assert bm.match_prefix(req([6, 7, 8, 9, 0], "q")).pages == []          # b's evicted
    assert len(bm.match_prefix(req([1, 2, 3, 4, 0], "q")).pages) == 2      # a's kept
    bm.free(c)
    check_pool(bm, [])


def test_eviction_takes_the_tail_of_a_sequence_first():
    bm = BlockManager(5, 2)                       # 4 usable
    a = req([1, 2, 3, 4, 5, 6, 7], "a")           # 3 full pages cached + 1 private
    compute_all(bm, a)
    bm.free(a)
    b = req([9, 9, 9], "b")                       # 2 pages: the free one + a's last full page
    assert bm.allocate(b, 3) and bm.evictions == 1
    assert len(bm.match_prefix(req([1, 2, 3, 4, 5, 6, 0], "q")).pages) == 2
    bm.free(b)
    check_pool(bm, [])


def test_forced_collision_never_reuses_wrong_tokens(monkeypatch):
    monkeypatch.setattr(bm_mod, "_hash_fast", lambda prev, salt, tokens: 42)
    bm = BlockManager(16, PS)
    a = req([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    bm.free(a)
    b = req([9, 9, 9, 9, 5], "b")                 # same key, other tokens
    assert compute_all(bm, b).pages == []
    assert bm.num_cached_pages == 1               # b's page could not be cached under a taken key
    bm.free(b)
    assert len(bm.match_prefix(req([1, 2, 3, 4, 0], "c")).pages) == 1
    check_pool(bm, [])


def test_collision_with_same_tokens_under_another_parent(monkeypatch):
    # The key ignores the parent: page 2 of b has a's page-2 key and tokens but another prefix.
    monkeypatch.setattr(bm_mod, "_hash_fast", lambda prev, salt, tokens: hash(tokens))
    bm = BlockManager(32, PS)
    for rid, toks in (("a", [1, 1, 1, 1, 3, 3, 3, 3, 0]), ("c", [7, 7, 7, 7, 5, 5, 5, 5, 0])):
        r = req(toks, rid)
        compute_all(bm, r)
        bm.free(r)
    b = req([7, 7, 7, 7, 3, 3, 3, 3, 0], "b")
    m = bm.match_prefix(b)
    assert len(m.pages) == 1                      # c's first page, not a's second page
    check_pool(bm, [])


def test_hash_algos_agree_and_seed_changes_keys():
    def scenario(algo, seed=None):
        bm = BlockManager(10, PS, hash_algo=algo, hash_seed=seed)
        hits = []
        for i, toks in enumerate([range(13), range(11), list(range(4)) + [0] * 9, range(30, 40)]):
            r = req(toks, str(i))
            hits.append(len(compute_all(bm, r).pages))
            bm.free(r)
        check_pool(bm, [])
        return hits, bm.evictions, set(bm._cache)
    s1, s2 = "1" * 64, "2" * 64
    runs = [scenario(a, s1) for a in ("ahash64", "fast", "sha256", "sha256_64")]
    assert all(h == [0, 2, 1, 0] and e == runs[0][1] for h, e, _ in runs)
    assert runs[0][2] == runs[1][2]                               # fast is ahash64's old name
    assert all(len(k) == 8 for k in runs[3][2]) and all(len(k) == 32 for k in runs[2][2])
    assert scenario("ahash64", s1)[2] != scenario("ahash64", s2)[2]
    assert scenario("sha256", s1)[2] != scenario("sha256", s2)[2]
    assert scenario("sha256", s1)[2] == runs[2][2]
    # sha256 without a seed draws one at start-up (as max serve does); ahash64 does not
    assert scenario("sha256")[2] != scenario("sha256")[2]
    assert scenario("ahash64")[2] == scenario("ahash64")[2]


def test_prefix_caching_off_and_prompt_logprobs():
    bm = BlockManager(16, PS, enable_prefix_caching=False)
    a = req(range(9))
    compute_all(bm, a)
    assert bm.num_cached_pages == 0
    bm.free(a)
    assert bm.num_free_pages == 15
    bm = BlockManager(16, PS)
    compute_all(bm, req(range(9), "a"))
    r = req(range(9), "b")
    r.sampling.prompt_logprobs = True
    assert bm.match_prefix(r).pages == []


def test_reset_prefix_cache():
    bm = BlockManager(16, PS)
    a = req(range(9), "a")
    compute_all(bm, a)
    held = req(range(100, 109), "h")
    compute_all(bm, held)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_pages == 2               # the held request's pages stay cached
    bm.free(held)
    check_pool(bm, [])
