"""Prefix-cache blocks offloaded to the host and disk tiers, on plain Python objects: what
is copied where, when a request waits for a promotion, and that nothing leaks."""

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from tests.unit.scheduling import add, chunks, make_scheduler, step

PROMPT = list(range(100, 109))  # two full blocks of four, and one token more


def run(sched, request_id, tokens):
    add(sched, request_id, tokens=tokens, max_tokens=1)
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched))
    return outs


def evict_prompt_blocks(sched):
    """Runs PROMPT, then a prompt that needs the whole pool, so PROMPT's cached blocks are
    evicted; returns that second run's first step."""
    run(sched, "a", PROMPT)
    return run(sched, "b", list(range(500, 515)))[0]


def test_evicted_blocks_go_to_the_host_tier_and_are_loaded_back():
    sched = make_scheduler(num_blocks=4, block_size=4, offload_blocks=4)
    out = evict_prompt_blocks(sched)
    kv = sched.kv_cache
    assert sorted(device for device, _ in out.transfers.to_host) == [0, 1]
    assert len(kv.tiers.host.cached) == 2
    c = add(sched, "c", tokens=PROMPT, max_tokens=1)
    prompt_host_blocks = [kv.tiers.host_block(h) for h in kv.block_hashes(c)[:2]]
    out = step(sched)
    assert chunks(out) == [("c", 1)]  # the two blocks are loaded, not computed
    table = out.scheduled[0].block_ids
    assert out.transfers.to_device == list(zip(prompt_host_blocks, table[:2], strict=True))
    assert kv.tiers.hits == {"host": 2, "disk": 0}
    assert kv.prefix_cache_hits == 8
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_a_full_host_tier_spills_to_disk_and_disk_hits_are_promoted_first():
    sched = make_scheduler(num_blocks=4, block_size=4, offload_blocks=2, disk_blocks=8)
    evict_prompt_blocks(sched)
    out = run(sched, "d", list(range(700, 715)))[0]  # evicts b's blocks into the host tier
    assert len(out.transfers.spill) == 2  # PROMPT's blocks go on to disk
    kv = sched.kv_cache
    assert len(kv.tiers.disk) == 2
    add(sched, "c", tokens=PROMPT, max_tokens=1)
    out = step(sched)
    assert chunks(out) == [] and len(out.transfers.promote) == 2  # c waits one step
    out = step(sched)
    assert chunks(out) == [("c", 1)] and len(out.transfers.to_device) == 2
    assert kv.tiers.hits == {"host": 0, "disk": 2}
    while sched.has_unfinished_requests():
        step(sched)
    kv.check_integrity()


def test_an_unreadable_disk_block_is_forgotten_and_computed_again():
    sched = make_scheduler(num_blocks=4, block_size=4, offload_blocks=2, disk_blocks=8)
    evict_prompt_blocks(sched)
    run(sched, "d", list(range(700, 715)))
    c = add(sched, "c", tokens=PROMPT, max_tokens=1)
    first, second = sched.kv_cache.find_cached_prefix(c).on_disk
    out = step(sched, failed_promotions=[first])  # the runner could not read the first
    assert [h for h, _ in out.transfers.promote] == [first, second]
    assert first not in sched.kv_cache.tiers.disk
    assert chunks(step(sched)) == [("c", 9)]  # no cached head left: all of it is computed
    sched.kv_cache.check_integrity()


def test_the_disk_tier_deletes_its_oldest_files_beyond_its_size():
    sched = make_scheduler(num_blocks=4, block_size=4, offload_blocks=2, disk_blocks=2)
    evict_prompt_blocks(sched)
    run(sched, "d", list(range(700, 715)))
    out = run(sched, "e", list(range(900, 915)))[0]  # b's blocks spill; PROMPT's are deleted
    assert len(out.transfers.spill) == 2 and len(out.transfers.delete) == 2
    assert len(sched.kv_cache.tiers.disk) == 2
    sched.kv_cache.check_integrity()


def test_reset_forgets_every_tier():
    sched = make_scheduler(num_blocks=4, block_size=4, offload_blocks=2, disk_blocks=8)
    evict_prompt_blocks(sched)
    run(sched, "d", list(range(700, 715)))
    sched.kv_cache.reset_prefix_cache()
    tiers = sched.kv_cache.tiers
    assert not tiers.host.cached and not tiers.disk
    assert len(sched.kv_cache.take_transfers().delete) == 2
    out = run(sched, "c", PROMPT)[0]
    assert chunks(out) == [("c", 9)]


def test_a_blended_prompt_loads_its_chunk_from_a_full_host_tier():
    """Holding a chunk found in the host tier allocates device blocks, whose evictions go to
    the host tier: the chunk's host blocks are pinned first, so they are not the ones
    reused."""
    sched = make_scheduler(num_blocks=6, block_size=4, offload_blocks=2)
    run(sched, "a", PROMPT)  # PROMPT[:8]'s blocks are a chunk's too
    run(sched, "b", list(range(500, 523)))  # all six blocks: PROMPT's go to the host tier
    kv = sched.kv_cache
    request = Request("c", PROMPT[:8] + [42], SamplingParams(), max_tokens=1,
                      segment_lens=(8, 1))
    sched.add_request(request)
    out = step(sched)
    assert chunks(out) == [("c", 9)] and out.scheduled[0].reused_spans == ((0, 8),)
    assert len(out.transfers.to_device) == 2 and len(out.transfers.chunks) == 1
    assert kv.tiers.hits == {"host": 2, "disk": 0}
    while sched.has_unfinished_requests():
        step(sched)
    assert kv.num_used_blocks == 0
    kv.check_integrity()
