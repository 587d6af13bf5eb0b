"""Prefix caching at block level: what hits, what misses, what is evicted and when."""

from kvserve.core.kv_cache.hashing import hash_block
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from tests.unit.scheduling import add, chunks, make_scheduler, step

HEAD = list(range(100, 112))  # three full blocks of 4


def run_to_end(sched, max_steps=100):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests()
    sched.kv_cache.check_integrity()


def test_shared_head_is_hit_block_for_block():
    sched = make_scheduler()
    add(sched, "a", tokens=HEAD + [1, 2])
    step(sched)
    head_blocks = sched.kv_cache.get_block_ids("a")[:3]
    run_to_end(sched)
    b = add(sched, "b", tokens=HEAD + [3, 4, 5])
    out = step(sched)
    assert chunks(out) == [("b", 3)]  # 12 of 15 tokens come from the cache
    assert out.scheduled[0].num_computed_tokens == 12
    assert out.scheduled[0].block_ids[:3] == head_blocks
    kv = sched.kv_cache
    assert kv.prefix_cache_queries == 14 + 15 and kv.prefix_cache_hits == 12
    assert b.num_computed_tokens == 15
    run_to_end(sched)


def test_one_differing_token_misses_that_block_and_all_after_it():
    sched = make_scheduler()
    add(sched, "a", tokens=HEAD + [1])
    run_to_end(sched)
    changed = HEAD.copy()
    changed[5] = 9999  # inside the second block
    add(sched, "b", tokens=changed + [1])
    assert chunks(step(sched)) == [("b", 9)]  # only the first block hits
    run_to_end(sched)


def test_the_last_prompt_token_is_always_computed():
    sched = make_scheduler()
    add(sched, "a", tokens=HEAD)
    run_to_end(sched)
    add(sched, "b", tokens=HEAD)
    out = step(sched)
    assert chunks(out) == [("b", 4)]  # two blocks hit; the third holds the last token
    assert out.scheduled[0].sample
    run_to_end(sched)


def test_salts_isolate_and_equal_salts_share():
    sched = make_scheduler()
    add(sched, "a", tokens=HEAD + [1], cache_salt="tenant-1")
    run_to_end(sched)
    add(sched, "b", tokens=HEAD + [1], cache_salt="tenant-2")
    assert chunks(step(sched)) == [("b", 13)]
    run_to_end(sched)
    add(sched, "c", tokens=HEAD + [1])  # no salt is a salt of its own
    assert chunks(step(sched)) == [("c", 13)]
    run_to_end(sched)
    add(sched, "d", tokens=HEAD + [1], cache_salt="tenant-1")
    assert chunks(step(sched)) == [("d", 1)]
    run_to_end(sched)
    assert hash_block(None, HEAD[:4], ("salt:x",)) != hash_block(None, HEAD[:4])


def test_eviction_takes_the_least_recently_released_and_its_tail_first():
    sched = make_scheduler(num_blocks=4, budget=32)
    a_head, b_head = list(range(100, 108)), list(range(200, 208))
    for name, head in (("a", a_head), ("b", b_head)):  # two cached blocks each, a's first
        add(sched, name, tokens=head, max_tokens=1)
        run_to_end(sched)
    add(sched, "c", tokens=list(range(300, 304)), max_tokens=1)  # takes one block
    run_to_end(sched)

    def num_cached_blocks(head):
        probe = Request("probe", head + [1], SamplingParams())
        return len(sched.kv_cache.find_cached_prefix(probe))

    assert num_cached_blocks(a_head) == 1  # a's tail was evicted, its head kept
    assert num_cached_blocks(b_head) == 2


def test_a_request_waits_a_step_for_a_head_computed_beside_it():
    sched = make_scheduler(budget=64)
    add(sched, "a", tokens=HEAD + [1])
    add(sched, "b", tokens=HEAD + [2])
    assert chunks(step(sched)) == [("a", 13)]  # b would compute the same blocks
    assert chunks(step(sched)) == [("a", 1), ("b", 1)]
    run_to_end(sched)


def test_preempting_a_sharer_keeps_the_shared_blocks_with_the_other():
    sched = make_scheduler(num_blocks=6, budget=64)  # a needs 5 blocks, b 2 more of its own
    a = add(sched, "a", tokens=HEAD + [1], max_tokens=8, ignore_eos=True)
    step(sched)
    b = add(sched, "b", tokens=HEAD + [2], max_tokens=8, ignore_eos=True)
    step(sched)
    shared = sched.kv_cache.get_block_ids("a")[:3]
    assert sched.kv_cache.get_block_ids("b")[:3] == shared
    assert [sched.kv_cache.pool.ref_counts[i] for i in shared] == [2, 2, 2]
    for _ in range(8):
        if b.status == RequestStatus.PREEMPTED:
            break
        step(sched)
        sched.kv_cache.check_integrity()
    assert b.status == RequestStatus.PREEMPTED
    assert [sched.kv_cache.pool.ref_counts[i] for i in shared] == [1, 1, 1]
    run_to_end(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert sched.kv_cache.num_used_blocks == 0


def test_reset_prefix_cache_forgets_everything():
    sched = make_scheduler()
    add(sched, "a", tokens=HEAD + [1])
    run_to_end(sched)
    sched.kv_cache.reset_prefix_cache()
    add(sched, "b", tokens=HEAD + [1])
    assert chunks(step(sched)) == [("b", 13)]
    run_to_end(sched)


def test_caching_off_never_hits():
    sched = make_scheduler(prefix_caching=False)
    add(sched, "a", tokens=HEAD + [1])
    run_to_end(sched)
    add(sched, "b", tokens=HEAD + [1])
    assert chunks(step(sched)) == [("b", 13)]
    assert sched.kv_cache.prefix_cache_hits == 0
    run_to_end(sched)


def test_admission_counts_hits_so_sharers_fit_where_strangers_do_not():
    def admitted(tokens_of):
        sched = make_scheduler(num_blocks=8, budget=64)
        for i in range(6):
            add(sched, f"r{i}", tokens=tokens_of(i), max_tokens=4)
        for _ in range(2):
            step(sched)
        return len(sched.running)

    # Each request needs four blocks: alone, two fit in eight; sharing a three-block head,
    # five do (the first computes the head, the others join a step later).
    assert admitted(lambda i: list(range(1000 * i, 1000 * i + 13))) == 2
    assert admitted(lambda i: HEAD + [i]) == 5
