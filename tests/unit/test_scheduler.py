"""The scheduler on plain Python objects: exact chunks, block ids and preemption order."""

import pytest

from kvserve.core.scheduler.preemption import PreemptionCosts
from kvserve.request import RequestStatus
from tests.unit.scheduling import add, chunks, make_scheduler, step


def test_long_prompt_is_chunked_under_the_token_budget():
    sched = make_scheduler(budget=8)
    add(sched, "a", 20)
    assert chunks(step(sched)) == [("a", 8)]
    out = step(sched)
    assert chunks(out) == [("a", 8)]
    assert out.scheduled[0].num_computed_tokens == 8
    last = step(sched)
    assert chunks(last) == [("a", 4)] and last.scheduled[0].sample
    assert sched.requests["a"].output_token_ids == [7]
    sched.kv_cache.check_integrity()


def test_decodes_go_first_and_prefill_chunks_fill_the_rest():
    sched = make_scheduler(budget=10)
    add(sched, "a", 3)
    step(sched)  # a: whole prompt
    add(sched, "b", 30)
    out = step(sched)
    assert chunks(out) == [("a", 1), ("b", 9)]
    out = step(sched)
    assert chunks(out) == [("a", 1), ("b", 9)]  # the running prefill never stalls a's decode
    assert [s.sample for s in out.scheduled] == [True, False]


def test_prefill_first_runs_whole_prompts_in_steps_of_their_own():
    sched = make_scheduler(num_blocks=32, budget=10, policy="prefill_first")
    add(sched, "a", 3)
    step(sched)
    add(sched, "b", 6)
    add(sched, "c", 6)
    assert chunks(step(sched)) == [("b", 6)]  # c does not fit whole beside b; a's decode waits
    assert chunks(step(sched)) == [("c", 6)]
    assert chunks(step(sched)) == [("a", 1), ("b", 1), ("c", 1)]
    add(sched, "d", 25)  # longer than the budget: still whole, alone
    add(sched, "e", 2)
    assert chunks(step(sched)) == [("d", 25)]
    assert chunks(step(sched)) == [("e", 2)]
    assert chunks(step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)]
    sched.kv_cache.check_integrity()


def test_max_num_seqs_bounds_the_running_set():
    sched = make_scheduler(max_seqs=2)
    for name in "abc":
        add(sched, name, 2)
    out = step(sched)
    assert chunks(out) == [("a", 2), ("b", 2)]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_block_tables_have_exact_ids():
    sched = make_scheduler(block_size=4)
    add(sched, "a", 6)
    add(sched, "b", 3)
    out = step(sched)
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2]]
    out = step(sched)  # b's 4th token fills its block; a's 7th needs no new block
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2]]
    out = step(sched)
    assert [s.block_ids for s in out.scheduled] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_newest_request_is_preempted_and_resumed_first(prefix_caching):
    sched = make_scheduler(num_blocks=4, block_size=4, max_seqs=4, prefix_caching=prefix_caching)
    a = add(sched, "a", 7, max_tokens=6)
    b = add(sched, "b", 7, max_tokens=6)
    step(sched)  # a: blocks 0,1; b: blocks 2,3; each samples its 8th token
    step(sched)  # the 8th tokens fill the blocks; each samples its 9th
    out = step(sched)  # the 9th tokens need a third block each: only one can run
    assert out.preempted_request_ids == ["b"]
    assert chunks(out) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b"]
    # b freed tail first; a cached head (2) outlives the tail (3) in the eviction order
    assert sched.kv_cache.get_block_ids("a") == [0, 1, 3 if prefix_caching else 2]
    sched.kv_cache.check_integrity()
    while a.status == RequestStatus.RUNNING:
        step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 6
    out = step(sched)  # b comes back and recomputes its prompt and its two sampled tokens,
    # less its first block when that is still cached (it was released after its second)
    assert chunks(out) == [("b", 5 if prefix_caching else 9)]
    assert out.new_requests == []  # the runner kept its state across the preemption
    while sched.has_unfinished_requests():
        step(sched)
    assert b.output_token_ids == [7] * 6
    assert sched.kv_cache.num_used_blocks == 0
    sched.kv_cache.check_integrity()


def test_running_request_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=16)
    a = add(sched, "a", 8, max_tokens=4)
    step(sched)
    out = step(sched)  # a needs a third block; nobody else to evict
    assert out.preempted_request_ids == ["a"]
    assert a.status == RequestStatus.PREEMPTED
    sched.kv_cache.check_integrity()


def test_stop_conditions():
    sched = make_scheduler()
    eos = add(sched, "eos", 2, max_tokens=5)
    step(sched, token=2)
    assert eos.status == RequestStatus.FINISHED_STOPPED
    ign = add(sched, "ign", 2, max_tokens=2, ignore_eos=True)
    step(sched, token=2)
    step(sched, token=2)
    assert ign.status == RequestStatus.FINISHED_LENGTH and ign.output_token_ids == [2, 2]
    stop_id = add(sched, "stop-id", 2, max_tokens=5, stop_token_ids=[9], min_tokens=2)
    step(sched, token=9)  # below min_tokens: no stop
    assert stop_id.status == RequestStatus.RUNNING
    step(sched, token=9)
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 9
    assert sched.kv_cache.num_used_blocks == 0
    sched.kv_cache.check_integrity()


def test_finished_ids_reach_the_runner_and_abort_frees_blocks():
    sched = make_scheduler()
    add(sched, "a", 4, max_tokens=1)
    add(sched, "b", 4, max_tokens=10)
    step(sched)
    sched.finish_requests(["b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache.num_used_blocks == 0
    out = sched.schedule()
    assert out.finished_request_ids == {"a", "b"}
    assert not sched.has_unfinished_requests()
    sched.kv_cache.check_integrity()


def test_request_reaching_max_model_len_stops_with_length():
    sched = make_scheduler(max_len=5)
    r = add(sched, "a", 3, max_tokens=100)
    step(sched)
    step(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 5


def run_two_until_preempted(sched):
    """a and b fill the four blocks; the third step preempts b (newest) with 8 computed."""
    a = add(sched, "a", 7, max_tokens=6)
    b = add(sched, "b", 7, max_tokens=6)
    step(sched)
    step(sched)
    return a, b, step(sched)


def test_swap_preemption_keeps_the_kv_and_resumes_where_it_stopped():
    sched = make_scheduler(num_blocks=4, block_size=4, host_blocks=3, preemption_mode="swap")
    a, b, out = run_two_until_preempted(sched)
    assert out.preempted_request_ids == ["b"] and out.transfers.to_host == [(2, 0), (3, 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 8
    assert sched.kv_cache.num_used_host_blocks == 2 and sched.num_swapped_preemptions == 1
    sched.kv_cache.check_integrity()
    while a.status == RequestStatus.RUNNING:
        step(sched)
    out = step(sched)  # b comes back into fresh blocks and computes only its 9th token
    assert chunks(out) == [("b", 1)] and out.new_requests == []
    assert [host for host, _ in out.transfers.to_device] == [0, 1]
    assert [dev for _, dev in out.transfers.to_device] == sched.kv_cache.get_block_ids("b")[:2]
    assert sched.kv_cache.num_used_host_blocks == 0  # released once the runner copied them
    while sched.has_unfinished_requests():
        step(sched)
    assert b.output_token_ids == [7] * 6 and sched.kv_cache.num_used_blocks == 0
    sched.kv_cache.check_integrity()


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full():
    sched = make_scheduler(num_blocks=4, block_size=4, host_blocks=1, preemption_mode="swap")
    _, b, out = run_two_until_preempted(sched)
    assert out.preempted_request_ids == ["b"] and out.transfers.to_host == []
    assert b.num_computed_tokens == 0 and sched.num_swapped_preemptions == 0
    sched.kv_cache.check_integrity()


@pytest.mark.parametrize("prefill_seconds_per_token, swapped", [
    (None, True),  # nothing measured yet: a copy is assumed cheaper
    (1e-3, True),  # 8 tokens: 8 ms to recompute, 2 blocks x 2 ways x 1 ms to swap
    (1e-4, False),  # 0.8 ms to recompute
])
def test_auto_preemption_picks_the_cheaper_way(prefill_seconds_per_token, swapped):
    costs = PreemptionCosts(swap_seconds_per_block=1e-3,
                            prefill_seconds_per_token=prefill_seconds_per_token)
    sched = make_scheduler(num_blocks=4, block_size=4, host_blocks=4, preemption_mode="auto",
                           costs=costs)
    _, b, out = run_two_until_preempted(sched)
    assert out.preempted_request_ids == ["b"]
    assert sched.kv_cache.is_swapped(b) == swapped and bool(out.transfers.to_host) == swapped


def test_aborting_a_swapped_out_request_frees_its_host_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4, host_blocks=4, preemption_mode="swap")
    _, b, _ = run_two_until_preempted(sched)
    assert sched.kv_cache.num_used_host_blocks == 2
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache.num_used_host_blocks == 0
    sched.kv_cache.check_integrity()


def test_prefill_costs_are_measured_on_large_steps_only():
    costs = PreemptionCosts(swap_seconds_per_block=0.0)
    costs.observe_step(8, 1.0)  # a decode-sized step: fixed costs, not per-token ones
    assert costs.prefill_seconds_per_token is None
    costs.observe_step(100, 1.0)
    costs.observe_step(100, 2.0)
    assert costs.prefill_seconds_per_token == pytest.approx(0.01 + 0.2 * 0.01)
