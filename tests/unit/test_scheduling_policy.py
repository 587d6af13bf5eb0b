"""Priority and fair scheduling on plain Python objects: who starts first, whose chunks
yield, who is preempted, and that nobody starves."""

import time

from kvserve.core.scheduler import policy
from kvserve.request import RequestStatus
from tests.unit.scheduling import add, chunks, make_scheduler, step


def running_ids(sched):
    return [r.request_id for r in sched.running]


def test_fcfs_ignores_priority():
    sched = make_scheduler(budget=4, max_seqs=1)
    add(sched, "low", 4, priority=5)
    add(sched, "high", 4, priority=0)
    assert chunks(step(sched)) == [("low", 4)]


def test_priority_admits_the_lowest_value_first_and_arrival_order_within_it():
    sched = make_scheduler(budget=4, max_seqs=8, scheduling_policy="priority")
    add(sched, "low", 4, priority=5)
    add(sched, "high-1", 4, priority=0)
    add(sched, "high-2", 4, priority=0)
    assert chunks(step(sched)) == [("high-1", 4)]
    assert chunks(step(sched)) == [("high-1", 1), ("high-2", 3)]


def test_waiting_high_priority_preempts_low_priority_for_a_sequence_slot():
    sched = make_scheduler(num_blocks=16, budget=16, max_seqs=1, scheduling_policy="priority")
    low = add(sched, "low", 4, max_tokens=8, priority=3)
    step(sched)
    high = add(sched, "high", 4, priority=0)
    out = step(sched)  # the pool has room: only the sequence limit stands in the way
    assert out.preempted_request_ids == ["low"] and chunks(out) == [("high", 4)]
    assert low.status == RequestStatus.PREEMPTED and high.status == RequestStatus.RUNNING
    while high.status == RequestStatus.RUNNING:
        step(sched)
    while sched.has_unfinished_requests():
        step(sched)
    assert low.num_output_tokens == 8 and sched.kv_cache.num_used_blocks == 0
    sched.kv_cache.check_integrity()


def test_equal_priority_never_preempts():
    sched = make_scheduler(max_seqs=1, scheduling_policy="priority")
    add(sched, "first", 4, max_tokens=8, priority=1)
    step(sched)
    add(sched, "second", 4, priority=1)
    out = step(sched)
    assert out.preempted_request_ids == [] and chunks(out) == [("first", 1)]


def test_high_priority_takes_the_budget_of_a_running_low_priority_prefill():
    sched = make_scheduler(num_blocks=32, budget=8, scheduling_policy="priority")
    low = add(sched, "low", 40, priority=2)
    assert chunks(step(sched)) == [("low", 8)]
    add(sched, "high", 6, priority=0)
    out = step(sched)  # low's chunk is deferred, not preempted: it keeps its blocks
    assert chunks(out) == [("high", 6)] and out.preempted_request_ids == []
    assert low.status == RequestStatus.RUNNING and low.num_computed_tokens == 8
    assert chunks(step(sched)) == [("high", 1), ("low", 7)]
    sched.kv_cache.check_integrity()


def test_blocks_running_short_preempt_the_lowest_priority_not_the_newest():
    sched = make_scheduler(num_blocks=4, block_size=4, scheduling_policy="priority")
    add(sched, "low", 7, max_tokens=6, priority=4)
    add(sched, "high", 7, max_tokens=6, priority=0)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted_request_ids == ["low"] and chunks(out) == [("high", 1)]


def test_a_request_waiting_past_the_starvation_limit_goes_before_any_priority():
    sched = make_scheduler(budget=4, max_seqs=8, scheduling_policy="priority")
    old = add(sched, "old-low", 4, priority=9)
    old.arrival_time = time.monotonic() - sched.policy.starvation_seconds - 1
    add(sched, "high", 4, priority=0)
    assert chunks(step(sched)) == [("old-low", 4)]


def test_fair_alternates_tenants_by_tokens_served():
    sched = make_scheduler(num_blocks=64, budget=4, max_seqs=8, scheduling_policy="fair")
    for i in range(3):
        add(sched, f"a{i}", 4, max_tokens=1, tenant="a")
    add(sched, "b0", 4, max_tokens=1, tenant="b")
    add(sched, "b1", 4, max_tokens=1, tenant="b")
    order = []
    while sched.has_unfinished_requests():
        order += [s.request_id for s in step(sched).scheduled]
    assert order == ["a0", "b0", "a1", "b1", "a2"]
    sched.kv_cache.check_integrity()


def test_fair_tenant_returning_from_idle_gets_no_credit():
    sched = make_scheduler(num_blocks=64, budget=4, max_seqs=8, scheduling_policy="fair")
    add(sched, "a0", 4, max_tokens=1, tenant="a")
    step(sched)
    for i in range(1, 4):
        add(sched, f"b{i}", 4, max_tokens=1, tenant="b")
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.policy.service == {"a": 4, "b": 12}
    add(sched, "a1", 4, max_tokens=1, tenant="a")  # a was idle: it starts where b is
    add(sched, "b4", 4, max_tokens=1, tenant="b")
    assert sched.policy.service["a"] == 4  # nobody else had work: nothing to catch up to
    add(sched, "c0", 4, max_tokens=1, tenant="c")
    assert sched.policy.service["c"] == 4  # the least served of the tenants with work


def test_fair_keeps_only_the_most_recently_idle_tenants(monkeypatch):
    monkeypatch.setattr(policy, "MAX_IDLE_TENANTS", 2)
    sched = make_scheduler(num_blocks=64, budget=4, max_seqs=8, scheduling_policy="fair")
    add(sched, "long", 4, max_tokens=30, tenant="busy")
    for i in range(4):  # one request each, then idle
        add(sched, f"t{i}", 4, max_tokens=1, tenant=f"t{i}")
        step(sched)
        step(sched)
    assert list(sched.policy.idle) == ["t2", "t3"]
    assert set(sched.policy.service) == {"busy", "t2", "t3"}
    assert sched.policy.num_requests == {"busy": 1}
    served = sched.policy.service["busy"]
    add(sched, "back", 4, max_tokens=1, tenant="t0")  # forgotten: it comes back as new
    assert sched.policy.service["t0"] == served and list(sched.policy.idle) == ["t2", "t3"]
    while sched.has_unfinished_requests():
        step(sched)
    assert list(sched.policy.idle) == ["t0", "busy"] and sched.policy.num_requests == {}
    sched.kv_cache.check_integrity()


def test_fair_preempts_only_a_tenant_served_a_step_beyond():
    sched = make_scheduler(num_blocks=64, budget=4, max_seqs=1, scheduling_policy="fair")
    heavy = add(sched, "heavy", 4, max_tokens=20, tenant="a")
    step(sched)
    add(sched, "light", 4, max_tokens=1, tenant="b")
    # b's counter starts at a's (the least served with work): no preemption yet
    assert step(sched).preempted_request_ids == []
    sched.policy.service["a"] += 5  # a has now been served more than a step's budget beyond
    out = step(sched)
    assert out.preempted_request_ids == ["heavy"] and chunks(out) == [("light", 4)]
    while sched.has_unfinished_requests():
        step(sched)
    assert heavy.num_output_tokens == 20
    sched.kv_cache.check_integrity()
