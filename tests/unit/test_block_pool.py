import pytest

from kvserve.core.kv_cache.block_pool import BlockPool
from kvserve.core.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt: int) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams(), max_tokens=8)


def test_uncached_blocks_are_reused_first_and_cached_ones_in_release_order():
    pool = BlockPool(5)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.cache(0, b"h0")
    pool.cache(1, b"h1")
    pool.free([1, 3, 0, 2])  # uncached 3 and 2 go to the front, cached 1 and 0 to the back
    assert pool.free_block_ids() == [2, 3, 4, 1, 0]
    # the least recently released cached block goes; a request gets its blocks ascending
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") == 0
    assert pool.ref_counts == [0, 1, 1, 1, 1]


def test_a_growing_table_takes_the_next_block_when_it_is_free_and_caches_nothing():
    pool = BlockPool(8)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == [4]
    pool.cache(4, b"h4")
    pool.free([4])  # cached: it waits at the back, in eviction order, for its hash's sake
    assert pool.allocate(1, after=3) == [5]  # so 3's successor is not taken: the front is
    pool.free([2, 3])
    assert pool.allocate(3, after=1) == [2, 3, 6]  # 2 and 3 follow 1; then the front


def test_allocate_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3 blocks with 2 free"):
        pool.allocate(3)


def test_double_free_is_caught():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(ids)


def test_manager_grows_tables_block_by_block():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", 5)
    assert kv.allocate_slots(a, 5)
    assert kv.get_block_ids("a") == [0, 1]
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 3)  # 8 tokens still fit in two blocks
    assert kv.get_block_ids("a") == [0, 1]
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 1)
    assert kv.get_block_ids("a") == [0, 1, 2]
    kv.check_integrity()


def test_manager_refuses_without_side_effects_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 1
    kv.check_integrity()


def cached_then_freed(num_tokens: int) -> KVCacheManager:
    """A pool of 4 blocks of 2 after one request computed, cached and freed its prompt."""
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", num_tokens)
    kv.allocate_slots(a, num_tokens)
    a.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(a)
    kv.free(a)
    return kv


def test_free_releases_tail_first():
    kv = cached_then_freed(6)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]  # the shared head is evicted last
    kv.check_integrity()


def test_integrity_check_detects_a_leak():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.pool.allocate(1)  # referenced, but no table holds it
    with pytest.raises(AssertionError, match="block 0: 1 references"):
        kv.check_integrity()


def test_drained_check_detects_a_leak_and_passes_a_cached_pool():
    kv = cached_then_freed(4)
    kv.check_drained()  # cached blocks are free blocks
    kv.pool.allocate(1)  # referenced, but no request is left
    with pytest.raises(AssertionError, match="1 blocks are referenced with no request left"):
        kv.check_drained()
