"""Speculative decoding's pieces on plain data: prompt lookup, the draft policy, the
scheduler's bookkeeping of drafts, and exact rejection sampling."""

import numpy as np
import pytest
import torch

from kvserve.config import SpeculativeConfig
from kvserve.core.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.core.scheduler.speculation import DraftPolicy
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.worker.sampler import Sampler
from kvserve.worker.speculative import Drafter, lookup_ngram
from kvserve.worker.structured_output import GrammarMatchers
from tests.unit.scheduling import add, make_scheduler


def lookup(tokens, num_drafts=3, min_n=1, max_n=3):
    return lookup_ngram(np.array(tokens), num_drafts, min_n, max_n)


def test_lookup_prefers_the_longest_suffix_then_the_latest_occurrence():
    # "1 2" occurred before "9" and before "5"; "0 1 2" only before "7 8".
    assert lookup([0, 1, 2, 7, 8, 1, 2, 9, 1, 2, 5, 0, 1, 2]) == [7, 8, 1]
    assert lookup([1, 2, 9, 1, 2, 5, 6, 1, 2]) == [5, 6, 1]
    assert lookup([1, 2, 9, 4, 1, 2], num_drafts=2) == [9, 4]


def test_lookup_needs_min_n_tokens_of_match_and_a_token_after_it():
    assert lookup([5, 6, 7, 8]) == []
    assert lookup([3, 4, 9, 4], min_n=2) == []  # only "4" recurs
    assert lookup([3, 4, 9, 4], min_n=1) == [9, 4]
    assert lookup([4, 4]) == [4]  # the overlapping match runs into the end


def test_drafter_skips_requests_whose_sampling_depends_on_more_than_logits():
    sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=2))
    prompt = [1, 2, 3, 1, 2]
    plain = sampler.new_state(SamplingParams(), prompt, ())
    penalized = sampler.new_state(SamplingParams(repetition_penalty=1.2), prompt, ())
    with_logprobs = sampler.new_state(SamplingParams(logprobs=1), prompt, ())
    waiting = sampler.new_state(SamplingParams(min_tokens=3), prompt, ())
    drafts = drafter.propose(["a", "b", "c", "d"], [plain, penalized, with_logprobs, waiting])
    assert drafts == {"a": [3, 1]}
    plain.output_token_ids += [3, 1]  # outputs extend the history the lookup sees
    assert drafter.propose(["a"], [plain]) == {"a": [2, 3]}


def request_with(drafts, hits=0.0, trials=0.0):
    request = Request("r", [1, 2, 3], SamplingParams())
    request.spec_token_ids, request.draft_hits, request.draft_trials = drafts, hits, trials
    return request


def test_policy_scores_drafts_against_the_tokens_that_came():
    policy = DraftPolicy()
    request = request_with([5, 6, 7])
    policy.observe(request, [5, 6, 9])  # two kept, the third was wrong
    assert (request.draft_hits, request.draft_trials) == pytest.approx((2, 3))
    request = request_with([5, 6, 7])
    policy.observe(request, [5])  # unverified drafts: only the first is scored
    assert (request.draft_hits, request.draft_trials) == pytest.approx((1, 1))


def test_policy_verifies_drafts_that_pay_and_stops_when_they_do_not():
    policy = DraftPolicy()
    drafts = [5, 6, 7, 8]
    assert policy.num_to_verify(request_with(drafts, hits=20, trials=20), 1) == 4
    assert policy.num_to_verify(request_with(drafts, hits=0, trials=20), 1) == 0
    # At a large batch a row costs as much as a sequence's step is worth: no drafts.
    assert policy.num_to_verify(request_with(drafts, hits=10, trials=20), 256) == 0


def test_policy_fits_the_step_cost_of_decode_rows():
    policy = DraftPolicy()
    for rows in (1, 2, 3, 5) * 4:
        step = SchedulerOutput([ScheduledRequest("r", [0] * rows, 10, [0], True,
                                                 num_draft_tokens=rows - 1)])
        policy.observe_step(step.shape, 0.010 + 0.005 * rows)
    fixed, per_row = policy.step_cost()
    assert per_row / fixed == pytest.approx(0.5)
    # Rows this dear need a high acceptance to pay.
    assert policy.num_to_verify(request_with([5, 6], hits=2, trials=10), 1) == 0
    assert policy.num_to_verify(request_with([5, 6], hits=19, trials=20), 1) == 2


def prefilled_with_drafts(drafts, budget=16, num_prompt=6, max_tokens=20):
    """A scheduler whose one request has prefilled, sampled 7, and been given `drafts`."""
    sched = make_scheduler(budget=budget, block_size=4)
    request = add(sched, "a", num_prompt=num_prompt, max_tokens=max_tokens)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[7]], draft_token_ids={"a": drafts}))
    return sched, request


def test_scheduler_verifies_drafts_and_uncounts_the_rejected():
    sched, request = prefilled_with_drafts([8, 9])
    assert request.spec_token_ids == [8, 9]
    out = sched.schedule()
    (scheduled,) = out.scheduled
    assert scheduled.token_ids == [7, 8, 9] and scheduled.num_draft_tokens == 2
    assert request.num_computed_tokens == 9
    # The model kept 8, then chose 4 over 9.
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[8, 4]]))
    assert request.output_token_ids == [7, 8, 4] and request.num_computed_tokens == 8
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (2, 1)
    assert request.spec_token_ids == []
    assert sched.schedule().scheduled[0].token_ids == [4]


def test_drafts_stop_at_the_budget_max_tokens_and_a_stop_token():
    sched, _ = prefilled_with_drafts([8, 9, 10], budget=3, num_prompt=3)
    assert sched.schedule().scheduled[0].num_draft_tokens == 2  # the token and two drafts
    sched, _ = prefilled_with_drafts([8, 9, 10], max_tokens=3)
    # max_tokens 3 with one out: one draft, and the model's token.
    assert sched.schedule().scheduled[0].num_draft_tokens == 1
    sched, request = prefilled_with_drafts([2, 5, 6], max_tokens=8)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[2, 5, 6, 3]]))
    assert request.output_token_ids == [7, 2] and request.is_finished  # 2 is EOS
    sched.kv_cache.check_integrity()
    assert sched.kv_cache.num_used_blocks == 0


def test_drafts_give_way_before_anyone_is_preempted():
    sched = make_scheduler(num_blocks=2, budget=16, block_size=4)
    first = add(sched, "a", num_prompt=3, max_tokens=20)
    add(sched, "b", num_prompt=3, max_tokens=20)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a", "b"], [[7], [7]],
                                                    draft_token_ids={"a": [8, 9]}))
    out = sched.schedule()  # a's drafts would need a third block
    assert [(s.request_id, s.num_draft_tokens) for s in out.scheduled] == [("a", 0), ("b", 0)]
    assert sched.num_preemptions == 0 and first.num_computed_tokens == 4


def drafted_rows(draft, first_logits, second_logits, count):
    """`count` requests, each with one draft and two rows of logits."""
    logits = torch.stack([first_logits, second_logits]).repeat(count, 1)
    return logits, [[draft]] * count


def test_verify_keeps_the_distribution_of_sampling_without_drafts():
    first = torch.tensor([2.0, 0.5, float("-inf"), 1.0, -1.0, 3.0])
    second = torch.tensor([0.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    count = 30000
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)):
        for draft in (5, 1, 2):  # likely, unlikely, impossible
            sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
            states = [sampler.new_state(params, [1], ()) for _ in range(count)]
            logits, drafts = drafted_rows(draft, first, second, count)
            tokens = sampler.verify(logits, states, drafts)
            firsts = torch.tensor([t[0] for t in tokens])
            expected = torch.softmax(_filtered(first, params), dim=-1)
            freq = torch.bincount(firsts, minlength=6) / count
            assert torch.allclose(freq, expected, atol=0.012), (params, draft, freq, expected)
            kept = [t for t in tokens if len(t) == 2]
            assert all(t[0] == draft for t in kept)  # only an accepted draft goes on
            if len(kept) > 3000:
                seconds = torch.bincount(torch.tensor([t[1] for t in kept]), minlength=6)
                expected = torch.softmax(_filtered(second, params), dim=-1)
                assert torch.allclose(seconds / len(kept), expected, atol=0.025)


def test_verify_weighs_a_sampled_draft_by_both_distributions():
    """A draft drawn from q stays with probability min(1, p / q), else the token comes from
    max(0, p - q): the first token follows p, and drafts stay at the rate sum(min(p, q))."""
    p_logits = torch.tensor([2.0, 0.5, float("-inf"), 1.0, -1.0, 3.0])
    second = torch.zeros(6)
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(p_logits, dim=-1)
    count = 30000
    for q in (torch.tensor([0.1, 0.2, 0.3, 0.1, 0.1, 0.2]), p.clone()):
        gen = torch.Generator().manual_seed(1)
        drawn = torch.multinomial(q, count, replacement=True, generator=gen)
        sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
        states = [sampler.new_state(params, [1], ()) for _ in range(count)]
        logits = torch.stack([p_logits, second]).repeat(count, 1)
        tokens = sampler.verify(logits, states, [[int(d)] for d in drawn],
                                [q.unsqueeze(0)] * count)
        freq = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=6) / count
        assert torch.allclose(freq, p, atol=0.012), (q, freq, p)
        kept = sum(len(t) == 2 for t in tokens) / count
        assert abs(kept - torch.minimum(p, q).sum().item()) < 0.012


def _filtered(logits, params):
    scaled = logits / params.temperature
    if params.top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1],
                                    float("-inf"))
    return scaled


def test_greedy_verify_keeps_drafts_while_they_are_the_argmax():
    sampler = Sampler(seed=0, device="cpu", grammars=GrammarMatchers("", 0))
    state = sampler.new_state(SamplingParams(temperature=0.0), [1], ())
    logits = torch.eye(6)[[3, 4, 0, 5]]  # argmax 3, 4, 0, 5
    assert sampler.verify(logits, [state], [[3, 4, 1]]) == [[3, 4, 0]]
    assert sampler.verify(logits, [state], [[3, 4, 0]]) == [[3, 4, 0, 5]]
    assert sampler.verify(logits, [state], [[2, 4, 0]]) == [[3]]


def test_draft_model_steps_are_proposed_only_where_they_pay():
    policy = DraftPolicy()
    for rows in (1, 2) * 4:  # decode steps of 10 ms plus 1 ms a row
        step = SchedulerOutput([ScheduledRequest("r", [0] * rows, 10, [0], True,
                                                 num_draft_tokens=rows - 1)])
        policy.observe_step(step.shape, 0.010 + 0.001 * rows)
    request = request_with([], hits=19, trials=20)
    request.output_token_ids = [0]
    policy.observe_drafting(0.002, 1)  # a cheap draft model: all four drafts
    assert policy.num_to_propose(request, 1, 4) == 4
    policy.observe_drafting(1.0, 1)  # as dear as whole steps: none, but a probe now and then
    assert policy.num_to_propose(request, 1, 4) == 0
    probes = []
    for produced in range(2, 200):
        request.output_token_ids = [0] * produced
        if policy.num_to_propose(request, 1, 4):
            probes.append(produced)
    assert probes == [17, 33, 65, 129]  # 16 after it last drafted, then gaps that double
