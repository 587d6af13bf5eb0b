"""Attention sinks and a sliding window (StreamingLLM) on plain Python objects: bounded
blocks, contiguous cache positions, key shifts, and streams past max_model_len."""

from kvserve.request import RequestStatus
from tests.unit.scheduling import add, chunks, make_scheduler, step


def streaming(**kwargs):
    options = dict(num_blocks=16, block_size=4, budget=16, max_len=16, prefix_caching=False,
                   sink_blocks=1, window_blocks=3)
    return make_scheduler(**{**options, **kwargs})


def test_a_stream_runs_past_max_model_len_in_bounded_blocks():
    sched = streaming()
    r = add(sched, "a", 6, max_tokens=40)
    peak = 0
    while sched.has_unfinished_requests():
        out = step(sched)
        peak = max(peak, len(sched.kv_cache.get_block_ids("a")))
        for s in out.scheduled:
            # cache positions stay within sinks + window
            assert s.num_computed_tokens - s.num_evicted_tokens + len(s.token_ids) <= 16
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 40
    assert r.num_tokens == 46 > 16 and peak == 4
    assert sched.kv_cache.num_used_blocks == 0
    sched.kv_cache.check_integrity()


def test_the_oldest_window_block_goes_and_the_rest_shift_back():
    sched = streaming()
    a = add(sched, "a", 16, max_tokens=8)  # fills the sink block and the whole window
    assert chunks(step(sched)) == [("a", 8)]  # a chunk fits in the window less a block
    step(sched)  # the rest of the prompt: 16 tokens in blocks 0 (sink), 1, 2, 3
    assert a.num_computed_tokens == 16 and a.num_evicted_tokens == 0
    sink, first, *rest = sched.kv_cache.get_block_ids("a")
    out = step(sched)  # token 17 needs a fifth block: block 1 (tokens 4-7) is dropped
    assert a.num_evicted_tokens == 4
    assert out.transfers.shift == [(rest, 4)]
    # token 17 goes to the block after the last one, which keeps the table consecutive
    assert sched.kv_cache.get_block_ids("a") == [sink, *rest, rest[-1] + 1]
    assert first in sched.kv_cache.pool.free_block_ids()
    (scheduled,) = out.scheduled
    assert (scheduled.num_computed_tokens, scheduled.num_evicted_tokens) == (16, 4)
    sched.kv_cache.check_integrity()


def test_long_prompts_are_chunked_to_fit_the_window():
    sched = streaming(window_blocks=4, max_len=20, max_seqs=1)
    add(sched, "a", 40, max_tokens=1)
    sizes = []
    while sched.has_unfinished_requests():
        sizes += [n for _, n in chunks(step(sched))]
    assert sizes == [12, 12, 12, 4] and max(sizes) <= 3 * 4


def stream_chunks(others: list[int], **options) -> list[int]:
    """The chunks a 40-token stream's prompt is computed in, queued behind prompts of
    `others` tokens that then decode beside it."""
    sched = streaming(**{"window_blocks": 4, "max_len": 20, "num_blocks": 32, **options})
    for i, num_prompt in enumerate(others):
        add(sched, f"other{i}", num_prompt, max_tokens=30)
    add(sched, "a", 40, max_tokens=1)
    sizes = []
    while sched.has_unfinished_requests():
        sizes += [n for request_id, n in chunks(step(sched)) if request_id == "a"]
    sched.kv_cache.check_integrity()
    return sizes


def test_a_streams_chunks_start_where_they_would_alone():
    """The cached keys a chunk's queries see depend on where the chunk starts, so a stream's
    prompt is cut at the same places whatever else takes the step's budget: beside other
    prompts it waits for a step with room for a whole chunk. The stride leaves room beside
    max_num_seqs - 1 decodes (16 - 4 + 1 = 13 tokens; the window allows 12)."""
    alone = stream_chunks([], max_seqs=4)
    assert alone == [12, 12, 12, 4]
    assert stream_chunks([10], max_seqs=4) == stream_chunks([3, 7, 5], max_seqs=4) == alone
    assert stream_chunks([3, 7, 5], max_seqs=8) == [9, 9, 9, 9, 4]  # 16 - 8 + 1


def test_without_sinks_the_window_alone_slides():
    sched = streaming(sink_blocks=0)
    a = add(sched, "a", 12, max_tokens=5)
    while sched.has_unfinished_requests():
        step(sched)
    assert a.num_evicted_tokens == 4  # 12 + 4 sampled tokens computed: one block dropped
    sched.kv_cache.check_integrity()


def test_a_swapped_stream_resumes_with_its_window_and_shifts():
    sched = streaming(num_blocks=5, host_blocks=8, preemption_mode="swap")
    a = add(sched, "a", 16, max_tokens=12)
    step(sched)
    step(sched)  # a slides once
    add(sched, "b", 3, max_tokens=12)
    while sched.kv_cache.is_swapped(a) is False and sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache.is_swapped(a) or a.is_finished
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.num_swapped_preemptions > 0
    assert a.num_output_tokens == 12 and sched.kv_cache.num_used_host_blocks == 0
    sched.kv_cache.check_integrity()
